"""Per-request sampling parameters, validated like SGLang's SamplingParams."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

_EPS = 1e-6


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    n: int = 1

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Builds and validates; raises ValueError naming the offending field."""
        d = dict(d or {})
        if "sampling_seed" in d:  # SGLang's spelling
            d["seed"] = d.pop("sampling_seed")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        merged = {k: v for k, v in (defaults or {}).items() if k in known}
        merged.update({k: v for k, v in d.items() if v is not None})
        if isinstance(merged.get("stop"), str):
            merged["stop"] = [merged["stop"]]
        params = cls(**merged)
        params.verify()
        return params

    def verify(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise bad(name, "must be an integer")
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            if not isinstance(getattr(self, name), (int, float)) or isinstance(getattr(self, name), bool):
                raise bad(name, "must be a number")
        if self.max_new_tokens < 0:
            raise bad("max_new_tokens", "must be >= 0")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise bad("min_new_tokens", "must be between 0 and max_new_tokens")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < 1 and self.top_k != -1:
            raise bad("top_k", "must be -1 (disabled) or >= 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2:
            raise bad("repetition_penalty", "must be in (0, 2]")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of them")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of token ids")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", "must be an integer")
        if self.n < 1:
            raise bad("n", "must be >= 1")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)
