"""On a GPU: each precision's training step (bf16 autocast where the GPU has bf16 units, fp16 with a loss scaler, fp32), the
automatic choice, an exact checkpoint round trip under each (the fp16 loss scale included), and an fp16 checkpoint taken in
the middle of an update group resumed in bf16 or fp32 (its pending gradients unscaled). Notebook 06 tests the choice
on the CPU through a mock of the capability query; these run the real thing. Skipped without CUDA."""
import os
os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')    # deterministic cuBLAS: set before CUDA starts in this process
import pytest
import torch
from compressive_tutorial.data import StreamLoader
from compressive_tutorial.model import CompressiveTransformer, CTConfig
from compressive_tutorial.train import Trainer, TrainConfig, seed_everything, choose_precision, bf16_native, hardware

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
PRECISIONS = ['bf16', 'fp16', 'fp32']


def make(precision, seed=0, **cfg):
    seed_everything(seed)
    model = CompressiveTransformer(CTConfig(d_model=64, n_heads=4, n_layers=2, d_ff=128, n_s=16, n_m=16, n_cm=8, c=2,
                                            compression='conv', compression_loss='attention')).cuda()
    cfg = TrainConfig(**dict(lr_max=1e-3, warmup_steps=2, decay_steps=20, update_every_after=10**6, log_every=2, progress=False) | cfg,
                      precision=precision)
    data = torch.Generator().manual_seed(1)
    return Trainer(model, StreamLoader(torch.randint(0, 256, (4 * 16 * 9 + 1,), generator=data), batch_size=4, n_s=16), cfg=cfg)


def need(precision):
    if precision == 'bf16' and not bf16_native('cuda'): pytest.skip(f'{torch.cuda.get_device_name()} has no bf16 units')


def test_auto_choice_matches_the_device():
    want = 'bf16' if bf16_native('cuda') else 'fp16'
    assert choose_precision('cuda') == want and want in hardware('cuda', 'auto')
    print(hardware('cuda', 'auto'))


@pytest.mark.parametrize('precision', PRECISIONS)
def test_training_step_learns(precision):
    "Real steps in each precision: weights move and stay fp32, losses are finite; fp16 runs its loss scaler."
    need(precision)
    t = make(precision)
    assert t.precision == precision and (t.scaler is not None) == (precision == 'fp16')
    w0 = [p.detach().clone() for p in t.model.parameters()]
    t.fit(16)
    losses = [h['loss'] for h in t.history if 'loss' in h]
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses))), losses
    assert any(not torch.equal(a, p) for a, p in zip(w0, t.model.parameters())), 'no weight moved'
    assert all(p.dtype == torch.float32 for p in t.model.parameters())            # autocast: fp32 master weights
    if precision == 'fp16': assert t.scaler.get_scale() > 1 and t.n_skipped < 8, (t.scaler.get_scale(), t.n_skipped)
    print(precision, 'losses', [round(x, 3) for x in losses])


@pytest.mark.parametrize('precision', PRECISIONS)
def test_checkpoint_round_trip_is_exact(precision, tmp_path):
    "Save after 6 steps, load into a fresh trainer, go on to 10: the same weights, bit for bit, as straight on (loss scale too)."
    need(precision)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        a = make(precision); a.fit(10)
        b = make(precision); b.fit(6); path = b.save(tmp_path/'six.safetensors')
        c = make(precision, seed=99); c.load(path)
        if precision == 'fp16': assert c.scaler.state_dict() == b.scaler.state_dict() and c.fc_scaler.state_dict() == b.fc_scaler.state_dict()
        c.fit(10)
        for (n, p), q in zip(a.model.named_parameters(), c.model.parameters()): assert torch.equal(p, q), n
        if precision == 'fp16': assert a.scaler.get_scale() == c.scaler.get_scale()
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize('new', ['bf16', 'fp32'])
def test_fp16_group_resumes_unscaled(new, tmp_path):
    "An fp16 checkpoint in the middle of a §5.5.1 group, resumed in bf16 or fp32: the pending gradients lose the loss scale."
    need(new)
    group = dict(update_every=4, update_every_after=4)                        # windows 4..7: one update
    b = make('fp16', **group); b.fit(6); path = b.save(tmp_path/'mid.safetensors')
    c = make(new, seed=99, **group)
    with pytest.warns(UserWarning, match='not bit for bit'): c.load(path)
    scale = b.scaler.get_scale()
    assert scale > 1 and c.scaler is None
    for ps, qs, s in ((b.params, c.params, b.scaler), (b.comp_params, c.comp_params, b.fc_scaler)):   # f_c: its own scale
        for p, q in zip(ps, qs): assert p.grad is not None and torch.equal(q.grad, p.grad / s.get_scale())
    c.fit(8)                                                                  # the group's update, in the new precision
    assert all(p.grad is None for p in c.params) and c.n_updates == b.n_updates + 1
