"""Speculative decoding in the scheduler (--speculative-algorithm NGRAM; a part of the Scheduler,
run in its thread): which running requests get drafts (speculative/ngram.py), and how a verify pass's
logits become each request's tokens.

A verify pass is a decode pass in which a request with k drafts has k + 1 rows: its last token
and the drafts, at consecutive positions. Every row writes its KV before any row attends, and row
j attends to the request's slots up to its own, so it sees the drafts before it and none after:
the causal mask over the drafts comes for free, in the one-call CPU step and op by op alike.

Row j's logits give the token that follows draft j. The tokens are then produced one by one as
plain decoding would produce them: the sampler on row j, with the request's grammar, penalties,
min_new_tokens, logprobs and seed as they stand after the tokens before. The run stops at the
first token that differs from its draft (that token is kept: it is what decoding would have
chosen there), or when the request finishes. So greedy output is decoding's own; sampled output
keeps its distribution, since drawing x from the target distribution p and keeping the draft d
only if x == d accepts d with probability p(d) and otherwise yields x ~ p restricted to x != d,
which is speculative sampling's rejection step for a draft that is certain of d; and a seeded
request draws the very numbers it would draw without drafts. The KV of rejected drafts never
counts as computed: whole pages past the last accepted token go back to the pool at once, and the
rest of the last page is overwritten by the next pass.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch

from baby_sgl.core.finish_reason import FinishAbort
from baby_sgl.sampling.sampler import argmax_rows
from baby_sgl.speculative.ngram import NgramDrafter, RequestDrafts

if TYPE_CHECKING:
    from baby_sgl.core.req import Req
    from baby_sgl.managers.scheduler.batch import ScheduleBatch
    from baby_sgl.managers.scheduler.memory import KVMemory
    from baby_sgl.managers.scheduler.output import OutputProcessor

# The batch rule, fixed (the measurements behind it are in docs/speculative_decoding.md): a pass of
# a few rows costs much less than that many passes (the weights are read and unpacked once per tile
# of rows), so a verify pass carries at most MAX_VERIFY_ROWS rows, and with more than
# MAX_SPEC_REQUESTS requests running nobody drafts (their own rows fill the pass). Each request's
# share is --speculative-num-draft-tokens rows at most (default 4: one tile of the AVX-512 kernel).
MAX_VERIFY_ROWS, MAX_SPEC_REQUESTS = 16, 8


def make_drafter(algorithm: str | None, min_n: int, max_n: int, capacity: int, share: bool) -> NgramDrafter | None:
    return NgramDrafter(min_n, max_n, capacity, share) if algorithm == "NGRAM" else None


class Speculation:
    """Drafts from `drafter` (None: no speculative decoding), which the output processor also
    feeds: a finished request's text joins what later requests may draft from."""

    def __init__(self, drafter: NgramDrafter | None, num_draft_tokens: int, context_len: int, vocab_size: int,
                 memory: KVMemory, output: OutputProcessor, stats: dict[str, int]) -> None:
        self.drafter, self.num_draft_tokens = drafter, num_draft_tokens
        self.context_len, self.vocab_size = context_len, vocab_size
        self.memory, self.output, self.stats = memory, output, stats

    def clear(self) -> None:
        """Forgets the cache's text that drafts come from (the cache was flushed)."""
        if self.drafter is not None:
            self.drafter.clear()

    def plan_drafts(self, batch: ScheduleBatch) -> None:
        """Each running request's drafts for this decode pass, within the batch rule, each
        request's max_new_tokens and the context length; none if the pool cannot hold them."""
        drafter = self.drafter
        if drafter is None or len(batch.reqs) > MAX_SPEC_REQUESTS:
            return
        rows = len(batch.reqs)
        for i, req in enumerate(batch.reqs):
            p = req.sampling_params
            room = min(self.num_draft_tokens - 1, p.max_new_tokens - len(req.output_ids) - 1,
                       self.context_len - req.seqlen, MAX_VERIFY_ROWS - rows)
            if room <= 0 or req.to_abort:
                continue
            if req.spec.drafts is None:
                req.spec.drafts = RequestDrafts(drafter.min_n, drafter.max_n)
            self.stats["spec_draft_chances"] += 1
            batch.drafts[i] = drafter.draft(req.spec.drafts, req.origin_input_ids, req.output_ids, room)
            rows += len(batch.drafts[i])
        if not batch.can_decode():  # the drafts' slots are not there: decode one token each
            batch.drafts = [[] for _ in batch.reqs]

    def process_verify(self, batch: ScheduleBatch, logits: torch.Tensor) -> list[Req]:
        """The tokens of a decode pass with drafts, request by request (an error ends one).
        Returns the requests that go on decoding."""
        still_running = []
        row = 0
        for req, drafts in zip(batch.reqs, batch.drafts):
            rows = logits[row : row + 1 + len(drafts)]
            row += 1 + len(drafts)
            if self.output.guarded(req, partial(self._verify, req, rows, drafts)):
                still_running.append(req)
        return still_running

    def _verify(self, req: Req, rows: torch.Tensor, drafts: list[int]) -> bool:
        """One request's share of a verify pass; True if it keeps decoding."""
        if req.to_abort:
            self.output.finish(req, FinishAbort(req.to_abort))
            return False
        self._accept(req, rows, drafts)
        if req.finished:
            self.output.release(req)
        self.output.emit(req)
        return not req.finished

    def _accept(self, req: Req, rows: torch.Tensor, drafts: list[int]) -> None:
        """Appends the tokens decoding would produce from rows, up to the first that differs from
        its draft; the request's KV then covers the tokens before the last one appended."""
        targets = argmax_rows(rows[:, : self.vocab_size]).tolist() if _plain_greedy(req) else None
        appended = 0
        for j in range(len(drafts) + 1):
            token, logprobs = (targets[j], None) if targets is not None else self.output.sample_one(rows[j : j + 1], req)
            self.output.append_token(req, token, logprobs)
            appended += 1
            if req.finished or j == len(drafts) or token != drafts[j]:
                break
        req.kv.kv_len += appended  # the last token and the accepted drafts were computed
        if drafts:
            accepted = sum(1 for t, d in zip(req.output_ids[-appended:], drafts) if t == d)
            req.spec.verify_ct += 1
            req.spec.accepted_tokens += accepted
            self.stats["spec_verify_steps"] += 1
            self.stats["spec_draft_tokens"] += len(drafts)
            self.stats["spec_accepted_tokens"] += accepted
            assert req.spec.drafts is not None, "a request with drafts has a drafting state"
            req.spec.drafts.record(len(drafts), accepted)
        self._drop_rejected_slots(req)

    def _drop_rejected_slots(self, req: Req) -> None:
        """Whole pages past the last computed token go back to the pool (they held only rejected
        drafts); the row keeps what it had before the pass plus the accepted tokens."""
        page = self.memory.allocator.page_size
        keep = -(-req.kv.kv_len // page) * page
        if req.kv.alloc_len > keep:
            self.memory.allocator.free(self.memory.row_slots(req, keep, req.kv.alloc_len))
        req.kv.alloc_len = req.kv.kv_len


def _plain_greedy(req: Req) -> bool:
    """Greedy with nothing that depends on the tokens before (no grammar, penalties, bias, pending
    min_new_tokens or logprobs): every row's token is its argmax, all taken at once."""
    p = req.sampling_params
    return (p.is_greedy and req.grammar is None and not req.logprobs.return_logprob and not p.has_penalties
            and not p.logit_bias and len(req.output_ids) >= p.min_new_tokens)
