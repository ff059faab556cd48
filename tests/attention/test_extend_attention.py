"""Prefill attention by the CPU kernel (cpu/csrc/attention.h, one row per new token) over the paged
pool equals float64 attention of each request's new tokens over its cached prefix and
themselves (causal), for float32 and bfloat16 pools, on every build of the kernel."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import scattered_extend_requests

HEADS, KV_HEADS = 6, 2


def _reference(q, k_buf, v_buf, rows, prefix_lens, extend_lens, scale):
    outs, start = [], 0
    for r, (pre, ext) in enumerate(zip(prefix_lens, extend_lens)):
        slots = rows[r, : pre + ext]
        k = k_buf[slots].double().repeat_interleave(HEADS // KV_HEADS, dim=1)  # [L, H, D]
        v = v_buf[slots].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
        qi = q[start : start + ext].double()  # [ext, H, D]
        scores = torch.einsum("thd,lhd->htl", qi, k) * scale
        visible = torch.arange(pre + ext)[None, :] <= (pre + torch.arange(ext))[:, None]  # [ext, L]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        outs.append(torch.einsum("htl,lhd->thd", scores.softmax(-1), v))
        start += ext
    return torch.cat(outs).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 64, 48])  # 48: a head_dim without an unrolled path
def test_extend_attention_equals_float64(ops, dtype, dim):
    g = torch.Generator().manual_seed(dim)
    pool_slots = 600
    k_buf = torch.randn(pool_slots, KV_HEADS, dim, generator=g).to(dtype)
    v_buf = torch.randn(pool_slots, KV_HEADS, dim, generator=g).to(dtype)
    rows, prefix_lens, extend_lens = scattered_extend_requests(g, pool_slots)
    q = torch.randn(sum(extend_lens), HEADS, dim, generator=g).to(dtype)
    scale = 1 / math.sqrt(dim)
    out = ops.extend_attention(q, k_buf, v_buf, rows, torch.tensor(prefix_lens), torch.tensor(extend_lens), scale)
    assert out.dtype == dtype and out.shape == q.shape
    expected = _reference(q, k_buf, v_buf, rows, prefix_lens, extend_lens, scale)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # output rounding
    torch.testing.assert_close(out.float(), expected, **tol)
    # A token's result is its own: the same request alone gives the same bits.
    alone = ops.extend_attention(q[45:85], k_buf, v_buf, rows[1:2], torch.tensor([70]), torch.tensor([40]), scale)
    assert torch.equal(alone, out[45:85])


def test_bad_inputs_are_refused(ops):
    k_buf = torch.randn(10, KV_HEADS, 16)
    q = torch.randn(3, HEADS, 16)
    rows = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.extend_attention(q, k_buf, k_buf, rows, torch.tensor([6]), torch.tensor([3]), 0.25)  # 9 > 8 slots
    rows[0, 1] = 10
    with pytest.raises(RuntimeError, match="KV slot out of range"):
        ops.extend_attention(q, k_buf, k_buf, rows, torch.tensor([0]), torch.tensor([3]), 0.25)
    with pytest.raises(RuntimeError, match="tokens"):
        ops.extend_attention(q, k_buf, k_buf, rows * 0, torch.tensor([0]), torch.tensor([2]), 0.25)
