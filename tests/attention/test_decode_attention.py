"""Batched decode attention over the paged pool, with and without shared-prefix (cascade)
reading, equals each request attending to its own slots alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baby_sgl.attention.shared_prefix import MIN_SHARED_LEN, find_shared_prefixes
from baby_sgl.attention import torch_native
from baby_sgl.cpu.decode_attention import decode_kernel
from baby_sgl.attention.torch_native import TorchNativeAttnBackend, split_by_length
from baby_sgl.core.memory_pool import KVPool
from helpers import decode_forward_batch

HEADS, KV_HEADS, DIM = 6, 2, 16


@pytest.fixture(params=["kernel", "portable"])
def path(request):
    """Decode attention through our CPU kernel, or the portable gather + SDPA path."""
    if request.param == "kernel" and decode_kernel() is None:
        pytest.skip("the CPU kernel could not be built here (no C++ compiler?)")
    return request.param


def _batch(rows: list[list[int]], dtype: torch.dtype, seed: int = 0, path: str = "portable"):
    torch.manual_seed(seed)
    pool = KVPool(4096, 1, KV_HEADS, DIM, dtype, torch.device("cpu"))
    pool.k_buffers[0].normal_()
    pool.v_buffers[0].normal_()
    backend, fb = decode_forward_batch(rows, pool, path == "kernel", HEADS // KV_HEADS)
    return backend, fb, pool


def _reference(q, rows, pool, scale):
    k_buf, v_buf = pool.k_buffers[0], pool.v_buffers[0]
    outs = []
    for i, r in enumerate(rows):
        k = k_buf[torch.tensor(r)].transpose(0, 1).unsqueeze(0).float()
        v = v_buf[torch.tensor(r)].transpose(0, 1).unsqueeze(0).float()
        o = F.scaled_dot_product_attention(q[i : i + 1].unsqueeze(2).float(), k, v, scale=scale, enable_gqa=True)
        outs.append(o[0, :, 0])
    return torch.stack(outs)


def _rows_with_groups():
    """Groups sharing prefixes of different lengths, a request that shares 70 slots with a pair
    sharing 100 (the pair wins), one lone request, and a pair whose common prefix is too short."""
    a = list(range(0, 100))
    b = list(range(200, 260))
    rows = [
        a + [300, 301],
        a + [310],
        a[:70] + [320, 321, 322],  # shares 70 with the two above, who share 100 with each other
        b + [330],
        b + list(range(400, 420)),
        list(range(500, 540)),
        list(range(600, 610)) + [700],
        list(range(600, 610)) + [710, 711],
    ]
    return rows


@pytest.mark.parametrize("fallback", [False, True], ids=["cpu-kernel", "portable"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cascade_decode_matches_per_request_attention(dtype, tol, fallback, monkeypatch, path):
    if fallback:  # the path other devices take
        monkeypatch.setattr(torch_native, "_CPU_FLASH_WITH_LSE", None)
    rows = _rows_with_groups()
    backend, fb, pool = _batch(rows, dtype, path=path)
    [(_, meta)] = fb.attn_metadata.parts  # lengths close enough for one call
    shared = meta.shared
    assert shared is not None
    assert shared.lens == [100, 100, 0, 60, 60, 0, 0, 0]
    q = torch.randn(len(rows), HEADS, DIM).to(dtype)
    out = backend.forward(q, 0, DIM**-0.5, fb)
    ref = _reference(q, rows, pool, DIM**-0.5)
    assert out.shape == (len(rows), HEADS, DIM) and out.dtype == dtype
    assert (out.float() - ref).abs().max().item() < tol


def test_without_sharing_decode_matches_per_request_attention(path):
    rows = [list(range(i * 50, i * 50 + n)) for i, n in enumerate([5, 49, 17, 33])]
    backend, fb, pool = _batch(rows, torch.float32, path=path)
    [(_, meta)] = fb.attn_metadata.parts
    assert meta.shared is None
    q = torch.randn(len(rows), HEADS, DIM)
    assert (backend.forward(q, 0, 0.3, fb) - _reference(q, rows, pool, 0.3)).abs().max().item() < 1e-5


def test_short_common_prefixes_are_not_shared():
    rows = torch.tensor([list(range(MIN_SHARED_LEN)) + [900], list(range(MIN_SHARED_LEN - 1)) + [901, 902]])
    assert find_shared_prefixes(rows, [MIN_SHARED_LEN + 1, MIN_SHARED_LEN + 1], torch.float32) is None


def test_nested_prefixes_and_a_request_sharing_only_the_first_slot(path):
    """Every prompt starts with the same BOS slot; one shares nothing else. The others are still
    grouped by their long prefixes, the deepest first."""
    system = list(range(1, 120))
    rows = [
        [0] + system + list(range(200, 240)) + [300],  # these two share 159 slots
        [0] + system + list(range(200, 240)) + [301, 302],
        [0] + system + [400, 401],  # shares 120 with the two above
        [0] + system + [410],
        [0] + list(range(500, 530)) + [510],  # shares only slot 0
    ]
    backend, fb, pool = _batch(rows, torch.float32, path=path)
    [(_, meta)] = fb.attn_metadata.parts
    assert meta.shared.lens == [160, 160, 120, 120, 0]
    q = torch.randn(len(rows), HEADS, DIM)
    assert (backend.forward(q, 0, 0.25, fb) - _reference(q, rows, pool, 0.25)).abs().max().item() < 1e-5


def test_requests_of_very_different_lengths_attend_in_separate_calls(path):
    """One long context among short ones: the short ones are not padded to its length, and
    every request's result is still its own attention (long rows shuffled among short ones,
    one pair sharing a prefix in the long group)."""
    long_a = list(range(1000, 1600))
    rows = [list(range(i * 30, i * 30 + 10 + i)) for i in range(6)]
    rows[2:2] = [long_a + [1700], long_a + [1701, 1702]]
    rows.append(list(range(1800, 2200)))
    backend, fb, pool = _batch(rows, torch.float32, path=path)
    if path == "portable":  # the kernel pads nothing, so it takes the batch in one call
        groups = [sorted(idx.tolist()) if idx is not None else None for idx, _ in fb.attn_metadata.parts]
        assert groups == [[0, 1, 4, 5, 6, 7], [2, 3, 8]]
        assert fb.attn_metadata.parts[1][1].shared.lens == [600, 600, 0]
    q = torch.randn(len(rows), HEADS, DIM)
    assert (backend.forward(q, 0, 0.25, fb) - _reference(q, rows, pool, 0.25)).abs().max().item() < 1e-5


def test_length_split_pads_little_and_calls_few_times():
    assert split_by_length([100, 120, 90]) == [[0, 1, 2]]
    assert split_by_length([4000] + [200] * 16) == [list(range(1, 17)), [0]]
    lens = [37, 900, 41, 2000, 880, 35, 1990]
    assert split_by_length(lens) == [[0, 2, 5], [1, 4], [3, 6]]


def test_without_a_compiler_the_kernel_is_not_built_and_the_portable_path_is_taken(monkeypatch, caplog):
    from baby_sgl.cpu import decode_attention

    monkeypatch.setattr("baby_sgl.cpu.toolchain.cxx_compiler", lambda: None)
    monkeypatch.setattr(decode_attention, "_loaded", {})
    backend = TorchNativeAttnBackend(torch.device("cpu"), HEADS // KV_HEADS)
    assert backend.decode_kernel is None and not backend.kernel_rows
    assert any("no C++ compiler" in r.message for r in caplog.records)
