"""Shared rules for input that comes from outside (Engine arguments and HTTP bodies alike).

Everything a client sends is checked against one pydantic model before it reaches the
scheduler: exact types (no "5" for 5, no true for 1), finite floats, integers in ranges the
kernels and tensors can hold, bounded lengths, and strings that are valid Unicode (a lone
surrogate cannot be tokenized, logged or sent back as JSON).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 16  # choices per prompt (sampling_params.n, OpenAI's n)
MAX_BATCH = 256  # prompts in one call
MAX_ID_LEN = 256  # rids and session ids
MAX_STOP = 64  # stop strings or stop token ids per request
MAX_STOP_LEN = 1024
MAX_TOP_LOGPROBS = 20


def check_nesting(value: Any, limit: int, where: str) -> Any:
    """Refuses JSON with dicts and lists nested more than limit deep, walked without recursion: the
    code that reads such values next (schema rewriting, grammar compilers, templates) recurses."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise ValueError(f"{where} nests deeper than {limit} levels")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return value


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode: {e.reason} at position {e.start}") from None
    return s


Text = Annotated[str, AfterValidator(_valid_unicode)]
Id = Annotated[Text, Field(min_length=1, max_length=MAX_ID_LEN)]
Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
NonNegInt32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenId = NonNegInt32
TopLogprobsNum = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]


class StrictModel(BaseModel):
    """Exact JSON types, no unknown fields, no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "body"}


def field_path(loc: tuple, prefix: str = "") -> str:
    """A pydantic error location as the client spells it: field names and list indices, without
    the union members and validators pydantic puts in between."""
    parts = [prefix] if prefix else []
    for x in loc:
        x = str(x)
        if x.isdigit() or (x.isidentifier() and x.lower() == x and x not in _TYPE_TAGS):
            parts.append(x)
    return ".".join(parts)


def describe_error(first: Mapping[str, Any], prefix: str = "") -> str:
    """One pydantic error as one line naming the field (and the value, unless our own check
    already says it)."""
    where = field_path(tuple(first.get("loc", ())), prefix)
    msg = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        return f"unknown field {where!r}"
    if first.get("type") == "value_error":  # our own check: its message names the values
        msg = str(first.get("ctx", {}).get("error", msg))
        return f"{where}: {msg}" if where else msg
    shown = first.get("input")
    value = "" if first.get("type") == "missing" else f", got {_short(shown)}"
    return f"{where}: {msg}{value}" if where else f"{msg}{value}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


M = TypeVar("M", bound=BaseModel)


def validate(model: type[M], data: Any, prefix: str = "") -> M:
    """model.model_validate, with a ValueError that names the field on failure."""
    if isinstance(data, model):
        return data
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ValueError(describe_error(e.errors()[0], prefix)) from None


def validate_text(s: str, name: str) -> str:
    try:
        return _valid_unicode(s)
    except ValueError as e:
        raise ValueError(f"{name} is {e}") from None


def accept_defaults_only(data: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """SGLang's clients send every field, null when unused: nulls are dropped ("not given"), and
    the fields named in `defaults` (ones we do not implement) are dropped when they hold their
    default (a value, or a tuple of accepted values); any other value is refused by name."""
    out = {k: v for k, v in data.items() if v is not None}
    for name, default in defaults.items():
        if name not in out:
            continue
        value = out.pop(name)
        accepted = default if isinstance(default, tuple) else (default,)
        if not any(value is a or (type(value) is type(a) and value == a) for a in accepted):
            shown = " or ".join(map(repr, accepted))
            raise ValueError(f"{name} is not supported by baby-sgl (accepted only as {shown}), got {_short(value)}")
    return out


class SGLangInput(StrictModel):
    """A body shaped like SGLang's: null means "not given", and the fields of `default_only`
    are accepted at their defaults only (see accept_defaults_only)."""

    default_only: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _sglang_input(cls, data: Any) -> Any:
        return accept_defaults_only(data, cls.default_only) if isinstance(data, dict) else data
