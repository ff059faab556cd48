"""Why a request ended. The scheduler and the sessions work with these values; SGLang's JSON
shape (`meta_info["finish_reason"]`) is written by `to_json` and read back by `from_json` only,
where an API output leaves or re-enters the code."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FinishReason:
    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError

    @staticmethod
    def from_json(data: dict[str, Any] | None) -> FinishReason | None:
        """The value an API output's `finish_reason` stands for (None: not finished)."""
        if data is None:
            return None
        kind = data["type"]
        if kind == "stop":
            return FinishMatched(data["matched"])
        if kind == "length":
            return FinishLength(data["length"])
        return FinishAbort(data.get("message", ""))


@dataclass(frozen=True)
class FinishMatched(FinishReason):
    """A stop token, the end-of-sequence token or the token that completed the grammar (an id);
    a stop string, or the pattern of a stop_regex that matched (a string)."""

    matched: int | str

    def to_json(self) -> dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


@dataclass(frozen=True)
class FinishLength(FinishReason):
    """max_new_tokens, or the context length, reached after `length` output tokens."""

    length: int

    def to_json(self) -> dict[str, Any]:
        return {"type": "length", "length": self.length}


@dataclass(frozen=True)
class FinishAbort(FinishReason):
    """Ended before a stop or a limit: an abort, a refused request, a failure of its own."""

    message: str

    def to_json(self) -> dict[str, Any]:
        return {"type": "abort", "message": self.message}
