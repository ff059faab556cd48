"""Per-request options and session inputs, validated by one model for the Engine and the HTTP
routes alike."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from baby_sgl.validation import Id, Int32, NonNegInt32, SGLangInput, StrictModel, TokenId, TopLogprobsNum

MAX_SESSION_TIMEOUT_S = 30 * 24 * 3600.0
MAX_TOKEN_IDS_LOGPROB = 256
# Logprob entries one call may ask for, its prompts and samples together (a scored position
# holds one, plus one a top logprob and a token_ids_logprob id). Each is built in the scheduler's
# thread as a Python list (~130 bytes) and sent as ~25 bytes of JSON: this bounds a call's
# answer to ~260 MB in memory. 8000 output tokens of n=16 samples with 20 top logprobs fit.
MAX_LOGPROB_ENTRIES = 3_000_000


class LogprobBudget:
    """The logprob entries a call's requests ask for, counted against MAX_LOGPROB_ENTRIES."""

    def __init__(self) -> None:
        self.used = 0

    def take(self, entries: int) -> None:
        """Counts a request's entries, or raises ValueError (counting none) where they do not fit."""
        if self.used + entries > MAX_LOGPROB_ENTRIES:
            left = MAX_LOGPROB_ENTRIES - self.used
            raise ValueError(f"logprobs: this asks for {entries} logprob entries (scored positions x (1 + "
                             f"top_logprobs_num + len(token_ids_logprob)) x n), more than the {left} left of "
                             f"the {MAX_LOGPROB_ENTRIES} one call may have: score fewer prompt positions "
                             "(logprob_start_len), ask for fewer tokens or top logprobs, or split the batch")
        self.used += entries


class LogprobOptions(StrictModel):
    """The logprobs a request asks for, with SGLang's names (the HTTP body has the same fields)."""

    return_logprob: bool = False
    top_logprobs_num: TopLogprobsNum = 0
    # Prompt logprobs from this position (-1: none); only with return_logprob.
    logprob_start_len: Int32 = -1
    token_ids_logprob: Annotated[list[TokenId], Field(max_length=MAX_TOKEN_IDS_LOGPROB)] | None = None
    return_text_in_logprobs: bool = False


class ReqOptions(LogprobOptions):
    """What one request asks for besides its prompt and sampling parameters."""

    rid: Id | None = None


class SessionParams(SGLangInput):
    """`session_params` of a request: which open session it is a turn of, and how it continues."""

    id: Id
    rid: Id | None = None  # the turn it continues (None: the session's start)
    offset: NonNegInt32 = 0  # keep only the first `offset` tokens of that turn's context (0: all)
    replace: bool = False
    drop_previous_output: bool = False


class OpenSessionReqInput(SGLangInput):
    # As SGLang: recorded, not enforced (its own client sends 0); a session's context is bounded by
    # the model's context length, and each turn's output by its max_new_tokens.
    capacity_of_str_len: NonNegInt32
    session_id: Id | None = None
    streaming: bool = False
    # An idle session closes by itself after this many seconds.
    timeout: float | None = Field(None, gt=0, le=MAX_SESSION_TIMEOUT_S)


class CloseSessionReqInput(StrictModel):
    session_id: Id
