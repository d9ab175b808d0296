"""Where torchaudio loads (Colab, the GPU machine): notebook 11's pure-torch fallbacks give what `torchaudio.functional`
gives, on the CPU and, with a GPU, on CUDA: µ-law codes and levels, and resampled waveforms (the same length, the same
samples within float32 rounding). Notebook 11 tests the fallbacks against the formulas everywhere; this compares them
with the library itself. Skipped where torchaudio does not load (the CPU machines of this project's CI)."""
import pytest
import torch
from compressive_tutorial.speech import MU, mu_law_decode, mu_law_encode, resample, torchaudio_functional

pytestmark = pytest.mark.skipif(torchaudio_functional() is None, reason='torchaudio does not load here')
DEVICES = ['cpu'] + (['cuda'] if torch.cuda.is_available() else [])


@pytest.mark.parametrize('device', DEVICES)
def test_mu_law_matches_torchaudio(device):
    x = (torch.rand(1_000_000, generator=torch.Generator().manual_seed(0)) * 2 - 1).to(device)
    assert torch.equal(mu_law_encode(x, backend='torchaudio'), mu_law_encode(x, backend='torch'))
    k = torch.arange(MU + 1, device=device)
    torch.testing.assert_close(mu_law_decode(k, backend='torchaudio'), mu_law_decode(k, backend='torch'), rtol=0, atol=1e-6)


# fp32: the two sum the same few dozen products of samples of about 1 in different orders (cuDNN picks its own), so they
# may differ by a few units of float32's 6e-8 times that sum: 2.65e-6 was seen on an H200 (22,050 -> 8,000 Hz, strided rows).
ATOL32 = 5e-6

@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('rates', [(16_000, 22_050), (22_050, 16_000), (48_000, 22_050), (44_100, 22_050), (22_050, 8_000),
                                   (8_000, 24_000), (3, 7)])
def test_resample_matches_torchaudio(device, rates):
    g = torch.Generator().manual_seed(0)
    for shape in [(5_000,), (2, 3, 1_234), (1, 7)]:
        for dtype, atol in [(torch.float32, ATOL32), (torch.float64, 1e-12)]:
            x = torch.randn(*shape, generator=g, dtype=dtype).to(device)
            with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):   # full fp32 convolutions on CUDA, as on the CPU
                a, b = resample(x, *rates, backend='torchaudio'), resample(x, *rates, backend='torch')
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(b, a, rtol=0, atol=atol)
    x = torch.randn(1_000, 3, generator=g).to(device).t()                       # strided rows: torchaudio alone would refuse them
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        torch.testing.assert_close(resample(x, *rates, backend='torch'), resample(x, *rates, backend='torchaudio'), rtol=0, atol=ATOL32)


def test_resample_length_matches_torchaudio():
    "torchaudio rounds N f_out / f_in to float32 before the ceiling; the fallback gives the same length (one sample short of the exact ceiling here)."
    n = next(n for n in range(100_000, 400_000) if int(torch.tensor(320 * n / 441).ceil()) != -(-320 * n // 441))
    x = torch.zeros(n)
    assert resample(x, 22_050, 16_000, backend='torch').shape == resample(x, 22_050, 16_000, backend='torchaudio').shape
