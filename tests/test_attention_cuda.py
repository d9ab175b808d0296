"""GPU checks that run without nbdev (the GPU machine has none): fused (SDPA and FlexAttention) against explicit attention on CUDA (fp32 and bf16),
the fused kernel with the in-place shift's strided mask, the cached inference path, the reused projections of the
reconstruction loss, the host syncs of a training window and of evaluation, sampling with a CPU generator, and a short form of the GPU benchmark.
Every test here skips cleanly on a machine without CUDA."""
import traceback, warnings
from dataclasses import replace
import pytest
import torch
import torch.nn.functional as F
from compressive_tutorial.attention import RelativeMultiHeadAttention, attention_mask, shift_masked, shift_masked_
from compressive_tutorial.model import CTConfig, CompressiveTransformer, layer_compression_loss
from compressive_tutorial.train import sample, bf16_native, evaluate
from compressive_tutorial.data import StreamLoader
from compressive_tutorial.xl import reach_from_visibility, xl_equivalent_mask
from compressive_tutorial.bench import BENCH_GPU, run_benchmark, report

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')
DEV = 'cuda'


def randomized(m, seed=0, std=0.5):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters(): p.normal_(0, std)
    return m


def _pair(d=64, H=4, clamp_len=None, impl='sdpa'):
    ex = randomized(RelativeMultiHeadAttention(d, H, attn_impl='explicit', clamp_len=clamp_len), std=0.1).to(DEV)
    fa = RelativeMultiHeadAttention(d, H, attn_impl=impl, clamp_len=clamp_len).to(DEV); fa.load_state_dict(ex.state_dict())
    return ex, fa


@pytest.mark.parametrize('impl', ['sdpa', 'flex'])   # flex: FlexAttention's generated kernel, the shift read inside it
@pytest.mark.parametrize('T,M', [(1, 0), (64, 0), (64, 128), (32, 200)])
def test_fused_equals_explicit_fp32(T, M, impl):
    ex, fa = _pair(impl=impl)
    torch.manual_seed(1)
    h = torch.randn(3, T, 64, device=DEV, requires_grad=True); mem = torch.randn(3, M, 64, device=DEV)
    mv = torch.rand(3, M, device=DEV) > 0.2
    first = torch.rand(3, T, device=DEV) < 0.1                  # episode starts: a per-query mask
    grads = []
    for m in (ex, fa):
        out = m(h, mem, mv, first=first)
        grads.append((out, torch.autograd.grad(out.pow(2).sum(), [h] + list(m.parameters()))))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-4, atol=1e-4)
    for a, b in zip(grads[1][1], grads[0][1]):   # relative to each gradient's size, but a gradient that is 0 (one key: every
        assert (a - b).abs().max() <= 1e-4 * b.abs().max() + 1e-5, 'gradients differ'   # score term) is 0 up to rounding


@pytest.mark.parametrize('impl', ['sdpa', 'flex'])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_fused_under_autocast_is_close_to_fp32(dtype, impl):
    if dtype is torch.bfloat16 and not bf16_native('cuda'): pytest.skip(f'{torch.cuda.get_device_name()} has no bf16 units')
    ex, fa = _pair(impl=impl)
    torch.manual_seed(1)
    h, mem = torch.randn(4, 64, 64, device=DEV), torch.randn(4, 128, 64, device=DEV)
    ref = ex(h, mem)
    with torch.autocast('cuda', dtype=dtype): low = fa(h, mem)
    err = (low.float() - ref).abs().max() / ref.abs().max()
    assert err < (3e-2 if dtype is torch.bfloat16 else 5e-3), f'{dtype}: relative error {err:.2e}'


@pytest.mark.parametrize('T,M', [(64, 192), (33, 200)])   # strides and offset multiples of 16; and neither (alignment)
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_fused_kernel_takes_the_in_place_shift(dtype, T, M):
    """CUDA's fused attention with `shift_masked_`'s strided view as its mask equals it with the bias `shift_masked` writes:
    the first thing to know before the view path (CPU evaluation only, today) is timed on a GPU."""
    if dtype is torch.bfloat16 and not bf16_native('cuda'): pytest.skip(f'{torch.cuda.get_device_name()} has no bf16 units')
    B, H, dh = 4, 4, 64
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, n, dh, device=DEV, dtype=dtype) for n in (T, M + T, M + T))
    x = torch.randn(H, B, T, M + T + 1, device=DEV, dtype=dtype).transpose(0, 1)   # over K+1 distances, head-major
    for mask in (attention_mask(T, M, device=DEV), attention_mask(T, M, torch.rand(B, M, device=DEV) > 0.2, torch.rand(B, T, device=DEV) < 0.05)):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=shift_masked(x[..., 1:].contiguous(), mask), scale=1.0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=shift_masked_(x.clone(), mask), scale=1.0)
        torch.testing.assert_close(out, ref, rtol=1e-5 if dtype is torch.float32 else 1e-2, atol=1e-5 if dtype is torch.float32 else 1e-2)


def _ct(pre_ln=False, n_m=16):
    cfg = CTConfig(vocab_size=64, d_model=64, n_heads=4, d_ff=128, n_s=16, n_m=n_m, n_cm=16, c=4, pre_ln=pre_ln)
    return randomized(CompressiveTransformer(cfg), std=0.1).to(DEV).eval()


@pytest.mark.parametrize('pre_ln', [False, True])
def test_cached_inference_equals_uncached(pre_ln):
    model = _ct(pre_ln)
    tokens = torch.randint(0, 64, (3, 16 * 12), device=DEV)
    outs = []
    for cache in (True, False):
        model.kv_cache, state, lg = cache, None, []
        with torch.no_grad():
            for w in range(12):
                reset = torch.tensor([w == 4, w == 7, False], device=DEV)
                l, _, state = model(tokens[:, 16 * w:16 * w + 16], state, reset=reset, n_m=32, n_cm=48)
                lg.append(l)
        outs.append(torch.cat(lg, 1))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('n_m', [8, 16, 24])   # memories shorter than, as long as and longer than a window
def test_reused_projections_equal_recomputed(n_m):
    model = _ct(n_m=n_m).train()
    slow = [[] for _ in model.layers]
    tokens = torch.randint(0, 64, (2, 64), device=DEV)
    with torch.no_grad(): _, _, state = model(tokens[:, :32])
    model.compression_hook = lambda i, h, old, new_cm: slow[i].append(layer_compression_loss(model.layers[i], h, old, new_cm))
    model(tokens[:, 32:], state)
    want = torch.stack([torch.stack(s).mean() for s in slow]).sum()
    torch.testing.assert_close(model.aux_loss, want, rtol=1e-5, atol=1e-6)


def test_a_training_window_syncs_once():
    "A training window makes the host wait for the GPU once (the count of streams the auxiliary loss reads), in any layer count."
    model = _ct().train()
    tokens = torch.randint(0, 64, (3, 64), device=DEV)
    with torch.no_grad(): _, _, state = model(tokens[:, :32])               # memories full: every later window evicts
    torch.cuda.synchronize()
    stacks = []                                                             # the Python stack at each synchronising call
    def record(message, *args, **kw):
        if 'synchroniz' in str(message): stacks.append(traceback.extract_stack()[:-1])
    with warnings.catch_warnings():
        warnings.simplefilter('always'); warnings.showwarning = record
        torch.cuda.set_sync_debug_mode('warn')                              # a warning at every synchronising CUDA call
        try:
            _, loss, state = model(tokens[:, 32:], state, targets=tokens[:, 32:])   # 2 windows of n_s = 16
            (loss + model.aux_loss).backward()
        finally: torch.cuda.set_sync_debug_mode('default')
    # count the syncs made by the model's code or in its backward pass (with torch 2.11 on an H100 a third warning came
    # from a frame of torch/cuda/__init__.py; the message prints every one's stack)
    ours = [s for s in stacks if any('compressive_tutorial' in f.filename or f.name == 'backward' for f in s)]
    where = lambda s: ' <- '.join(f'{f.filename.split("site-packages/")[-1]}:{f.lineno}' for f in s[::-1][:4])
    assert len(ours) == 2, f'{len(ours)} syncs in the model, expected 1 per window: ' + '; '.join(map(where, stacks))


def test_evaluation_waits_for_the_gpu_once():
    "`evaluate` copies each CPU window to the GPU without waiting for the windows queued before it: one wait, for the total at the end."
    model = _ct()
    loader = StreamLoader(torch.randint(0, 64, (3 * 16 * 6 + 1,), generator=torch.Generator().manual_seed(0)), batch_size=3, n_s=16)
    evaluate(model, loader, precision='fp32'); torch.cuda.synchronize()   # the kernels chosen, the caches made
    stacks = []
    def record(message, *args, **kw):
        if 'synchroniz' in str(message): stacks.append(traceback.extract_stack()[:-1])
    with warnings.catch_warnings():
        warnings.simplefilter('always'); warnings.showwarning = record
        torch.cuda.set_sync_debug_mode('warn')
        try: evaluate(model, loader, precision='fp32')                         # 6 windows
        finally: torch.cuda.set_sync_debug_mode('default')
    ours = [s for s in stacks if any('compressive_tutorial' in f.filename for f in s)]
    where = lambda s: ' <- '.join(f'{f.filename.split("site-packages/")[-1]}:{f.lineno}' for f in s[::-1][:4])
    assert len(ours) == 1, f'{len(ours)} waits in 6 windows, expected 1 (the total): ' + '; '.join(map(where, ours))


def test_sampling_with_a_cpu_generator_and_cuda_helpers():
    "A CUDA model samples with a CPU generator (as notebook 06's examples make one): reproducibly, drawn on the CPU; the reach of a CUDA mask."
    model = _ct().eval()
    prompt = torch.randint(0, 64, (2, 5), device=DEV)
    a, b = (sample(model, prompt, 12, generator=torch.Generator().manual_seed(3)) for _ in range(2))
    assert a.device.type == 'cuda' and torch.equal(a, b)
    A = xl_equivalent_mask(40, 4, 8)
    assert reach_from_visibility(A.to(DEV), 2) == reach_from_visibility(A, 2)


def test_gpu_benchmark_smoke():
    "The GPU setting of notebook 15 in short form: one repetition of one window per implementation, memory and MFU included."
    cfg = replace(BENCH_GPU, reps=1, steps=1, impls=('ours-ct', 'ours-ct-compiled', 'ours-txl', 'lucidrains-ct'),
                  dtype='bfloat16' if bf16_native('cuda') else 'float16')              # a T4: fp16, as `ct bench` takes there
    r = run_benchmark(cfg, progress=False)
    assert {'ours-ct', 'ours-ct-compiled', 'ours-txl'} <= set(r['results']), r['skipped']   # ours must run, not be skipped
    assert not any(why.startswith('failed') for why in r['skipped'].values()), r['skipped']    # a peer may be absent, not broken
    for v in r['results'].values():
        assert v['train_tps'] > 0 and v['infer_tps'] > 0 and len(v['peak_mib']) == 2
    print(report(r))
