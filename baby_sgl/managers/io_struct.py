"""Per-request options and session inputs, validated by one model for the Engine and the HTTP
routes alike."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from baby_sgl.validation import INT32_MAX, Id, Int32, NonNegInt32, StrictModel, TokenId, TopLogprobsNum

MAX_SESSION_TIMEOUT_S = 30 * 24 * 3600.0
MAX_TOKEN_IDS_LOGPROB = 256


class _DropNulls(StrictModel):
    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        """null means "not given", as SGLang's clients send it."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class ReqOptions(StrictModel):
    """What one request asks for besides its prompt and sampling parameters."""

    rid: Id | None = None
    return_logprob: bool = False
    top_logprobs_num: TopLogprobsNum = 0
    # Prompt logprobs from this position (-1: none); only with return_logprob.
    logprob_start_len: Int32 = -1
    token_ids_logprob: Annotated[list[TokenId], Field(max_length=MAX_TOKEN_IDS_LOGPROB)] | None = None
    return_text_in_logprobs: bool = False


class SessionParams(_DropNulls):
    """`session_params` of a request: which open session it is a turn of, and how it continues."""

    id: Id
    rid: Id | None = None  # the turn it continues (None: the session's start)
    offset: NonNegInt32 = 0  # keep only the first `offset` tokens of that turn's context (0: all)
    replace: bool = False
    drop_previous_output: bool = False


class OpenSessionReqInput(_DropNulls):
    capacity_of_str_len: int = Field(ge=1, le=INT32_MAX)
    session_id: Id | None = None
    streaming: bool = False
    # An idle session closes by itself after this many seconds.
    timeout: float | None = Field(None, gt=0, le=MAX_SESSION_TIMEOUT_S)


class CloseSessionReqInput(StrictModel):
    session_id: Id
