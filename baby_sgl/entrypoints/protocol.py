"""Request bodies of the native and OpenAI-compatible APIs. Unknown fields are refused."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateRequest(_Strict):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    session_params: dict[str, Any] | None = None


class AbortRequest(_Strict):
    rid: str


class OpenSessionRequest(_Strict):
    capacity_of_str_len: int
    session_id: str | None = None
    streaming: bool = False
    timeout: float | None = None


class CloseSessionRequest(_Strict):
    session_id: str


class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAISampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def sampling_params(self, max_tokens: int | None) -> dict[str, Any]:
        params = {
            "max_new_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "stop": self.stop, "stop_token_ids": self.stop_token_ids, "seed": self.seed,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos,
        }
        return {k: v for k, v in params.items() if v is not None}


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False


class TextPart(_Strict):
    type: Literal["text"]  # text-only models: an image or audio part is refused as invalid
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        """Chat templates expect a string; OpenAI clients may send a list of text parts."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": self.role, "content": content} | ({"name": self.name} if self.name else {})


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
