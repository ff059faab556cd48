"""The adapters a pass can use, as SGLang's LoRA memory pool: --max-loras-per-batch slots on the
model's device, each holding one adapter's matrices for every layer and module, zero-padded to
the slot's rank (padding adds nothing to a product). An adapter a batch needs is copied into a
free slot, or into the slot of one the batch does not use (--lora-eviction-policy: the least
recently used, or the first loaded); pinned adapters keep theirs. The buffers never move, so
the one-call decode step reads them in place (cpu/decode_step.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from baby_sgl.lora.adapter import MODULES, RANK_SLOTS, LoRAAdapter, module_shapes
from baby_sgl.model_config import ModelConfig

NO_ADAPTER = -1  # a row's slot when it uses the base model alone


class LoRAMemoryPool:
    def __init__(self, cfg: ModelConfig, max_loras_per_batch: int, max_lora_rank: int, device: torch.device,
                 eviction_policy: str = "lru") -> None:
        self.num_slots, self.eviction_policy = max_loras_per_batch, eviction_policy
        shapes = module_shapes(cfg)
        # Per module: A [layers, slots, rank capacity, in] and B transposed, [layers, slots, rank
        # capacity, out] (the decode step adds B's rows scaled, a vector at a time).
        self.a = {m: torch.zeros(cfg.num_layers, self.num_slots, RANK_SLOTS[m] * max_lora_rank, shapes[m][0],
                                 device=device) for m in MODULES}
        self.b = {m: torch.zeros(cfg.num_layers, self.num_slots, RANK_SLOTS[m] * max_lora_rank, sum(shapes[m][1]),
                                 device=device) for m in MODULES}
        # Where each module's parts (q, k, v; gate, up) end among its outputs, and which rows of B^T
        # are not zero over each part, [layers, slots, rank capacity, parts]: a fused adapter's
        # parts each have ranks of their own, and the decode step skips the zeros.
        self.part_ends = {m: list(itertools.accumulate(shapes[m][1])) for m in MODULES}
        self.used = {m: torch.zeros(cfg.num_layers, self.num_slots, RANK_SLOTS[m] * max_lora_rank,
                                    len(shapes[m][1]), dtype=torch.uint8, device=device) for m in MODULES}
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
            parts = lora.b.T.tensor_split(self.part_ends[m][:-1], dim=1)
            self.used[m][layer, slot, :rank] = torch.stack([p.ne(0).any(dim=1) for p in parts], dim=1).to(torch.uint8)

    def _clear(self, slot: int) -> None:
        for m in MODULES:
            self.a[m][:, slot].zero_()
            self.b[m][:, slot].zero_()
            self.used[m][:, slot].zero_()

    def slot_bytes(self) -> int:
        """The device memory one slot takes (an adapter's matrices at the slots' rank)."""
        return sum((self.a[m][:, 0].nbytes + self.b[m][:, 0].nbytes) for m in MODULES)

    def batch(self, slots: torch.Tensor) -> LoRABatch | None:
        """The pass's deltas for rows whose slots are given ([T] on the device); None if no row
        uses an adapter."""
        present = [int(s) for s in torch.unique(slots).tolist() if s != NO_ADAPTER]
        if not present:
            return None
        return LoRABatch(self, [(s, torch.nonzero(slots == s).flatten()) for s in present])


@dataclass(frozen=True)
class LoRABatch:
    """A pass's adapters: each slot with the rows that use it. A projection's delta is computed
    per slot over its rows (gathered, then scattered back): one product pair per adapter present,
    whatever the mix of rows."""

    pool: LoRAMemoryPool
    segments: list[tuple[int, torch.Tensor]]  # (slot, its rows)

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (x's product with the base weight) plus each row's adapter delta."""
        a, b = self.pool.a[module][layer], self.pool.b[module][layer]
        for slot, rows in self.segments:
            delta = (x.index_select(0, rows).float() @ a[slot].T) @ b[slot]
            y.index_add_(0, rows, delta.to(y.dtype))  # y is the projection's own fresh output
        return y
