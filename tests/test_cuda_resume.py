"""On a GPU: a run interrupted by SIGTERM on CUDA (bf16 autocast) resumes from its checkpoint and ends where the
uninterrupted run ends. Skipped without CUDA (run it where a GPU is: `pytest tests/test_cuda_resume.py`)."""
import os, signal
os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')    # deterministic cuBLAS: set before CUDA starts in this process
import pytest
import torch
from compressive_tutorial.data import StreamLoader
from compressive_tutorial.model import CompressiveTransformer, CTConfig
from compressive_tutorial.train import Trainer, TrainConfig, TrainingInterrupted, seed_everything
from compressive_tutorial.cli import device_memory

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')

CFG = TrainConfig(lr_max=1e-3, warmup_steps=5, decay_steps=20, update_every=4, update_every_after=8, progress=False)


def make(seed=0):
    seed_everything(seed)
    model = CompressiveTransformer(CTConfig(d_model=64, n_heads=4, n_layers=2, d_ff=128, n_s=16, n_m=16, n_cm=8, c=2,
                                            compression='conv', compression_loss='attention', dropout=0.1)).cuda()
    data = torch.Generator().manual_seed(1)
    return model, StreamLoader(torch.randint(0, 256, (4 * 16 * 9 + 1,), generator=data), batch_size=4, n_s=16)


def test_sigterm_and_resume_on_cuda(tmp_path):
    torch.use_deterministic_algorithms(True, warn_only=True)                       # same kernels, same order: comparable bit for bit
    try: _sigterm_and_resume(tmp_path)
    finally: torch.use_deterministic_algorithms(False)                             # not for the tests after this one


def _sigterm_and_resume(tmp_path):
    model, dl = make(); a = Trainer(model, dl, cfg=CFG); a.fit(20)                  # straight through
    model, dl = make(); b = Trainer(model, dl, cfg=CFG, ckpt_dir=tmp_path)
    step = b.train_step
    def with_sigterm(batch):
        if b.step == 7: signal.raise_signal(signal.SIGTERM)
        return step(batch)
    b.train_step = with_sigterm
    with pytest.raises(TrainingInterrupted) as e: b.fit(20)
    assert e.value.step == 8
    model, dl = make(seed=99)                                                      # other weights, other generators
    c = Trainer.resume(tmp_path/'last.safetensors', model, dl); c.fit(20)
    assert c.device.type == 'cuda' and c.state.memories[0].mem.device.type == 'cuda'
    worst = max(float((p - q).abs().max()) for p, q in zip(a.model.parameters(), c.model.parameters()))
    print(f'largest weight difference, straight vs interrupted and resumed: {worst:.3g}')
    assert worst == 0, worst                                                       # as on the CPU (notebook 06)


def test_device_memory_on_cuda():
    assert device_memory(torch.device('cuda')) == torch.cuda.get_device_properties(0).total_memory > 0
