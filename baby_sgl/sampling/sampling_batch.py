"""What sampling needs of each row of a pass, gathered from the requests before their logits are
sampled: the sampler reads this and the logits, never a request, and returns what it chose
(the scheduler writes it back)."""

from __future__ import annotations

from dataclasses import dataclass

from baby_sgl.constrained.grammar import GrammarMatcher
from baby_sgl.core.req import LogprobState, PenaltyCounts, Req
from baby_sgl.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class LogprobQuery:
    """The logprobs a row reports besides its token's: its top k (0: none), and those of these ids."""

    top_k: int
    token_ids: list[int] | None

    @staticmethod
    def of(state: LogprobState) -> LogprobQuery | None:
        return LogprobQuery(state.top_logprobs_num, state.token_ids_logprob) if state.return_logprob else None


@dataclass(frozen=True)
class PenaltyContext:
    """What a row's penalties look at: its request's running counts, and the prompt and output
    they are kept up to date with (the request's own lists, not copies)."""

    counts: PenaltyCounts
    prompt: list[int]
    output: list[int]


@dataclass(frozen=True)
class SamplingBatch:
    params: list[SamplingParams]
    num_output: list[int]  # output tokens so far: min_new_tokens, and the step of a seeded draw
    penalties: list[PenaltyContext | None]  # None: the row has no penalty
    grammars: list[GrammarMatcher | None]
    logprobs: list[LogprobQuery | None]  # None: the row reports no logprobs

    @staticmethod
    def from_reqs(reqs: list[Req]) -> SamplingBatch:
        return SamplingBatch(
            params=[r.sampling_params for r in reqs],
            num_output=[len(r.output_ids) for r in reqs],
            penalties=[_penalty_context(r) if r.sampling_params.has_penalties else None for r in reqs],
            grammars=[r.grammar for r in reqs],
            logprobs=[LogprobQuery.of(r.logprobs) for r in reqs],
        )

    def __len__(self) -> int:
        return len(self.params)


def _penalty_context(req: Req) -> PenaltyContext:
    return PenaltyContext(req.penalty_counts, req.origin_input_ids, req.output_ids)
