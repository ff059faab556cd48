"""One generation request as the scheduler sees it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from baby_sgl.core.sampling_params import SamplingParams


@dataclass
class TimeStats:
    created: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None


class Req:
    def __init__(self, rid: str, input_ids: list[int], sampling_params: SamplingParams,
                 on_output: Callable[[dict[str, Any]], None] | None = None, stream: bool = False) -> None:
        self.rid = rid
        self.origin_input_ids = input_ids
        self.output_ids: list[int] = []
        self.sampling_params = sampling_params
        self.on_output = on_output
        self.stream = stream
        self.time_stats = TimeStats()
        self.finished_reason: dict[str, Any] | None = None
        self.to_abort: str | None = None  # set by an abort; honoured at the next step
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (max over prefills)
        self.num_retractions = 0  # times retracted to free KV (its prompt and output prefilled again)
        # Speculative decoding: its drafting state (speculative/ngram.py), the verify passes in
        # which it had drafts, and the drafts accepted.
        self.draft_state: Any = None
        self.spec_verify_ct = 0
        self.spec_accepted_tokens = 0
        self.session: Any = None  # the Session this request is a turn of (session_controller.py)
        # Log-probabilities, SGLang's format: [logprob, token_id, None] per token (see
        # sampling/logprobs.py); prompt ones from position logprob_start_len on.
        self.return_logprob = False
        self.top_logprobs_num = 0
        self.token_ids_logprob: list[int] | None = None
        self.return_text_in_logprobs = False
        self.logprob_start_len: int | None = None  # prompt logprobs from this position (None: none)
        self.input_token_logprobs: list[list] = []
        self.input_top_logprobs: list[list[list] | None] = []
        self.input_token_ids_logprobs: list[list[list] | None] = []
        self.output_token_logprobs: list[list] = []
        self.output_top_logprobs: list[list[list]] = []
        self.output_token_ids_logprobs: list[list[list]] = []
        self.grammar: Any = None  # the constraint's matcher (constrained/), advanced token by token
        # KV state: row `req_pool_idx` of the ReqToTokenPool holds alloc_len slots, of which the
        # first kv_len hold computed K/V (the rest were allocated for a pass not yet done); the
        # first cache_protected_len are owned by the tree (locked through last_node).
        self.req_pool_idx: int | None = None
        self.kv_len = 0
        self.alloc_len = 0
        self.cache_protected_len = 0
        self.last_node: Any = None  # the prefix cache's handle (opaque here; see base_prefix_cache.py)
        # Set by the scheduler for the next extend pass; the match is kept while the cache's
        # version and the sequence's length stay what they were (prefix_match_key).
        self.prefix_indices: Any = None
        self.prefix_match_key: tuple[int, int] | None = None
        self.extend_input_len = 0
        self.is_chunked = False
        # Incremental detokenization (see detokenizer.py).
        self.text = ""
        self.surr_offset = 0
        self.read_offset = 0
        self.sent_text_len = 0
        self.sent_ids_len = 0

    @property
    def fill_ids(self) -> list[int]:
        """Every token of the sequence so far; token i has position i (invariant 1)."""
        return self.origin_input_ids + self.output_ids

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def row(self) -> int:
        """The request-slot row this request holds (an error if it holds none)."""
        assert self.req_pool_idx is not None, f"{self!r} holds no request slot"
        return self.req_pool_idx

    def input_logprobs_pending(self) -> bool:
        """Prompt logprobs were asked for and are not all computed yet."""
        start = self.logprob_start_len
        return start is not None and len(self.input_token_logprobs) < len(self.origin_input_ids) - start

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def reset_kv_state(self) -> None:
        self.req_pool_idx, self.kv_len, self.alloc_len, self.cache_protected_len = None, 0, 0, 0
        self.last_node = None
        self.prefix_indices, self.extend_input_len, self.is_chunked = None, 0, False
        self.prefix_match_key = None

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, input={len(self.origin_input_ids)}, output={len(self.output_ids)})"
