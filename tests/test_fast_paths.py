"""CPU checks of the fast paths of issue 13: each one against the explicit computation it replaces (runs under plain `pytest tests/`)."""
import contextlib, math, traceback
from dataclasses import replace
import pytest
import torch
from compressive_tutorial.attention import (RelativeMultiHeadAttention, rel_shift, shift_masked, attention_mask,
                                            causal_mask, masked_attention)
from compressive_tutorial.model import CTConfig, CompressiveTransformer
from compressive_tutorial.bench import BenchConfig, OursRunner, counted_flops, ct_flops_per_token
from compressive_tutorial.train import compile_layers

torch.set_num_threads(1)


def randomized(m, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters(): p.normal_(0, 0.5)
    return m


@pytest.mark.parametrize('T,M', [(1, 0), (5, 0), (4, 7), (6, 2)])
def test_shift_masked_equals_rel_shift(T, M):
    x = torch.randn(3, 2, T, M + T, requires_grad=True)
    mask = attention_mask(T, M, torch.rand(3, M) > 0.3)
    slow = rel_shift(x).masked_fill(~mask, float('-inf'))
    fast = shift_masked(x, mask)
    assert torch.equal(fast, slow)
    g = torch.randn_like(slow)
    assert torch.equal(torch.autograd.grad(fast, x, g)[0], torch.autograd.grad(slow, x, g.masked_fill(~mask, 0))[0])


def test_fast_attention_takes_a_per_query_mask():
    "The episode-mask shape of the next step, (B, 1, T, K), goes through the fused path and equals the explicit one."
    torch.manual_seed(0)
    B, T, M, d = 3, 6, 5, 16
    ex = randomized(RelativeMultiHeadAttention(d, 2, attn_impl='explicit'))
    fa = RelativeMultiHeadAttention(d, 2); fa.load_state_dict(ex.state_dict())
    h, mem = torch.randn(B, T, d, requires_grad=True), torch.randn(B, M, d)
    mask = causal_mask(T, M)[None, None] & (torch.rand(B, 1, T, M + T) > 0.4)
    mask[..., torch.arange(T), M + torch.arange(T)] = True          # every query keeps itself
    outs = []
    for m in (ex, fa):
        q = m.split_heads(m.q(h)); k, v = m.project_kv(torch.cat([mem, h], 1))
        out = m.fast_attend(q, k, v, mask, 0.) if m is fa else masked_attention(m.scores(q, k), v, mask)
        out = m.o(m.merge_heads(out))                                # (B, T, d)
        outs.append((out, torch.autograd.grad(out.pow(2).sum(), [h] + list(m.parameters()))))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-4, atol=1e-5)
    for a, b in zip(outs[0][1], outs[1][1]): assert (a - b).abs().max() <= 1e-5 * b.abs().max(), 'gradients differ'


@pytest.mark.parametrize('pre_ln', [False, True])
def test_cached_evaluation_equals_uncached(pre_ln):
    torch.manual_seed(0)
    model = randomized(CompressiveTransformer(CTConfig(vocab_size=11, d_model=16, n_heads=2, d_ff=32, n_s=4, n_m=4, n_cm=4,
                                                       c=2, pre_ln=pre_ln))).eval()
    tokens = torch.randint(0, 11, (2, 60))
    outs = []
    for cache in (True, False):
        model.kv_cache, state, lg = cache, None, []
        with torch.no_grad():
            for w in range(15):
                l, _, state = model(tokens[:, 4 * w:4 * w + 4], state, reset=torch.tensor([w == 5, w == 9]), n_m=8, n_cm=12)
                lg.append(l)
        outs.append(torch.cat(lg, 1))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_flops_formula_matches_the_counter():
    cfg = BenchConfig(n_layers=2, d_model=32, n_heads=2, d_ff=128, n_s=8, n_m=8, n_cm=8, c=2, batch_size=2)
    x = torch.randint(0, 256, (2, 8))
    for kind in ('ct', 'txl'):
        torch.manual_seed(0)
        r = OursRunner(cfg, kind)
        for _ in range(6): r.train_step(x, x)
        r.reset()
        for _ in range(6): r.infer_step(x)
        train, infer = counted_flops(r, cfg, x, x)
        assert infer == ct_flops_per_token(cfg, False, kind)
        assert train == ct_flops_per_token(cfg, True, kind)


_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='no CUDA')
# How `compile_layers` is asked for CUDA graphs. Trees (mode 'reduce-overhead'): one memory pool that every layer's graphs
# share, replays decided by which outputs are still alive. Without trees: each graph records once, with buffers of its own,
# so each shape needs its own graph (dynamic=False) and no graph ever writes another one's memory.
_TREES = dict(mode='reduce-overhead')
_NO_TREES = dict(dynamic=False, options={'triton.cudagraphs': True, 'triton.cudagraph_trees': False})
@contextlib.contextmanager
def _no_trees_assert(active:bool):
    "Without trees, inductor's own assert that an input it took for static keeps its address failed (seen on an H200 with torch 2.11: an expected failure); any other error, and any failed check of the test's, is not."
    try: yield
    except AssertionError as e:
        if active and '_inductor' in traceback.extract_tb(e.__traceback__)[-1].filename:
            pytest.xfail("inductor's CUDA graphs without trees: `assert dst.data_ptr() == src.data_ptr()` (compile_fx.py), seen on an H200 with torch 2.11")
        raise
_COMPILE = {'cpu': ('cpu', {}, False), 'cuda': ('cuda', {}, False), 'cuda-graphs': ('cuda', _TREES, False),
            'cuda-graphs-keepalive': ('cuda', _TREES, True), 'cuda-graphs-no-trees': ('cuda', _NO_TREES, False)}

@pytest.mark.parametrize('case', ['cpu', pytest.param('cuda', marks=_cuda),
                                  pytest.param('cuda-graphs', marks=[_cuda, pytest.mark.xfail(
                                      raises=RuntimeError, strict=True, reason="seen on an H100 with torch 2.11: 'accessing tensor "
                                      "output of CUDAGraphs that has been overwritten by a subsequent run' in the backward pass "
                                      "while the memories fill. It looks like pytorch/pytorch#194124 (a pending backward's saved "
                                      "tensors are invisible to the trees' liveness check, so a layer's path can be dropped before "
                                      "its backward runs; torch 2.13.0's check_refcount is unchanged)")]),
                                  pytest.param('cuda-graphs-keepalive', marks=[_cuda, pytest.mark.xfail(
                                      raises=RuntimeError, strict=True, reason="seen on an H200 with torch 2.11: the same error "
                                      "with every layer's outputs kept referenced until the backward ran, so that reading of "
                                      "#194124 does not explain it")]),
                                  pytest.param('cuda-graphs-no-trees', marks=_cuda)])
def test_compiled_layers_equal_eager(case):
    "torch.compile of every layer (and with CUDA graphs, three ways): no graph break, every graph replayed, and the same losses, gradients and evaluation logits as eager."
    import copy, torch._dynamo
    from torch._dynamo.utils import counters
    device, kw, keepalive = _COMPILE[case]
    torch._dynamo.reset(); counters.clear()
    torch.manual_seed(0)
    eager = CompressiveTransformer(CTConfig(vocab_size=32, d_model=32, n_heads=2, n_layers=2, d_ff=64, n_s=8, n_m=8, n_cm=8,
                                            c=2, compression='conv', compression_loss='attention')).to(device)
    compiled = compile_layers(copy.deepcopy(eager), **kw)
    graphs = compiled.copy_layer_outputs                    # set by compile_layers for the modes that replay CUDA graphs
    assert graphs == case.startswith('cuda-graphs')
    kept = []
    if keepalive:                                           # every layer's outputs referenced from Python until the backward has run
        attend = compiled._attend
        def attend_and_keep(*args, **kw):
            kept.append(attend(*args, **kw)); return kept[-1]
        compiled._attend = attend_and_keep
    step = torch.compiler.cudagraph_mark_step_begin if graphs else (lambda: None)   # a new window: graphs' old outputs may go
    x = torch.randint(0, 32, (2, 8), device=device)
    states = [None, None]
    with torch._dynamo.config.patch(recompile_limit=64), _no_trees_assert(case == 'cuda-graphs-no-trees'):   # dynamic=False: a graph per memory length
        for _ in range(6):                                  # by the 4th window memory and compressed memory are full
            losses = []; step(); kept.clear()               # (kept: the last window's backward has run)
            for i, m in enumerate((eager, compiled)):
                _, loss, states[i] = m(x, states[i], targets=x)
                (loss + (m.aux_loss if m.aux_loss is not None else 0)).backward()
                losses.append(loss)
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
        for a, b in zip(eager.parameters(), compiled.parameters()): torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5)
        eager.eval(); compiled.eval()
        with torch.no_grad():
            for _ in range(4):
                step(); kept.clear()
                (la, _, states[0]), (lb, _, states[1]) = eager(x, states[0]), compiled(x, states[1])
                torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-5)
    assert not counters['graph_break'], f"graph breaks: {dict(counters['graph_break'])}"
    assert not counters['inductor']['cudagraph_skips'], 'a graph ran without CUDA graphs: the case would test nothing'


@_cuda
@pytest.mark.parametrize('kw', [_TREES, _NO_TREES], ids=['trees', 'no-trees'])
def test_cuda_graph_inference_equals_eager(kw):
    "Evaluation with every layer replayed as a CUDA graph: the eager logits, call after call, while the memories fill and after, in calls that end inside a window too (the state keeps copies of what the graphs return: notebook 06)."
    import copy, torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset(); counters.clear()
    torch.manual_seed(0)
    eager = CompressiveTransformer(CTConfig(vocab_size=32, d_model=32, n_heads=2, n_layers=2, d_ff=64, n_s=8, n_m=8, n_cm=8,
                                            c=2, compression='conv')).cuda().eval()
    graphs = compile_layers(copy.deepcopy(eager), **kw)
    assert graphs.copy_layer_outputs
    x = torch.randint(0, 32, (2, 8 * 8), device='cuda')
    states, s = [None, None], 0
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=64), _no_trees_assert(kw is _NO_TREES):   # each call compiled
        for n in [8] * 5 + [3, 5, 8, 2, 6]:
            torch.compiler.cudagraph_mark_step_begin()
            (la, _, states[0]), (lb, _, states[1]) = eager(x[:, s:s + n], states[0]), graphs(x[:, s:s + n], states[1])
            torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-5)
            s += n
    assert not counters['inductor']['cudagraph_skips'], 'a graph ran without CUDA graphs: the case would test nothing'


def test_compiled_runner_times_one_static_graph_per_phase():
    "The benchmark's compiled model fills its memories eagerly, then compiles the steady-state window once per phase: no recompilation while timed."
    import torch._dynamo
    from torch._dynamo.utils import counters
    from compressive_tutorial.bench import BenchConfig, OursRunner
    torch._dynamo.reset(); counters.clear()
    cfg = BenchConfig(n_layers=2, d_model=32, n_heads=2, d_ff=128, n_s=8, n_m=8, n_cm=8, c=2, batch_size=2, warmup=6, steps=1, reps=1)
    r = OursRunner(cfg, 'ct', compiled=True)
    x = torch.randint(0, 256, (2, 8))
    for phase in ('train', 'infer'):
        r.warm_up(phase, lambda i: (x, x), cfg)
        with torch._dynamo.config.patch(error_on_recompile=True):    # the timed windows: the graph made in the warm-up, as is
            for _ in range(3): r.step(phase, x, x)
    assert counters['stats']['unique_graphs'] == 2, dict(counters['stats'])   # one for training, one for inference
    assert not counters['graph_break'], f"graph breaks: {dict(counters['graph_break'])}"


@pytest.mark.parametrize('case', ['cpu', pytest.param('cuda', marks=_cuda), pytest.param('cuda-compiled', marks=[_cuda, pytest.mark.xfail(
    raises=RuntimeError, strict=True, reason="seen on an H200 with torch 2.11: inductor fails to lower FlexAttention's backward "
    "inside a layer compiled for memories of varying length (dynamic shapes: 'int() argument must be ... not tuple' at a "
    "sym_size); eager layers (the case above) and the benchmark's static-shape training compile")])])
def test_flex_model_equals_sdpa(case):
    "A CT with attn_impl='flex' trains and evaluates like the default 'sdpa' one (losses, reconstruction losses, gradients, logits) while the memories fill, after, and across a stream reset. CUDA: FlexAttention's kernel, from eager layers and inside compiled ones; CPU: its reference, the same score_mod on the whole grid."
    import torch._dynamo
    from torch._dynamo.utils import counters
    device = 'cpu' if case == 'cpu' else 'cuda'
    torch._dynamo.reset(); counters.clear()
    torch.manual_seed(0)
    cfg = CTConfig(vocab_size=32, d_model=32, n_heads=2, n_layers=2, d_ff=64, n_s=8, n_m=8, n_cm=8, c=2,
                   compression='conv', compression_loss='attention')
    ref = CompressiveTransformer(cfg).to(device)
    flex = CompressiveTransformer(replace(cfg, attn_impl='flex')).to(device); flex.load_state_dict(ref.state_dict())
    if case == 'cuda-compiled': compile_layers(flex)
    x = torch.randint(0, 32, (2, 8), device=device)
    states = [None, None]
    with torch._dynamo.config.patch(recompile_limit=64):   # a graph for each memory length while they fill
        for w in range(6):                                  # full by the 4th window; stream 0 starts anew in the 5th
            reset = torch.tensor([w == 4, False], device=device)
            losses = []
            for i, m in enumerate((ref, flex)):
                _, loss, states[i] = m(x, states[i], targets=x, reset=reset)
                aux = m.aux_loss if m.aux_loss is not None else loss.new_zeros(())
                (loss + aux).backward()
                losses.append(torch.stack([loss, aux]))
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
        for a, b in zip(ref.parameters(), flex.parameters()): torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5)
        ref.eval(); flex.eval()
        with torch.no_grad():
            for _ in range(3):
                (la, _, states[0]), (lb, _, states[1]) = ref(x, states[0]), flex(x, states[1])
                torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-5)
    assert not counters['graph_break'], f"graph breaks: {dict(counters['graph_break'])}"
