"""Attention over a pool of 1-byte elements (--kv-cache-dtype fp8_e4m3, fp8_e5m2, int8) reads the
stored bytes and their scales: the prefill kernel (cpu/csrc/attention.h), the decode kernel
(decode_attention.cpp) and the portable path each equal float64 attention over the dequantized
values (element times scale), on every build of the kernels; and the kernels round keys and values
into the pool as the portable path does, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from baby_sgl.core import kv_cache_dtype, memory_pool
from baby_sgl.core.memory_pool import KVPool
from helpers import ARCHS, build_for, decode_forward_batch, scattered_extend_requests

HEADS, KV_HEADS = 6, 2
SCALED = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
# float32 accumulation over a few hundred keys; rounding to 1 byte moves results by ~1e-2
TIGHT = dict(rtol=1e-4, atol=1e-4)


def _pool(cache_dtype: torch.dtype, dim: int, slots: int = 600, seed: int = 0) -> KVPool:
    """A pool whose every slot holds keys and values written through set_kv_buffer; heads of very
    different magnitudes (1/16 .. 4), so a scale shared across heads or tokens would lose the small ones."""
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(slots, 1, KV_HEADS, dim, torch.float32, torch.device("cpu"), cache_dtype)
    magnitude = 2.0 ** torch.randint(-4, 3, (slots, KV_HEADS, 1), generator=g)
    k = torch.randn(slots, KV_HEADS, dim, generator=g) * magnitude
    v = torch.randn(slots, KV_HEADS, dim, generator=g) * magnitude.flip(0)
    pool.set_kv_buffer(0, torch.arange(slots), k, v)
    return pool


def _dequantized(pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
    kv = pool.layer(0)
    assert kv.k_scale is not None and kv.v_scale is not None
    return (kv.k.double() * kv.k_scale.double()[..., None], kv.v.double() * kv.v_scale.double()[..., None])


def _extend_reference(q, k, v, rows, prefix_lens, extend_lens, scale):
    outs, start = [], 0
    for r, (pre, ext) in enumerate(zip(prefix_lens, extend_lens)):
        slots = rows[r, : pre + ext]
        ki = k[slots].repeat_interleave(HEADS // KV_HEADS, dim=1)
        vi = v[slots].repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("thd,lhd->htl", q[start : start + ext].double(), ki) * scale
        visible = torch.arange(pre + ext)[None, :] <= (pre + torch.arange(ext))[:, None]
        outs.append(torch.einsum("htl,lhd->thd", scores.masked_fill(~visible[None], float("-inf")).softmax(-1), vi))
        start += ext
    return torch.cat(outs).float()


@pytest.mark.parametrize("cache_dtype", SCALED)
@pytest.mark.parametrize("dim", [64, 48])  # 48: a head_dim without an unrolled path
def test_prefill_kernel_reads_the_stored_bytes(ops, cache_dtype, dim):
    pool = _pool(cache_dtype, dim, seed=dim)
    g = torch.Generator().manual_seed(1)
    rows, prefix_lens, extend_lens = scattered_extend_requests(g, pool.size)
    q = torch.randn(sum(extend_lens), HEADS, dim, generator=g)
    kv = pool.layer(0)
    scale = 1 / math.sqrt(dim)
    out = ops.extend_attention(q, kv.k, kv.v, rows, torch.tensor(prefix_lens), torch.tensor(extend_lens), scale,
                               kv.k_scale, kv.v_scale)
    expected = _extend_reference(q, *_dequantized(pool), rows, prefix_lens, extend_lens, scale)
    torch.testing.assert_close(out, expected, **TIGHT)


def test_a_one_byte_pool_without_its_scales_is_refused(ops):
    kv = _pool(torch.int8, 16).layer(0)
    q, rows = torch.randn(3, HEADS, 16), torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(RuntimeError, match="needs its scales"):
        ops.extend_attention(q, kv.k, kv.v, rows, torch.tensor([0]), torch.tensor([3]), 0.25)


def _heads_with_ties(cache_dtype: torch.dtype, dim: int = 64) -> torch.Tensor:
    """Heads whose scale is exactly 1 (each holds the type's largest value) filled with every value
    halfway between two neighbours of the type (ties, subnormal ones included) and their negatives,
    then random heads of many magnitudes."""
    largest = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}[cache_dtype]
    if cache_dtype == torch.int8:
        grid = torch.arange(0, 128, dtype=torch.float32)
    else:
        grid = torch.arange(0, 256, dtype=torch.uint8).view(cache_dtype).float()
        grid = grid[grid.isfinite() & (grid >= 0) & (grid <= largest)].unique()
    halves = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([halves, -halves, grid, -grid])
    values = torch.cat([values, values.new_zeros((-len(values)) % (dim - 1))]).view(-1, dim - 1)
    tied = torch.cat([values.new_full((len(values), 1), largest), values], 1)
    g = torch.Generator().manual_seed(0)
    random = torch.randn(64, dim, generator=g) * 10.0 ** torch.randint(-6, 4, (64, 1), generator=g)
    return torch.cat([tied, random, torch.zeros(1, dim)]).view(-1, 1, dim)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_kernels_rounding_is_the_portable_paths(ops, cache_dtype):
    """The CPU kernel's writes (the decode step's, and KVPool's on CPU) are kv_cache_dtype.quantize's
    bit for bit: ties to even, subnormals, zero heads."""
    x = _heads_with_ties(cache_dtype)
    q, scale = kv_cache_dtype.quantize(x, cache_dtype)
    buf, scales = torch.zeros_like(q), torch.zeros_like(scale)
    ops.store_kv(x, torch.arange(len(x)), buf, scales)
    assert torch.equal(kv_cache_dtype.as_bytes(buf), kv_cache_dtype.as_bytes(q))
    assert torch.equal(scales, scale)


@pytest.mark.parametrize("cache_dtype", SCALED)
def test_a_pool_written_without_the_kernel_holds_the_kernels_bytes_and_scales(cache_dtype, monkeypatch):
    """No kernel to write the pool (no compiler, or a GPU): KVPool.set_kv_buffer rounds by
    kv_cache_dtype.quantize and stores each slot's scales beside its bytes, the same as the
    kernel's; a slot written again takes the scales of its new values."""
    pools = [_pool(cache_dtype, 64, slots=100)]
    monkeypatch.setattr(memory_pool, "cpu_ops", lambda: None)
    pools.append(_pool(cache_dtype, 64, slots=100))
    g = torch.Generator().manual_seed(4)
    loc = torch.arange(10, 60)
    k, v = torch.randn(50, KV_HEADS, 64, generator=g) * 100, torch.randn(50, KV_HEADS, 64, generator=g) / 100
    for pool in pools:
        pool.set_kv_buffer(0, loc, k, v)
    kernel, portable = pools[0].layer(0), pools[1].layer(0)
    for x, stored, scales, kernel_stored, kernel_scales in ((k, portable.k, portable.k_scale, kernel.k, kernel.k_scale),
                                                            (v, portable.v, portable.v_scale, kernel.v, kernel.v_scale)):
        assert torch.equal(kv_cache_dtype.as_bytes(stored), kv_cache_dtype.as_bytes(kernel_stored))
        assert torch.equal(scales, kernel_scales)
        q, scale = kv_cache_dtype.quantize(x, cache_dtype)
        assert torch.equal(scales[loc], scale)
        assert torch.equal(kv_cache_dtype.as_bytes(stored[loc]), kv_cache_dtype.as_bytes(q))


@pytest.fixture(scope="module", params=ARCHS)
def decode_ops(request):
    """The decode-attention kernel built for each instruction set the tests cover."""
    with pytest.MonkeyPatch.context() as mp:
        yield build_for(request.param, mp, "decode_attention")


def _decode_reference(q, k, v, table, lens, scale):
    outs = []
    for r in range(q.shape[0]):
        slots = table[r, : lens[r]]
        scores = torch.einsum("hgd,lhd->hgl", q[r].double(), k[slots]) * scale
        outs.append(torch.einsum("hgl,lhd->hgd", scores.softmax(-1), v[slots]))
    return torch.stack(outs).float()


@pytest.mark.parametrize("cache_dtype", SCALED)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
# 38: not a whole number of vectors (8 lanes with AVX2, 4 without SIMD): each head's last values
# are widened one at a time, and times their scale too.
@pytest.mark.parametrize("dim", [64, 38])
def test_decode_kernel_reads_the_stored_bytes(decode_ops, cache_dtype, q_dtype, dim):
    pool = _pool(cache_dtype, dim)
    g = torch.Generator().manual_seed(2)
    table = torch.randperm(pool.size, generator=g)[:4 * 150].view(4, 150).contiguous()
    lens = torch.tensor([150, 1, 77, 129])
    q = torch.randn(4, KV_HEADS, HEADS // KV_HEADS, dim, generator=g).to(q_dtype)
    kv = pool.layer(0)
    out, _ = decode_ops.decode_attention(q, kv.k, kv.v, table, lens, 0.125, kv.k_scale, kv.v_scale)
    assert out.dtype == q_dtype
    expected = _decode_reference(q, *_dequantized(pool), table, lens, 0.125)
    tol = TIGHT if q_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # the output's rounding
    torch.testing.assert_close(out.float(), expected, **tol)


def _one_key_each(cache_dtype: torch.dtype):
    """_heads_with_ties' heads (every value of the type, subnormals included) rounded as a pool's
    keys and values, and those values widened by torch: a query attending to one key alone gets
    its value times 1, so each kernel must give these bits."""
    x = _heads_with_ties(cache_dtype)
    stored, scale = kv_cache_dtype.quantize(x, cache_dtype)
    return stored, scale, stored.float() * scale.unsqueeze(-1)


@pytest.mark.parametrize("cache_dtype", SCALED)
def test_decode_kernel_widens_every_value_of_the_type(decode_ops, cache_dtype):
    stored, scale, widened = _one_key_each(cache_dtype)
    n, dim = len(stored), stored.shape[-1]
    q = torch.randn(n, 1, 1, dim, generator=torch.Generator().manual_seed(5))
    out, _ = decode_ops.decode_attention(q, stored, stored, torch.arange(n).view(n, 1), torch.ones(n, dtype=torch.long),
                                         0.125, scale, scale)
    assert torch.equal(out.view(n, 1, dim), widened)


@pytest.mark.parametrize("cache_dtype", SCALED)
def test_prefill_kernel_widens_every_value_of_the_type(ops, cache_dtype):
    stored, scale, widened = _one_key_each(cache_dtype)
    n, dim = len(stored), stored.shape[-1]
    q = torch.randn(n, 1, dim, generator=torch.Generator().manual_seed(6))
    ones = torch.ones(n, dtype=torch.long)
    out = ops.extend_attention(q, stored, stored, torch.arange(n).view(n, 1), ones - 1, ones, 0.125, scale, scale)
    assert torch.equal(out, widened)


@pytest.mark.parametrize("cache_dtype", SCALED)
def test_portable_decode_widens_only_the_gathered_rows(cache_dtype):
    """No kernel (no compiler, or a GPU): the rows a request reads are gathered and widened."""
    dim = 32
    pool = _pool(cache_dtype, dim, slots=300)
    rows = [list(range(5, 120)), list(range(200, 203))]
    backend, fb = decode_forward_batch(rows, pool, False, HEADS // KV_HEADS)
    q = torch.randn(len(rows), HEADS, dim, generator=torch.Generator().manual_seed(3))
    out = backend.forward(q, 0, 0.2, fb)
    table = torch.zeros(len(rows), 115, dtype=torch.long)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r)
    expected = _decode_reference(q.view(len(rows), KV_HEADS, -1, dim), *_dequantized(pool), table,
                                 [len(r) for r in rows], 0.2)
    torch.testing.assert_close(out, expected.view_as(out), **TIGHT)


@pytest.mark.parametrize("cache_dtype", SCALED)
def test_stored_values_are_within_the_types_step(cache_dtype):
    """Each head's values come back within half a step of its own scale (int8) or the type's
    relative precision (fp8), whatever the other heads' magnitudes."""
    pool = _pool(cache_dtype, 64, slots=200)
    g = torch.Generator().manual_seed(0)
    magnitude = 2.0 ** torch.randint(-4, 3, (200, KV_HEADS, 1), generator=g)
    k = torch.randn(200, KV_HEADS, 64, generator=g) * magnitude
    k_back, _ = _dequantized(pool)
    amax = k.abs().amax(-1, keepdim=True).double()
    err = (k_back - k.double()).abs()
    if cache_dtype == torch.int8:
        assert (err <= amax / 127 / 2 * (1 + 1e-5)).all()
    else:
        # Relative 2^-(mantissa bits + 1) for normal values; below the type's normal range an absolute step.
        mantissa, smallest_normal, largest = (3, 2.0 ** -6, 448) if cache_dtype == torch.float8_e4m3fn else \
            (2, 2.0 ** -14, 57344)
        step = amax / largest
        bound = torch.maximum(k.double().abs() * 2.0 ** -(mantissa + 1), smallest_normal * 2.0 ** -mantissa / 2 * step)
        assert (err <= bound * (1 + 1e-5)).all()
