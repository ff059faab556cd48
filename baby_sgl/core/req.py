"""One generation request as the scheduler sees it, with its state grouped by concern: what it
asks for (sampling parameters, logprob options, grammar), where its KV is, how far its output
has been detokenized and sent, its timing and speculative-decoding counts."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from baby_sgl.constrained.grammar import GrammarMatcher
from baby_sgl.core.finish_reason import FinishReason
from baby_sgl.core.sampling_params import SamplingParams

# SGLang's logprob entry: [logprob (None for a prompt's first token), token_id, its text or None].
LogprobEntry = list[float | int | str | None]


@dataclass
class TimeStats:
    created: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's entries: its own, its top k and the requested ids' (None: not asked for)."""

    token: LogprobEntry
    top: list[LogprobEntry] | None
    token_ids: list[LogprobEntry] | None


@dataclass
class PenaltyCounts:
    """A request's token counts for its penalties, brought up to date with its new output tokens
    at each step, so a step's cost does not grow with the sequence (rebuilt from the whole
    sequence they took ~1.6 ms a request-step at 8k tokens). counts: each id's output tokens
    (frequency and presence penalties); seen: the ids in the prompt or the output
    (repetition_penalty). Vocabulary-sized, made at the first step that needs them."""

    counts: torch.Tensor | None = None
    seen: torch.Tensor | None = None
    synced: int = 0  # output tokens counted

    def update(self, prompt: list[int], output: list[int], vocab: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Ids past the logits' width are dropped on the host: a mask on the device would wait for it.
        if self.counts is None or self.seen is None:
            self.counts = torch.zeros(vocab, dtype=torch.int32, device=device)
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.seen[torch.tensor([t for t in prompt if t < vocab], dtype=torch.long, device=device)] = True
            self.synced = 0
        if len(output) > self.synced:
            ids = torch.tensor([t for t in output[self.synced :] if t < vocab], dtype=torch.long, device=device)
            self.counts.index_add_(0, ids, torch.ones(len(ids), dtype=torch.int32, device=device))
            self.seen[ids] = True
            self.synced = len(output)
        return self.counts, self.seen


@dataclass
class LogprobState:
    """The logprobs a request asks for (SGLang's options) and those computed so far, in SGLang's
    format (see sampling/logprobs.py); prompt ones from position start_len on."""

    return_logprob: bool = False
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    start_len: int | None = None  # prompt logprobs from this position (None: none)
    input_token_logprobs: list[LogprobEntry] = field(default_factory=list)
    input_top_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)
    input_token_ids_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)
    output_token_logprobs: list[LogprobEntry] = field(default_factory=list)
    output_top_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)  # (never None)
    output_token_ids_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)

    def input_pending(self, prompt_len: int) -> bool:
        """Prompt logprobs were asked for and are not all computed yet."""
        return self.start_len is not None and len(self.input_token_logprobs) < prompt_len - self.start_len

    def add_output(self, entry: TokenLogprobs) -> None:
        _append(entry, self.output_token_logprobs, self.output_top_logprobs, self.output_token_ids_logprobs)

    def add_input(self, head: int | None, entries: list[TokenLogprobs]) -> None:
        """head: the first prompt token scored, whose entry has no logprob (nothing predicts it):
        its top k and requested ids' entries are null."""
        lists = self.input_token_logprobs, self.input_top_logprobs, self.input_token_ids_logprobs
        if head is not None:
            self.input_token_logprobs.append([None, head, None])
            if self.top_logprobs_num:
                self.input_top_logprobs.append(None)
            if self.token_ids_logprob is not None:
                self.input_token_ids_logprobs.append(None)
        for entry in entries:
            _append(entry, *lists)


def _append(entry: TokenLogprobs, tokens: list[LogprobEntry], tops: list[list[LogprobEntry] | None],
            token_ids: list[list[LogprobEntry] | None]) -> None:
    tokens.append(entry.token)
    if entry.top is not None:
        tops.append(entry.top)
    if entry.token_ids is not None:
        token_ids.append(entry.token_ids)


@dataclass
class SpecState:
    """Speculative decoding: the drafting state (speculative/ngram.py's RequestDrafts, a layer
    above this one), the verify passes in which the request had drafts, and the drafts accepted."""

    drafts: Any = None
    verify_ct: int = 0
    accepted_tokens: int = 0


@dataclass
class DetokenizeState:
    """How far the output ids were detokenized (detokenizer.py), and how much was sent."""

    read_offset: int = 0  # output ids read into the window
    window: list[int] = field(default_factory=list)  # the latest ids read, decoded at each step
    window_sent: int = 0  # characters of the window's text already in Req.text
    sent_text_len: int = 0
    sent_ids_len: int = 0


@dataclass
class KVPosition:
    """Where a request's KV is. Row `req_pool_idx` of the ReqToTokenPool holds alloc_len slots, of
    which the first kv_len hold computed K/V (the rest were allocated for a pass not yet done); the
    first cache_protected_len are owned by the tree (locked through last_node, the prefix cache's
    handle: opaque here, see base_prefix_cache.py). The rest is set by admission for the next extend
    pass: the cached prefix matched (kept while the cache's version and the sequence's length stay
    what they were: prefix_match_key), the tokens the pass computes and whether more are to come."""

    req_pool_idx: int | None = None
    kv_len: int = 0
    alloc_len: int = 0
    cache_protected_len: int = 0
    last_node: Any = None
    prefix_indices: torch.Tensor | None = None
    prefix_match_key: tuple[int, int] | None = None
    extend_input_len: int = 0
    is_chunked: bool = False


@dataclass
class ReqOutput:
    """What the scheduler emits for one request: the text and ids new since its last output (the
    whole output if it does not stream), and whether (and why) it finished."""

    req: Req
    text: str
    output_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None


class Req:
    def __init__(self, rid: str, input_ids: list[int], sampling_params: SamplingParams,
                 on_output: Callable[[ReqOutput], None] | None = None, stream: bool = False) -> None:
        self.rid = rid
        self.origin_input_ids = input_ids
        self.output_ids: list[int] = []
        self.sampling_params = sampling_params
        self.grammar: GrammarMatcher | None = None  # the constraint, advanced token by token
        self.logprobs = LogprobState()
        self.penalty_counts = PenaltyCounts()  # used only with penalties
        self.on_output = on_output
        self.stream = stream
        self.time_stats = TimeStats()
        self.finished_reason: FinishReason | None = None
        self.to_abort: str | None = None  # set by an abort; honoured at the next step
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (max over prefills)
        self.num_retractions = 0  # times retracted to free KV (its prompt and output prefilled again)
        self.spec = SpecState()
        # The Session this request is a turn of (managers/session_controller.py, a layer above).
        self.session: Any = None
        self.text = ""  # the output's text so far
        self.detok = DetokenizeState()
        self.kv = KVPosition()
        # The LoRA adapter it runs with (None: the base model); also its radix cache namespace.
        self.lora_id: str | None = None

    @property
    def fill_ids(self) -> list[int]:
        """Every token of the sequence so far; token i has position i (invariant 1)."""
        return self.origin_input_ids + self.output_ids

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def row(self) -> int:
        """The request-slot row this request holds (an error if it holds none)."""
        assert self.kv.req_pool_idx is not None, f"{self!r} holds no request slot"
        return self.kv.req_pool_idx

    def prefix(self) -> torch.Tensor:
        """The KV slots of the cached prefix matched for its next extend pass (an error if none was)."""
        assert self.kv.prefix_indices is not None, f"{self!r} has no prefix match"
        return self.kv.prefix_indices

    def input_logprobs_pending(self) -> bool:
        return self.logprobs.input_pending(len(self.origin_input_ids))

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def check(self) -> None:
        """Asserts what holds of a request between passes: the tree's part of its row is computed,
        and the computed part allocated, within the sequence; a request without a row holds no KV;
        one output logprob per output token; no more sent than produced."""
        assert 0 <= self.kv.cache_protected_len <= self.kv.kv_len <= self.kv.alloc_len, self._kv_state()
        assert self.kv.req_pool_idx is not None or self.kv.alloc_len == 0, self._kv_state()
        assert self.kv.kv_len <= self.seqlen, self._kv_state()
        lp = self.logprobs
        assert not lp.return_logprob or len(lp.output_token_logprobs) == len(self.output_ids), \
            f"{self!r}: {len(lp.output_token_logprobs)} output logprobs"
        d = self.detok
        assert d.sent_ids_len <= len(self.output_ids) and d.sent_text_len <= len(self.text), f"{self!r}: sent {d}"

    def _kv_state(self) -> str:
        return (f"{self!r}: row {self.kv.req_pool_idx}, protected {self.kv.cache_protected_len}, computed {self.kv.kv_len}, "
                f"allocated {self.kv.alloc_len}")

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, input={len(self.origin_input_ids)}, output={len(self.output_ids)})"
