"""The scheduler's view of one batch: it allocates request and KV slots, lays out the tensors of
an extend or decode pass, and retracts requests when decode runs out of KV slots."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from baby_sgl.core.forward_batch import ForwardMode, ModelWorkerBatch
from baby_sgl.sampling.logprobs import InputLogprobSpan, plan_input_logprobs

if TYPE_CHECKING:
    from baby_sgl.core.req import Req
    from baby_sgl.managers.scheduler.memory import KVMemory


class ScheduleBatch:
    def __init__(self, reqs: list[Req], mode: ForwardMode, memory: KVMemory) -> None:
        self.reqs, self.mode = reqs, mode
        self.req_to_token_pool, self.allocator = memory.req_to_token_pool, memory.allocator
        self.tree_cache = memory.tree_cache
        self.prefix_lens: list[int] = []
        self.seq_lens: list[int] = []
        self.out_cache_loc: torch.Tensor | None = None
        self.num_decode_reqs = 0  # MIXED: the last requests of the batch decode one token each
        self.input_logprob_spans: list[InputLogprobSpan] = []  # prompt logprobs this pass computes
        # DECODE with speculative decoding: each request's draft tokens, verified in this pass
        # after its last token (one row each; speculation.py). Empty lists: plain decode.
        self.drafts: list[list[int]] = [[] for _ in reqs]

    # ---- KV slots ------------------------------------------------------------------------
    def alloc_token_slots(self, prefix_lens: list[int], seq_lens: list[int]) -> torch.Tensor | None:
        """Slots for the new tokens of every request; evicts from the tree first if needed."""
        alloc = self.allocator
        need = sum(alloc.pages_needed(a, b) for a, b in zip(prefix_lens, seq_lens)) * alloc.page_size
        if need > alloc.available_size():
            self.tree_cache.evict(need - alloc.available_size())
        table = self.req_to_token_pool.req_to_token
        # The slot of each row's last token, where its last page has room (never with pages of one).
        last_locs = [int(table[r.kv.req_pool_idx, p - 1]) if p % alloc.page_size else -1 for r, p in zip(self.reqs, prefix_lens)]
        return alloc.alloc_extend(prefix_lens, seq_lens, last_locs)

    def decode_pages_needed(self) -> int:
        return sum(self.allocator.pages_needed(r.kv.kv_len, r.kv.kv_len + 1 + len(d)) for r, d in zip(self.reqs, self.drafts))

    # ---- extend --------------------------------------------------------------------------
    def prepare_for_extend(self) -> None:
        """Gives new requests a row holding their cached prefix, then slots for the new tokens."""
        for req in self.reqs:
            if req.kv.req_pool_idx is None:
                req.kv.req_pool_idx = self.req_to_token_pool.alloc()
                assert req.kv.req_pool_idx is not None, "admission let in more requests than slots"
                prefix = req.prefix()
                self.req_to_token_pool.write(req.kv.req_pool_idx, 0, prefix.to(self.req_to_token_pool.req_to_token.device))
                req.kv.kv_len = req.kv.alloc_len = req.kv.cache_protected_len = len(prefix)
        self.prefix_lens = [r.kv.kv_len for r in self.reqs]
        self.seq_lens = [r.kv.kv_len + r.kv.extend_input_len for r in self.reqs]
        self.out_cache_loc = self.alloc_token_slots(self.prefix_lens, self.seq_lens)
        assert self.out_cache_loc is not None, "admission let in more tokens than the pool holds"
        self._write_rows()

    def _write_rows(self) -> None:
        start, slots = 0, self.slots()
        for req, a, b in zip(self.reqs, self.prefix_lens, self.seq_lens):
            self.req_to_token_pool.write(req.row(), a, slots[start : start + b - a])
            req.kv.alloc_len = b  # owned now, computed once the pass has run (kv_len)
            start += b - a

    # ---- decode --------------------------------------------------------------------------
    def prepare_for_decode(self) -> None:
        """Slots for each request's last token (and its drafts, if any)."""
        self.prefix_lens = [r.kv.kv_len for r in self.reqs]
        self.seq_lens = [r.kv.kv_len + 1 + len(d) for r, d in zip(self.reqs, self.drafts)]
        self.out_cache_loc = self.alloc_token_slots(self.prefix_lens, self.seq_lens)
        assert self.out_cache_loc is not None, "decode was scheduled without enough KV slots"
        self._write_rows()

    def mix_with_running(self, decoding: ScheduleBatch) -> None:
        """--enable-mixed-chunk: this extend batch also carries one decode step of the running
        requests (`decoding`, prepared for decode), which come after the extend requests."""
        self.mode, self.num_decode_reqs = ForwardMode.MIXED, len(decoding.reqs)
        self.reqs = self.reqs + decoding.reqs
        self.drafts = self.drafts + decoding.drafts
        self.prefix_lens = self.prefix_lens + decoding.prefix_lens
        self.seq_lens = self.seq_lens + decoding.seq_lens
        self.out_cache_loc = torch.cat([self.slots(), decoding.slots()])

    def slots(self) -> torch.Tensor:
        """The KV slots of this pass's new tokens (once prepared for extend or decode)."""
        assert self.out_cache_loc is not None, "the batch is not prepared yet"
        return self.out_cache_loc

    def can_decode(self) -> bool:
        need = self.decode_pages_needed() * self.allocator.page_size
        return need <= self.allocator.available_size() + self.tree_cache.evictable_size()

    def retract_decode(self) -> list[Req]:
        """Removes requests until the rest can decode one more token. Victims release their KV
        (whole pages stay cached in the tree) and will be prefilled again from input + output."""
        # As SGLang: keep the requests that have produced the most; retract short-output ones first.
        order = sorted(self.reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True)
        retracted = []
        while len(order) > 1 and not self.can_decode():
            victim = order.pop()
            del self.drafts[self.reqs.index(victim)]
            self.reqs.remove(victim)
            self.tree_cache.release_req(victim)
            victim.num_retractions += 1
            retracted.append(victim)
        return retracted

    # ---- hand-off to the model runner ------------------------------------------------------
    def _decode_worker_batch(self) -> ModelWorkerBatch:
        """One row per token: a request's last token, then its drafts at the next positions, each
        row seeing the request's slots up to its own (the drafts before it included)."""
        input_ids: list[int] = []
        seq_lens: list[int] = []
        rows: list[int] = []
        loras: list[str | None] = []
        for r, prefix, drafts in zip(self.reqs, self.prefix_lens, self.drafts):
            input_ids += [r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1], *drafts]
            seq_lens += range(prefix + 1, prefix + 2 + len(drafts))
            rows += [r.row()] * (1 + len(drafts))
            loras += [r.lora_id] * (1 + len(drafts))
        return ModelWorkerBatch(
            mode=self.mode, input_ids=input_ids, positions=torch.tensor(seq_lens, device="cpu") - 1,
            out_cache_loc=self.slots(), req_pool_indices=rows, seq_lens=seq_lens,
            extend_prefix_lens=[n - 1 for n in seq_lens], extend_seq_lens=[1] * len(seq_lens), lora_ids=loras)

    def get_model_worker_batch(self) -> ModelWorkerBatch:
        if self.mode == ForwardMode.DECODE:
            return self._decode_worker_batch()
        # EXTEND, or MIXED (a decoding request's one new token is the last of its fill_ids).
        input_ids = [t for r, a, b in zip(self.reqs, self.prefix_lens, self.seq_lens) for t in r.fill_ids[a:b]]
        positions = torch.cat([torch.arange(a, b, device="cpu") for a, b in zip(self.prefix_lens, self.seq_lens)])
        rows, self.input_logprob_spans = plan_input_logprobs(self.reqs, self.prefix_lens, self.seq_lens,
                                                             len(self.reqs) - self.num_decode_reqs)
        return ModelWorkerBatch(
            mode=self.mode,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=self.slots(),
            req_pool_indices=[r.row() for r in self.reqs],
            seq_lens=self.seq_lens,
            extend_prefix_lens=self.prefix_lens,
            extend_seq_lens=[b - a for a, b in zip(self.prefix_lens, self.seq_lens)],
            num_decode_reqs=self.num_decode_reqs,
            input_logprob_rows=rows or None,
            lora_ids=[r.lora_id for r in self.reqs],
        )
