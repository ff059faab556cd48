"""Per-request sampling parameters, with SGLang's names, validated by one model for the Engine
and the HTTP routes alike (see validation.py)."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from pydantic import Field, ValidationError, model_validator

from baby_sgl.validation import (INT64_MAX, INT64_MIN, MAX_N, MAX_STOP, MAX_STOP_LEN, Int32, NonNegInt32,
                                 StrictModel, Text, TokenId, validate)

logger = logging.getLogger(__name__)

_EPS = 1e-6
StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_LEN)]


class SamplingParams(StrictModel):
    # 0 means prefill only: the prompt is computed (and cached), nothing is generated.
    max_new_tokens: NonNegInt32 = 128
    min_new_tokens: NonNegInt32 = 0
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: Int32 = -1  # -1: the whole vocabulary
    min_p: float = Field(0.0, ge=0, le=1)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    n: int = Field(1, ge=1, le=MAX_N)

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        """null means "not given" (SGLang's clients send every field); SGLang spells the seed
        sampling_seed; a single stop string stands for a list of one."""
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None}
        if "sampling_seed" in data:
            if "seed" in data:
                raise ValueError("give seed or sampling_seed, not both")
            data["seed"] = data.pop("sampling_seed")
        if isinstance(data.get("stop"), str):
            data["stop"] = [data["stop"]]
        return data

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens "
                             f"({self.max_new_tokens})")
        return self

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SamplingParams | None,
                  defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Builds and validates; raises ValueError naming the offending field. Fields the
        request leaves out (or sets to null) take the model's defaults, then ours."""
        if isinstance(d, SamplingParams):
            d = d.model_dump(exclude_unset=True)
        if d is not None and not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        merged = dict(defaults or {})
        merged.update({k: v for k, v in (d or {}).items() if v is not None})
        return validate(cls, merged, "sampling_params")

    @classmethod
    def usable_defaults(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The entries of a model's generation config that are valid sampling parameters."""
        out = {}
        for key, value in config.items():
            if key not in cls.model_fields:
                continue
            try:
                cls.model_validate({key: value})
                out[key] = value
            except ValidationError:
                logger.warning("ignoring the model's default %s=%r: not a valid sampling parameter", key, value)
        return out

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)
