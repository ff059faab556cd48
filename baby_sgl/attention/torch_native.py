"""Attention over the paged KV pool: our CPU kernel, or torch's scaled_dot_product_attention on any
device (written for CUDA too, where it has not been run yet).

Decode is batched, and each KV head's group of query heads is treated as a short query
sequence, so GQA needs no copies of K/V. On CPU our kernel (cpu/decode_attention.py) reads each request's
slots in place; elsewhere, or without a C++ compiler, the slots are gathered into a padded
[B, L] table (padding masked) for scaled_dot_product_attention, and requests of very different
lengths go in separate calls (see split_by_length). Either way a prefix several requests share
is read once per group (see shared_prefix.py). Extend loops over the requests of the batch (not
over tokens): each request's new queries attend to its cached prefix plus the causal part of its
new tokens. A pool of 1-byte elements (--kv-cache-dtype) is read as stored by the kernels; the
portable path widens the rows it gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from baby_sgl.cpu.decode_attention import decode_kernel
from baby_sgl.cpu.ops import cpu_ops
from baby_sgl.attention.shared_prefix import SharedPrefixes, find_shared_prefixes, merge
from baby_sgl.core import kv_cache_dtype
from baby_sgl.core.forward_batch import ForwardBatch, ForwardMode
from baby_sgl.core.memory_pool import LayerKV


@dataclass
class _DecodeMeta:
    kv_indices: torch.Tensor  # [B, L] each request's slots after its shared prefix, padded
    lens: torch.Tensor  # [B] how many of them each request has
    mask: torch.Tensor | None  # [B, 1, 1, L] 0 for the request's slots, -inf for padding (portable path)
    shared: SharedPrefixes | None


@dataclass
class _DecodePlan:
    parts: list[tuple[torch.Tensor | None, _DecodeMeta]]  # (batch rows, or None for all; their metadata)


# The kernel scores one query against one key at a time: it beats gather + flash attention for
# the few query heads per KV head of a single request (3 here: 0.25 vs 0.27 ms for 4 x 512 slots,
# bf16), and loses for more (12: 0.78 vs 0.26 ms), such as a shared-prefix group's queries.
_KERNEL_MAX_QUERIES = 4

# An extra attention call costs about as much as this many padded KV slots (per request and
# layer: ~0.3 us a slot, ~100-150 us a call on a 2-core CPU).
_CALL_COST_SLOTS = 512


def split_by_length(lens: list[int]) -> list[list[int]]:
    """Batch rows in groups of similar length, each group padded to its own longest: the split
    of the sorted lengths that minimises padded slots plus a fixed cost per group (dynamic
    programming). Padding a batch of short requests to one 4000-token context made a decode
    step 6x slower (measured: 584 vs 91 ms for 17 requests)."""
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    best, cut = [0] + [float("inf")] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        longest = lens[order[j - 1]]
        for i in range(j):
            cost = best[i] + (j - i) * longest + _CALL_COST_SLOTS
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(order)
    while j:
        groups.append(sorted(order[cut[j] : j]))
        j = cut[j]
    return groups[::-1]


@dataclass
class _ExtendMeta:
    rows: torch.Tensor  # [B, W]: request i's slots 0..prefix + extend - 1 lead its row
    prefix_lens: list[int]
    extend_lens: list[int]  # per request: new tokens
    window: int | None = None  # query at position p sees keys p - window < k <= p only
    _portable: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None
    _kernel_lens: tuple[torch.Tensor, torch.Tensor] | None = None

    def kernel_lens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The lengths as int64 CPU tensors for the kernel, made once per batch."""
        if self._kernel_lens is None:
            self._kernel_lens = (torch.tensor(self.prefix_lens, device="cpu"), torch.tensor(self.extend_lens, device="cpu"))
        return self._kernel_lens

    def portable(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Per request, its slots and its mask (None: plain causal, no cached prefix), made once."""
        if self._portable is not None:
            return self._portable
        indices: list[torch.Tensor] = []
        masks: list[torch.Tensor | None] = []
        dev = self.rows.device
        for i, (prefix, ext) in enumerate(zip(self.prefix_lens, self.extend_lens)):
            if self.window is not None:
                # Keys before the first query's window are not read at all.
                start = max(0, prefix - self.window + 1)
                indices.append(self.rows[i, start : prefix + ext])
                q_pos = prefix + torch.arange(ext, device=dev)[:, None]
                k_pos = start + torch.arange(prefix + ext - start, device=dev)[None, :]
                masks.append((k_pos <= q_pos) & (k_pos > q_pos - self.window))
                continue
            indices.append(self.rows[i, : prefix + ext])
            # Invariant 2: query j (absolute position prefix + j) sees keys 0..prefix + j.
            causal = None
            if prefix:
                causal = torch.ones(ext, prefix + ext, dtype=torch.bool, device=dev).tril(prefix)
            masks.append(causal)
        self._portable = (indices, masks)
        return self._portable


@dataclass
class _MixedMeta:
    extend: _ExtendMeta  # the batch's first requests, whose new tokens come first
    decode: _DecodePlan  # the rest, one new token each
    extend_tokens: int


def _gather(buf: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """buf[indices] for any shape of indices; index_select is ~3x faster than advanced indexing
    on CPU (measured: 26 vs 90 us for 8 x 192 slots of [3, 64])."""
    return buf.index_select(0, indices.reshape(-1)).view(*indices.shape, *buf.shape[1:])


def _widened(rows: torch.Tensor, scales: torch.Tensor | None, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows gathered from the pool at `indices` as dtype (a 1-byte pool's times their scales):
    only the rows a request reads are widened, never the pool. Rows already in dtype are returned as they are."""
    if scales is None and rows.dtype == dtype:
        return rows
    return kv_cache_dtype.widen(rows, None if scales is None else _gather(scales, indices), dtype)


class _Workspace:
    """Reused output buffers for the decode gathers. A fresh tensor of tens of MB per layer is
    served by new pages from the OS, which made the copy 4x slower than the copy itself
    (measured 23 vs 6 ms for 64 x 1100 slots). Each buffer keeps the largest gather seen: at
    most max_running_requests x context slots of one layer's K (or V)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def release(self) -> None:
        self.buffers.clear()

    def gather(self, name: str, buf: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        n = indices.numel() * buf[0].numel()
        ws = self.buffers.get(name)
        if ws is None or ws.numel() < n or ws.dtype != buf.dtype or ws.device != buf.device:
            ws = self.buffers[name] = torch.empty(n, dtype=buf.dtype, device=buf.device)
        out = ws[:n].view(indices.numel(), *buf.shape[1:])
        torch.index_select(buf, 0, indices.reshape(-1), out=out)
        return out.view(*indices.shape, *buf.shape[1:])


# The CPU kernel behind scaled_dot_product_attention, which also returns the log-sum-exp.
_CPU_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_with_lse(q, k, v, mask, scale):
    """Softmax attention that also returns the log-sum-exp of each query's scores."""
    if q.device.type == "cpu" and _CPU_FLASH_WITH_LSE is not None:
        return _CPU_FLASH_WITH_LSE(q, k, v, attn_mask=mask, scale=scale)
    # Scores in float32: half-precision products could overflow before the scale is applied.
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale + mask.float()
    lse = scores.logsumexp(-1)
    return torch.matmul((scores - lse.unsqueeze(-1)).exp(), v.float()).to(q.dtype), lse


def _padding_mask(lens: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    cols = torch.arange(width, device=lens.device)
    mask = torch.zeros(len(lens), 1, 1, width, dtype=dtype, device=lens.device)
    return mask.masked_fill_((cols[None, :] >= lens[:, None])[:, None, None, :], float("-inf"))


class TorchNativeAttnBackend:
    def __init__(self, device: torch.device | None = None, queries_per_kv_head: int = 1,
                 sliding_window: int | None = None, every_layer_windowed: bool = False) -> None:
        self.workspace = _Workspace()
        # Layers that attend over the last sliding_window positions only get metadata of their own
        # (attn_metadata_window): decode reads each request's last slots, extend masks by position.
        self.sliding_window = sliding_window
        self.full_attention_layers = not (sliding_window is not None and every_layer_windowed)
        # On CPU, decode attention reads the pool in place with our kernel when it can be built,
        # for every request's own slots if the model has few query heads per KV head.
        self.decode_kernel = decode_kernel() if device is not None and device.type == "cpu" else None
        self.kernel_rows = self.decode_kernel is not None and queries_per_kv_head <= _KERNEL_MAX_QUERIES
        # Prefill attention reads the pool in place with the CPU step's kernel (cpu/csrc/attention.h).
        self.extend_kernel = cpu_ops() if device is not None and device.type == "cpu" else None

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, : max(fb.seq_lens_cpu)]
        if self.full_attention_layers:  # (Mistral has none: its full metadata would go unread)
            fb.attn_metadata = self._metadata(fb, rows, None)
        if self.sliding_window is not None:
            fb.attn_metadata_window = self._metadata(fb, rows, self.sliding_window)

    def _metadata(self, fb: ForwardBatch, rows: torch.Tensor, window: int | None) -> _DecodePlan | _ExtendMeta | _MixedMeta:
        if fb.mode == ForwardMode.DECODE:
            return self._decode_meta(rows, fb.seq_lens, fb.seq_lens_cpu, fb.kv_pool.dtype, window)
        n = fb.batch_size - fb.num_decode_reqs
        extend = _ExtendMeta(rows[:n].contiguous(), list(fb.extend_prefix_lens_cpu[:n]),
                             list(fb.extend_seq_lens_cpu[:n]), window)
        if fb.mode == ForwardMode.EXTEND:
            return extend
        decode = self._decode_meta(rows[n:], fb.seq_lens[n:], fb.seq_lens_cpu[n:], fb.kv_pool.dtype, window)
        return _MixedMeta(extend, decode, sum(extend.extend_lens))

    def _decode_meta(self, rows: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: list[int],
                     dtype: torch.dtype, window: int | None = None) -> _DecodePlan:
        if window is not None:
            # The new token (position len - 1) sees the last `window` slots: each row starts there.
            starts = torch.tensor([max(0, n - window) for n in seq_lens_cpu], device=rows.device)
            seq_lens_cpu = [n - max(0, n - window) for n in seq_lens_cpu]
            take = (starts[:, None] + torch.arange(max(seq_lens_cpu), device=rows.device)).clamp_(max=rows.shape[1] - 1)
            rows, seq_lens = rows.gather(1, take), seq_lens - starts
        # The kernel pads nothing: one call. The portable path splits by length.
        groups = [list(range(len(seq_lens_cpu)))] if self.kernel_rows else split_by_length(seq_lens_cpu)
        # A window's rows start at different positions: their first slots are no longer shared.
        share = window is None
        if len(groups) == 1:
            return _DecodePlan([(None, self._decode_group(rows, seq_lens, seq_lens_cpu, dtype, share))])
        parts: list[tuple[torch.Tensor | None, _DecodeMeta]] = []
        for g in groups:
            idx = torch.tensor(g, device=rows.device)
            parts.append((idx, self._decode_group(rows[idx], seq_lens[idx], [seq_lens_cpu[i] for i in g], dtype,
                                                  share)))
        return _DecodePlan(parts)

    def _decode_group(self, rows: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: list[int],
                      dtype: torch.dtype, share: bool = True) -> _DecodeMeta:
        rows = rows[:, : max(seq_lens_cpu)].contiguous()
        shared = find_shared_prefixes(rows.cpu(), seq_lens_cpu, dtype, rows.device) if share else None

        def mask(lens: torch.Tensor, width: int) -> torch.Tensor | None:  # the kernel needs none
            return None if self.kernel_rows else _padding_mask(lens, width, dtype)

        if shared is None:
            return _DecodeMeta(rows, seq_lens, mask(seq_lens, rows.shape[1]), None)
        # Each request keeps the slots after its group's shared prefix.
        starts = torch.tensor(shared.lens, device=rows.device)
        width = max(n - s for n, s in zip(seq_lens_cpu, shared.lens))
        take = (starts[:, None] + torch.arange(width, device=rows.device)).clamp_(max=rows.shape[1] - 1)
        lens = seq_lens - starts
        return _DecodeMeta(rows.gather(1, take), lens, mask(lens, width), shared)

    def forward(self, q: torch.Tensor, layer_id: int, scale: float, fb: ForwardBatch,
                windowed: bool = False) -> torch.Tensor:
        kv = fb.kv_pool.layer(layer_id)
        meta = fb.attn_metadata_window if windowed else fb.attn_metadata
        if fb.mode == ForwardMode.DECODE:
            return self._decode(q, kv, scale, meta)
        if fb.mode == ForwardMode.EXTEND:
            return self._extend(q, kv, scale, meta)
        t = meta.extend_tokens
        return torch.cat([self._extend(q[:t], kv, scale, meta.extend), self._decode(q[t:], kv, scale, meta.decode)])

    def _extend(self, q, kv: LayerKV, scale, meta: _ExtendMeta) -> torch.Tensor:
        if self.extend_kernel is not None and q.shape[-1] % 16 == 0 and meta.window is None:
            return self.extend_kernel.extend_attention(q, kv.k, kv.v, meta.rows, *meta.kernel_lens(), scale,
                                                       kv.k_scale, kv.v_scale)
        outs, start = [], 0
        for idx, mask, ext in zip(*meta.portable(), meta.extend_lens):
            qi = q[start : start + ext].transpose(0, 1).unsqueeze(0)  # [1, H, ext, D]
            ki = _widened(_gather(kv.k, idx), kv.k_scale, idx, q.dtype).transpose(0, 1).unsqueeze(0)
            vi = _widened(_gather(kv.v, idx), kv.v_scale, idx, q.dtype).transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
            outs.append(oi[0].transpose(0, 1))
            start += ext
        return torch.cat(outs, dim=0)

    def _decode(self, q, kv: LayerKV, scale, plan: _DecodePlan) -> torch.Tensor:
        if len(plan.parts) == 1:
            return self._decode_group_attn(q, kv, scale, plan.parts[0][1])
        out = torch.empty_like(q)
        for idx, meta in plan.parts:
            assert idx is not None
            out.index_copy_(0, idx, self._decode_group_attn(q[idx], kv, scale, meta))
        return out

    def _decode_group_attn(self, q, kv: LayerKV, scale, meta: _DecodeMeta) -> torch.Tensor:
        batch, heads, dim = q.shape
        kv_heads = kv.k.shape[1]
        group = heads // kv_heads
        qg = q.view(batch, kv_heads, group, dim)  # [B, Hkv, group, D]: plain MHA over Hkv heads
        sp = meta.shared
        if sp is None and not self.kernel_rows:  # no log-sum-exp needed: the plain SDPA kernel
            k, v = self._gather_kv("", kv, meta.kv_indices, q.dtype)  # [B, Hkv, L, D]
            return F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.mask, scale=scale).reshape(batch, heads, dim)
        out, lse = self._attend(qg, kv, meta.kv_indices, meta.lens, meta.mask, scale, "")
        if sp is None:
            return out.reshape(batch, heads, dim)
        n_groups, width = sp.members.shape
        # Every group's queries as one sequence: [G, Hkv, M * group, D].
        qs = qg[sp.members.reshape(-1)].view(n_groups, width, kv_heads, group, dim)
        qs = qs.transpose(1, 2).reshape(n_groups, kv_heads, width * group, dim)
        out_s, lse_s = self._attend(qs, kv, sp.kv_indices, sp.kv_lens, sp.mask, scale, "shared_")
        # Back to one entry per grouped request: [S, Hkv, group, (D)].
        out_s = out_s.view(n_groups, kv_heads, width, group, dim).transpose(1, 2)
        out_s = out_s.reshape(n_groups * width, kv_heads, group, dim)[sp.flat]
        lse_s = lse_s.view(n_groups, kv_heads, width, group).transpose(1, 2)
        lse_s = lse_s.reshape(n_groups * width, kv_heads, group)[sp.flat]
        merged = merge(out[sp.rows], lse[sp.rows], out_s, lse_s)
        out = out.index_copy(0, sp.rows, merged)
        return out.reshape(batch, heads, dim)

    def _kernel_takes(self, q: torch.Tensor) -> bool:
        return self.decode_kernel is not None and q.shape[2] <= _KERNEL_MAX_QUERIES

    def _gather_kv(self, name: str, kv: LayerKV, table: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the slots in table [N, L] as [N, Hkv, L, D] of dtype."""
        k = _widened(self.workspace.gather(name + "k", kv.k, table), kv.k_scale, table, dtype)
        v = _widened(self.workspace.gather(name + "v", kv.v, table), kv.v_scale, table, dtype)
        return k.transpose(1, 2), v.transpose(1, 2)

    def _attend(self, q, kv: LayerKV, table, lens, mask, scale, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of q [N, Hkv, G, D] over each row's slots (table [N, L], the first lens[n] of
        row n; mask says the same for the portable path), with the log-sum-exp of the scores."""
        if self.decode_kernel is not None and self._kernel_takes(q):
            return self.decode_kernel.decode_attention(q.contiguous(), kv.k, kv.v, table, lens, scale, kv.k_scale,
                                                       kv.v_scale)
        k, v = self._gather_kv(name, kv, table, q.dtype)
        return _attend_with_lse(q, k, v, mask, scale)
