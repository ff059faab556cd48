"""Request bodies of the native and OpenAI-compatible APIs: exact types, bounded sizes, unknown
fields refused. Sampling and session fields use the engine's own models, so HTTP and `Engine`
apply the same rules (validation.py)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from baby_sgl.entrypoints.chat import ChatRequest, NamedTool, ToolChoice
from baby_sgl.entrypoints.tool_grammar import Tool
from baby_sgl.managers.io_struct import (CloseSessionReqInput, LogprobOptions, OpenSessionReqInput,
                                         SessionParams)
from baby_sgl.core.sampling_params import (GRAMMAR_KINDS, MAX_LOGIT_BIAS, MAX_STOP_REGEX, Grammar, LogitBias,
                                           SamplingParams, StopString, check_copies_budget, check_stop_budget)
from baby_sgl.validation import (check_nesting, INT64_MAX, INT64_MIN, MAX_BATCH, MAX_ID_LEN, MAX_N, MAX_STOP, Id, Int32,
                                 NonNegInt32, StrictModel, Text, TokenId, TopLogprobsNum, SGLangInput)

MAX_MESSAGES = 4096
MAX_TOOLS = 128  # OpenAI's limit on tools per request
MAX_SCHEMA_DEPTH = 32  # nesting of a tool's parameter schema

# OpenAI's rule for function names (Anthropic's is the same but for dots)
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]

TokenIds = Annotated[list[TokenId], Field(max_length=2**24)]

OpenSessionRequest = OpenSessionReqInput
CloseSessionRequest = CloseSessionReqInput


# SGLang's /generate fields we do not implement: accepted at their default only (null when not
# listed), anything else is refused by name.
_GENERATE_DEFAULT_ONLY = {
    name: None for name in (
        "input_embeds", "image_data", "video_data", "audio_data", "modalities", "lora_id",
        "custom_logit_processor", "session_id", "bootstrap_host", "bootstrap_port", "bootstrap_room",
        "bootstrap_pair_key", "decode_tp_size", "data_parallel_rank", "routed_dp_rank", "disagg_prefill_dp_rank",
        "routing_key", "conversation_id", "max_thinking_tokens", "priority", "extra_key", "cache_salt",
        "external_trace_header", "received_time", "mm_hashes", "mm_content_hashes",
        "video_config", "watermark", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
        "video_max_dynamic_patch", "images_config", "mm_processor_kwargs", "multi_item_delimiter_indices",
        "token_indices_to_pool", "kv_hints", "positional_embed_overrides", "return_sampling_mask",
        "sampling_logprobs_mode")
} | {
    name: False for name in (
        "return_hidden_states", "return_routed_experts", "return_indexer_topk", "background", "require_reasoning",
        "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64",
        "return_bytes", "return_entropy", "use_audio_in_video")
} | {"routed_experts_start_len": 0, "custom_labels": (None, {})}


class GenerateRequest(SGLangInput, LogprobOptions):
    default_only = _GENERATE_DEFAULT_ONLY

    text: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_BATCH)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_BATCH)] | None = None
    sampling_params: SamplingParams | Annotated[list[SamplingParams], Field(max_length=MAX_BATCH)] | None = None
    stream: bool = False
    rid: Id | Annotated[list[Id], Field(max_length=MAX_BATCH)] | None = None
    return_prompt_token_ids: bool = False
    session_params: SessionParams | None = None
    log_metrics: bool = True  # false: the request is left out of /metrics (health probes)
    no_logs: bool = False  # nothing of a request is logged anyway
    model: Annotated[Text, Field(max_length=MAX_ID_LEN)] | None = None  # sent by routers; one model is served
    # The LoRA adapter of every prompt, or of each (null: the base model).
    lora_path: Id | Annotated[list[Id | None], Field(max_length=MAX_BATCH)] | None = None


class AbortRequest(StrictModel):
    rid: Id


class ConcateAndAppendRequest(StrictModel):
    """What SGLang's frontend sends when it joins forks with mode="concate_and_append"."""

    src_rids: Annotated[list[Id], Field(max_length=MAX_BATCH)]
    dst_rid: Id


class StreamOptions(StrictModel):
    include_usage: bool = False


class JsonSchemaFormat(StrictModel):
    name: Annotated[Text, Field(max_length=MAX_ID_LEN)] | None = None
    description: Text | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's structured output: json_object (any JSON object) or json_schema (that schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> dict[str, str]:
        if self.type == "json_object":
            return {"json_schema": '{"type": "object"}'}
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise ValueError("response_format.json_schema.schema is required for type json_schema")
            return {"json_schema": json.dumps(self.json_schema.schema_)}
        return {}


# SGLang's extensions of OpenAI's requests that we do not implement (SGLang's router sends some of
# them on every request): accepted at their defaults only.
_OPENAI_DEFAULT_ONLY = {"return_hidden_states": False, "continue_final_message": False,
                        "best_of": (None, 1), "lora_path": None, "custom_logit_processor": None, "custom_params": None,
                        "priority": None, "rid": None, "session_params": None, "structural_tag": None}


class _OpenAISampling(SGLangInput):
    default_only = _OPENAI_DEFAULT_ONLY

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
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, LogitBias] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # SGLang's extensions of OpenAI's requests.
    regex: Grammar | None = None
    ebnf: Grammar | None = None
    json_schema: Grammar | None = None
    stop_regex: Text | Annotated[list[Text], Field(max_length=MAX_STOP_REGEX)] | None = None
    min_tokens: NonNegInt32 | None = None
    no_stop_trim: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    # With --reasoning-parser: the thinking goes to reasoning_content (else it stays in content),
    # and is streamed as it comes (else sent whole with the last piece).
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    @model_validator(mode="after")
    def _budget(self) -> _OpenAISampling:
        """The n choices are n engine requests: what their stops, stop tokens and logit_bias cost
        at every step is bounded together."""
        check_stop_budget(_as_list(self.stop), _as_list(self.stop_regex), self.n)
        check_copies_budget("stop_token_ids", len(self.stop_token_ids or []), self.n, MAX_STOP)
        check_copies_budget("logit_bias", len(self.logit_bias or {}), self.n, MAX_LOGIT_BIAS)
        return self

    def sampling_params(self, max_tokens: int | None) -> dict[str, Any]:
        params = {
            "max_new_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "stop": self.stop, "stop_token_ids": self.stop_token_ids, "seed": self.seed,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos,
            "logit_bias": self.logit_bias, "regex": self.regex, "ebnf": self.ebnf, "json_schema": self.json_schema,
            "stop_regex": self.stop_regex, "min_new_tokens": self.min_tokens, "no_stop_trim": self.no_stop_trim,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
        }
        params = {k: v for k, v in params.items() if v is not None}
        constraint = self.response_format.constraint() if self.response_format else {}
        if constraint and any(k in params for k in GRAMMAR_KINDS):
            raise ValueError("give response_format or one of regex, ebnf, json_schema, not both")
        return params | constraint


def _as_list(value: str | list[str] | None) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else value


class CompletionRequest(_OpenAISampling):
    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_BATCH)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_BATCH)]
    logprobs: TopLogprobsNum | None = None
    echo: bool = False  # the prompt precedes the completion (and its logprobs, with logprobs)


class TextPart(StrictModel):
    type: Literal["text"]  # text-only models: an image or audio part is refused as invalid
    text: Text


def check_depth(value: Any, where: str = "the value") -> Any:
    """Refuses JSON nested deeper than MAX_SCHEMA_DEPTH: tool schemas and arguments are rendered
    and compiled recursively."""
    return check_nesting(value, MAX_SCHEMA_DEPTH, where)


# A JSON object from a client that holds a schema or a call's arguments
JsonObject = Annotated[dict[str, Any], AfterValidator(check_depth)]


class FunctionDefinition(StrictModel):
    name: FunctionName
    description: Text | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition

    def tool(self) -> Tool:
        f = self.function
        return Tool(f.name, f.description, f.parameters if f.parameters is not None else {"type": "object"},
                    bool(f.strict))


class ToolChoiceFunction(StrictModel):
    name: FunctionName


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ToolChoiceFunction


class FunctionCall(StrictModel):
    name: Annotated[Text, Field(max_length=MAX_ID_LEN)]
    arguments: Text  # JSON text


class ToolCallItem(StrictModel):
    id: Id
    type: Literal["function"] = "function"
    function: FunctionCall
    index: NonNegInt32 | None = None  # sent back by some clients that collected a stream


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: Annotated[Text, Field(max_length=MAX_ID_LEN)] | None = None
    tool_calls: Annotated[list[ToolCallItem], Field(max_length=MAX_TOOLS)] | None = None  # an assistant's calls
    tool_call_id: Id | None = None  # a tool result: the call it answers
    reasoning_content: Text | None = None  # an assistant's thinking, for templates that show it

    def as_template_message(self, i: int) -> dict[str, Any]:
        """Chat templates expect a string; OpenAI clients may send a list of text parts. Calls'
        arguments become values, as templates write them (invalid JSON is refused)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        message: dict[str, Any] = {"role": self.role, "content": content}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        if self.tool_calls:
            if self.role != "assistant":
                raise ValueError(f"messages[{i}].tool_calls: only an assistant's message has tool calls")
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments,
                                                                 f"messages[{i}].tool_calls[{j}].function.arguments")}}
                for j, c in enumerate(self.tool_calls)]
        return message


def _arguments(text: str, where: str) -> Any:
    try:
        return check_depth(json.loads(text), where)
    except (json.JSONDecodeError, RecursionError):
        raise ValueError(f"{where} is not valid JSON") from None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    # Variables for the chat template (enable_thinking, ...): names and plain values only.
    chat_template_kwargs: Annotated[dict[Annotated[Text, Field(max_length=64)], bool | int | float | Text | None],
                                    Field(max_length=16)] | None = None
    max_completion_tokens: NonNegInt32 | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobsNum | None = None
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def chat_request(self, constraint: dict[str, str]) -> ChatRequest:
        """The chat turn; constraint: the request's own (from its sampling params)."""
        tools = [t.tool() for t in self.tools or []]
        if len({t.name for t in tools}) < len(tools):
            raise ValueError("tools: two functions have the same name")
        given = self.tool_choice or ("auto" if tools else "none")
        choice: ToolChoice = NamedTool(given.function.name) if isinstance(given, NamedToolChoice) else given
        if choice == "required" and not tools:
            raise ValueError("tool_choice is required but no tools were given")
        return ChatRequest([m.as_template_message(i) for i, m in enumerate(self.messages)], tools, choice,
                           self.parallel_tool_calls, self.chat_template_kwargs, self.separate_reasoning, constraint)
