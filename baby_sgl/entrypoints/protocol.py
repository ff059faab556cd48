"""Request bodies of the native and OpenAI-compatible APIs: exact types, bounded sizes, unknown
fields refused. Sampling and session fields use the engine's own models, so HTTP and `Engine`
apply the same rules (validation.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from baby_sgl.managers.io_struct import CloseSessionReqInput, OpenSessionReqInput, SessionParams
from baby_sgl.sampling.sampling_params import SamplingParams, StopString
from baby_sgl.validation import (INT64_MAX, INT64_MIN, MAX_BATCH, MAX_ID_LEN, MAX_N, MAX_STOP, Id, Int32,
                                 NonNegInt32, StrictModel, Text, TokenId, TopLogprobsNum)

MAX_MESSAGES = 4096

TokenIds = Annotated[list[TokenId], Field(max_length=2**24)]

OpenSessionRequest = OpenSessionReqInput
CloseSessionRequest = CloseSessionReqInput


class GenerateRequest(StrictModel):
    text: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_BATCH)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_BATCH)] | None = None
    sampling_params: SamplingParams | Annotated[list[SamplingParams], Field(max_length=MAX_BATCH)] | None = None
    stream: bool = False
    rid: Id | Annotated[list[Id], Field(max_length=MAX_BATCH)] | None = None
    return_logprob: bool = False
    top_logprobs_num: TopLogprobsNum = 0
    logprob_start_len: Int32 = -1
    session_params: SessionParams | None = None


class AbortRequest(StrictModel):
    rid: Id


class StreamOptions(StrictModel):
    include_usage: bool = False


class _OpenAISampling(StrictModel):
    model: Annotated[Text, Field(max_length=MAX_ID_LEN)] | None = None
    max_tokens: NonNegInt32 | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Int32 | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    ignore_eos: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[Text, Field(max_length=MAX_ID_LEN)] | None = None

    def sampling_params(self, max_tokens: int | None) -> dict[str, Any]:
        params = {
            "max_new_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "stop": self.stop, "stop_token_ids": self.stop_token_ids, "seed": self.seed,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos,
        }
        return {k: v for k, v in params.items() if v is not None}


class CompletionRequest(_OpenAISampling):
    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_BATCH)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_BATCH)]
    logprobs: TopLogprobsNum | None = None
    echo: Literal[False] = False


class TextPart(StrictModel):
    type: Literal["text"]  # text-only models: an image or audio part is refused as invalid
    text: Text


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: Annotated[Text, Field(max_length=MAX_ID_LEN)] | None = None

    def as_template_message(self) -> dict[str, str]:
        """Chat templates expect a string; OpenAI clients may send a list of text parts."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": self.role, "content": content} | ({"name": self.name} if self.name else {})


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: NonNegInt32 | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobsNum | None = None
