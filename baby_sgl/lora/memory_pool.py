"""The adapters a pass can use, as SGLang's LoRA memory pool: --max-loras-per-batch slots on the
model's device, in the model's dtype (bfloat16 on a bfloat16 model: half the memory and half the
bytes a decode step reads), each holding one adapter's matrices for every layer and module,
zero-padded to the slot's rank (padding adds nothing to a product). An adapter a batch needs is
copied into a free slot, or into the slot of one the batch does not use (--lora-eviction-policy:
the least recently used, or the first loaded); pinned adapters keep theirs. The buffers never
move, so the one-call decode step reads them in place (cpu/decode_step.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from baby_sgl.lora.adapter import MODULES, RANK_SLOTS, LoRAAdapter, LoRABlock, module_shapes
from baby_sgl.model_config import ModelConfig

NO_ADAPTER = -1  # a row's slot when it uses the base model alone
# An adapter's rows are multiplied where they lie when its runs of consecutive rows (a prompt's
# tokens) average at least this many; else they are gathered, multiplied together and scattered
# back: each product has a fixed cost, which short runs pay once each (docs/benchmarks.md).
MIN_RUN_ROWS = 96


class LoRAMemoryPool:
    def __init__(self, cfg: ModelConfig, max_loras_per_batch: int, max_lora_rank: int, device: torch.device,
                 eviction_policy: str = "lru", dtype: torch.dtype = torch.float32) -> None:
        self.num_slots, self.eviction_policy = max_loras_per_batch, eviction_policy
        shapes = module_shapes(cfg)
        # Per module: A [layers, slots, rank capacity, in] and B transposed, [layers, slots, rank
        # capacity, out] (the decode step adds B's rows scaled, a vector at a time).
        self.a = {m: torch.zeros(cfg.num_layers, self.num_slots, RANK_SLOTS[m] * max_lora_rank, shapes[m][0],
                                 dtype=dtype, device=device) for m in MODULES}
        self.b = {m: torch.zeros(cfg.num_layers, self.num_slots, RANK_SLOTS[m] * max_lora_rank, sum(shapes[m][1]),
                                 dtype=dtype, device=device) for m in MODULES}
        # Where each module's parts (q, k, v; gate, up) end among its outputs, and which rows of B^T
        # are not zero over each part, [layers, slots, rank capacity, parts]: a fused adapter's
        # parts each have ranks of their own, and the decode step skips the zeros.
        self.part_ends = {m: list(itertools.accumulate(shapes[m][1])) for m in MODULES}
        self.used = {m: torch.zeros(cfg.num_layers, self.num_slots, RANK_SLOTS[m] * max_lora_rank,
                                    len(shapes[m][1]), dtype=torch.uint8, device=device) for m in MODULES}
        # Per module, layer and slot: the blocks of B^T its adapter fills (none: no delta), so the
        # op-by-op path multiplies those alone.
        self.blocks: dict[str, list[list[tuple[LoRABlock, ...]]]] = {
            m: [[() for _ in range(self.num_slots)] for _ in range(cfg.num_layers)] for m in MODULES}
        self.adapters: dict[str, LoRAAdapter] = {}  # loaded (host copies), by id (registry.py)
        self.pinned: set[str] = set()
        self.slot_of: dict[str, int] = {}
        self._uses: dict[str, int] = {}  # per slotted adapter: the pass it was last used in (lru) or loaded (fifo)
        self._clock = 0

    # ---- loading and unloading -----------------------------------------------------------
    def add(self, lora_id: str, adapter: LoRAAdapter, pinned: bool = False) -> None:
        if pinned and len(self.pinned) + 1 >= self.num_slots:
            raise ValueError(f"pinning {adapter.name!r} would leave no --max-loras-per-batch slot for other adapters")
        self.adapters[lora_id] = adapter
        if pinned:
            self.pinned.add(lora_id)
            self._assign([lora_id], {lora_id})

    def remove(self, lora_id: str) -> None:
        self.adapters.pop(lora_id)
        self.pinned.discard(lora_id)
        slot = self.slot_of.pop(lora_id, None)
        self._uses.pop(lora_id, None)
        if slot is not None:
            self._clear(slot)

    def fits(self, names: set[str]) -> bool:
        """Whether one pass may use all these adapters (pinned ones keep their slots)."""
        return len(names | self.pinned) <= self.num_slots

    # ---- a pass --------------------------------------------------------------------------
    def prepare(self, names: list[str | None]) -> list[int]:
        """Each row's slot (NO_ADAPTER for the base model), given its adapter's id, copying in
        the adapters not slotted."""
        self._clock += 1
        wanted = {n for n in names if n is not None}
        assert self.fits(wanted), f"{len(wanted)} adapters in one pass, {self.num_slots} slots"
        self._assign(sorted(wanted), wanted)
        if self.eviction_policy == "lru":
            self._uses.update({n: self._clock for n in wanted})
        return [NO_ADAPTER if n is None else self.slot_of[n] for n in names]

    def _assign(self, names: list[str], keep: set[str]) -> None:
        for name in names:
            if name in self.slot_of:
                continue
            used = set(self.slot_of.values())
            free = [s for s in range(self.num_slots) if s not in used]
            if not free:
                victim = min((n for n in self.slot_of if n not in keep and n not in self.pinned), key=self._uses.__getitem__)
                free = [self.slot_of.pop(victim)]
                del self._uses[victim]
            self._copy_in(self.adapters[name], free[0])
            self.slot_of[name], self._uses[name] = free[0], self._clock

    def _copy_in(self, adapter: LoRAAdapter, slot: int) -> None:
        self._clear(slot)
        for (layer, m), lora in adapter.modules.items():
            rank = lora.a.shape[0]
            self.a[m][layer, slot, :rank].copy_(lora.a)
            self.b[m][layer, slot, :rank].copy_(lora.b.T)
            self.blocks[m][layer][slot] = lora.blocks
            parts = lora.b.T.tensor_split(self.part_ends[m][:-1], dim=1)
            self.used[m][layer, slot, :rank] = torch.stack([p.ne(0).any(dim=1) for p in parts], dim=1).to(torch.uint8)

    def _clear(self, slot: int) -> None:
        for m in MODULES:
            self.a[m][:, slot].zero_()
            self.b[m][:, slot].zero_()
            self.used[m][:, slot].zero_()
            for layer_blocks in self.blocks[m]:
                layer_blocks[slot] = ()

    def slot_bytes(self) -> int:
        """The device memory one slot takes (an adapter's matrices at the slots' rank)."""
        return sum((self.a[m][:, 0].nbytes + self.b[m][:, 0].nbytes) for m in MODULES)

    def batch(self, slots: list[int], extend_seq_lens: list[int]) -> LoRABatch | None:
        """The pass's deltas, given each request's slot and its rows (consecutive, in order);
        None if no row uses an adapter."""
        runs: dict[int, list[tuple[int, int]]] = {}
        row = 0
        for slot, n in zip(slots, extend_seq_lens):
            if slot != NO_ADAPTER and n > 0:
                last = runs.setdefault(slot, [])
                if last and last[-1][1] == row:  # the previous request's adapter too: one run
                    last[-1] = (last[-1][0], row + n)
                else:
                    last.append((row, row + n))
            row += n
        if not runs:
            return None
        device = self.a[MODULES[0]].device
        return LoRABatch(self, [(slot, _segment(rs, device)) for slot, rs in sorted(runs.items())])


def _segment(runs: list[tuple[int, int]], device: torch.device) -> list[slice] | torch.Tensor:
    """An adapter's rows: its runs, if long enough to be multiplied where they lie; else its row
    numbers, to be gathered."""
    if sum(end - start for start, end in runs) >= MIN_RUN_ROWS * len(runs):
        return [slice(start, end) for start, end in runs]
    return torch.cat([torch.arange(start, end, device=device) for start, end in runs])


@dataclass(frozen=True)
class LoRABatch:
    """A pass's adapters: each slot with the rows that use it, as runs of consecutive rows
    multiplied in place, or as row numbers gathered and scattered back (MIN_RUN_ROWS). A
    projection's delta takes one product x A^T per adapter (or run) and one product per block of
    B^T its adapter fills: an adapter on q alone never multiplies the k and v columns of q/k/v."""

    pool: LoRAMemoryPool
    segments: list[tuple[int, list[slice] | torch.Tensor]]  # (slot, its runs or its rows)

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (x's product with the base weight, fresh: changed in place) plus each row's adapter
        delta, computed in the slots' dtype (the model's)."""
        pool = self.pool
        for slot, rows in self.segments:
            blocks = pool.blocks[module][layer][slot]
            if not blocks:
                continue
            a = pool.a[module][layer, slot, : blocks[-1].ranks.stop]
            b = pool.b[module][layer, slot]
            if isinstance(rows, list):
                for run in rows:
                    _add_delta(x[run], y[run], a, b, blocks)
            else:
                gathered = y.index_select(0, rows)
                _add_delta(x.index_select(0, rows), gathered, a, b, blocks)
                y.index_copy_(0, rows, gathered)
        return y


def _add_delta(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               blocks: tuple[LoRABlock, ...]) -> None:
    """y += (x A^T) B^T over the blocks of B^T (b) the adapter fills; y a view, written in place."""
    t = F.linear(x.to(a.dtype), a).to(y.dtype)
    for block in blocks:
        y[:, block.outputs].addmm_(t[:, block.ranks], b[block.ranks, block.outputs].to(y.dtype))
