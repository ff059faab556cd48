"""The CPU kernel's one-pass row ops against the torch ops they replace, on every build of the
kernel: RMSNorm (transformers' formula: normalise in float32, round to the dtype, then the weight
in the dtype) and SiLU(gate) * up."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F



def _transformers(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("hidden", [576, 100])  # 100: not a whole number of vectors
def test_rms_norm_matches_transformers(ops, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(37, hidden, generator=g) * 3
    w = torch.rand(hidden, generator=g) + 0.5
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), _transformers(x, w, 1e-5), rtol=1e-6, atol=1e-6)
    xb, wb = x.bfloat16(), w.bfloat16()
    out = ops.rms_norm(xb, wb, 1e-5)
    assert out.dtype == torch.bfloat16
    # float32 inside: a rounding may land on the other side only where the sum order moved it
    assert (out != _transformers(xb, wb, 1e-5)).float().mean() < 0.01
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.rms_norm(xb, w, 1e-5)


@pytest.mark.parametrize("inter", [1536, 37])
def test_silu_and_mul_matches_torch(ops, inter):
    x = torch.randn(21, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    xb = x.bfloat16()
    gate, up = xb.chunk(2, dim=-1)
    out = ops.silu_and_mul(xb)
    assert out.dtype == torch.bfloat16 and out.shape == (21, inter)
    assert (out != F.silu(gate) * up).float().mean() < 0.01  # exp to the last float bit may round apart
