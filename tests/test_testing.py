"""The score comparison the kernel tests rely on (``testing.assert_scores_close``): it accepts what a correct
kernel may produce and rejects what calc_diff alone would let through."""
from __future__ import annotations

import pytest
import torch

from torch_sparse_indexer import testing


def test_bf16_ulp_is_the_spacing_of_bf16_numbers(gen):
    x = torch.randn(4096, generator=gen) * torch.exp2(torch.randint(-60, 60, (4096,), generator=gen).float())
    b = x.bfloat16().abs()
    up = (b.view(torch.int16) + 1).view(torch.bfloat16)  # the next bf16 magnitude, from the bits
    assert torch.equal(testing.bf16_ulp(b), up.float() - b.float())
    assert testing.bf16_ulp(torch.zeros(3)).eq(0).all()


def test_assert_scores_close_accepts_rounding_and_noise(gen):
    ref = torch.randn(64, 512, generator=gen) * 20
    ref[:, 400:] = float("-inf")
    ref[0, :8] = 0.0
    noise = ref.abs() * 2.0 ** -22 * torch.randn(ref.shape, generator=gen)  # float32 reordering noise
    noisy = torch.where(torch.isfinite(ref), ref + noise, ref)
    testing.assert_scores_close(noisy.bfloat16(), ref)  # may be a whole ulp from ref.bfloat16()
    testing.assert_scores_close(noisy, ref)


def test_assert_scores_close_rejects(gen):
    ref = torch.randn(64, 512, generator=gen) * 20
    ref[:, 400:] = float("-inf")
    ref[5, 7] = 13.7  # (not a draw that cancels to near zero, where 1e-5 of the largest score may exceed 2 ulps)
    out = ref.bfloat16()
    two_ulps = out.clone()
    two_ulps[5, 7] = (ref[5, 7] + 2 * testing.bf16_ulp(ref[5, 7])).bfloat16()
    assert testing.calc_diff(two_ulps, ref) < 1e-5  # one bad element is invisible to calc_diff
    with pytest.raises(AssertionError, match="over one ulp"):
        testing.assert_scores_close(two_ulps, ref)
    mask = out.clone()
    mask[1, 3] = float("-inf")
    with pytest.raises(AssertionError, match="-inf masks differ"):
        testing.assert_scores_close(mask, ref)
    with pytest.raises(AssertionError, match="float32 reference"):
        testing.assert_scores_close(out, ref.bfloat16())


def test_assert_scores_close_tensor_core_allowance(gen):
    """A score that cancels to near zero carries the tensor cores' error relative to its terms' magnitude ``mag``:
    accepted within ``TENSOR_CORE_REL * mag`` when ``mag`` is given, rejected without it or beyond it."""
    ref = torch.randn(32, 256, generator=gen) * 20
    mag = ref.abs() * 30  # terms ~30x the score, as random heads give (testing.magnitude_inputs)
    ref[3, 9] = 0.0137  # cancelled: tiny ulp, the same terms' scale
    mag[3, 9] = 600.0
    ref[7, 7], mag[7, 7] = 13.7, 411.0  # an ordinary score (below: 2 ulps of it stay an error)
    out = ref.bfloat16()
    within = out.clone()
    within[3, 9] = ref[3, 9] + 0.9 * testing.TENSOR_CORE_REL * 600.0
    testing.assert_scores_close(within, ref, mag=mag)
    with pytest.raises(AssertionError, match="over one ulp"):
        testing.assert_scores_close(within, ref)
    beyond = out.clone()
    beyond[3, 9] = ref[3, 9] + 3 * testing.TENSOR_CORE_REL * 600.0 + 1e-5 * float(ref.abs().max())
    with pytest.raises(AssertionError, match="over one ulp"):
        testing.assert_scores_close(beyond, ref, mag=mag)
    # on ordinary scores the allowance stays below an ulp: a 2-ulp error is still caught
    two_ulps = out.clone()
    two_ulps[7, 7] = (ref[7, 7] + 2 * testing.bf16_ulp(ref[7, 7])).bfloat16()
    with pytest.raises(AssertionError, match="over one ulp"):
        testing.assert_scores_close(two_ulps, ref, mag=mag)


def test_assert_scores_close_calc_diff_beyond_the_allowance(gen):
    """A case of a few float32 scores, one of which cancels: an error within ``TENSOR_CORE_REL * mag`` can move
    calc_diff past 1e-5 by itself; with ``mag`` calc_diff is taken on the error beyond the allowance, so it
    passes, and 3x that error still fails."""
    ref = torch.full((1, 8), float("-inf"))
    ref[0, :3] = torch.tensor([0.05, 0.3, -0.2])
    mag = torch.full((1, 8), 40.0)
    err = 0.9 * testing.TENSOR_CORE_REL * 40.0  # ~2.2e-3: 4% of the first score, calc_diff ~1.8e-5
    out = ref.clone()
    out[0, 0] += err
    assert testing.calc_diff(out, ref) > 1e-5
    with pytest.raises(AssertionError, match="calc_diff"):
        testing.assert_scores_close(out, ref)
    testing.assert_scores_close(out, ref, mag=mag)
    out[0, 0] = ref[0, 0] + 3 * err
    with pytest.raises(AssertionError, match="beyond the tensor-core allowance"):
        testing.assert_scores_close(out, ref, mag=mag)
