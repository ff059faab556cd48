"""Arbitrary JSON values against every input model: each is either accepted, and then within
its bounds, or refused with a ValueError (the HTTP layer's 400) that names a field. Nothing
else may come out, and the Engine applies the same rules as the server."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from baby_sgl.entrypoints.protocol import (ChatCompletionRequest, CompletionRequest, GenerateRequest,
                                           OpenSessionRequest)
from baby_sgl.managers.io_struct import SessionParams
from baby_sgl.core.sampling_params import SamplingParams
from baby_sgl.validation import INT32_MAX, MAX_N
from helpers import GREEDY

# JSON as Python's parser returns it: NaN and infinities, huge integers and lone surrogates included.
scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
           | st.sampled_from(["\ud800", "abc\udfff", ""]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)


def objects(model: type[BaseModel]):
    """Dicts mostly keyed by the model's own fields, with arbitrary values (and stray keys)."""
    keys = st.sampled_from(sorted(model.model_fields)) | st.text(max_size=6)
    return st.dictionaries(keys, json_values, max_size=6)


def _numbers_are_finite(obj) -> None:
    for value in obj.__dict__.values():
        if isinstance(value, float):
            assert math.isfinite(value)
        elif isinstance(value, BaseModel):
            _numbers_are_finite(value)


@settings(max_examples=400, deadline=None)
@given(data=objects(SamplingParams))
def test_sampling_params_accept_within_bounds_or_name_the_field(data):
    try:
        p = SamplingParams.from_dict(data)
    except ValueError as e:
        assert str(e).startswith(("sampling_params", "unknown field", "give seed")), str(e)
        return
    _numbers_are_finite(p)
    assert 0 <= p.min_new_tokens <= p.max_new_tokens <= INT32_MAX
    assert p.top_k == -1 or 1 <= p.top_k <= INT32_MAX
    assert 1 <= p.n <= MAX_N and 0 < p.top_p <= 1 and p.temperature >= 0
    assert all(isinstance(s, str) and s for s in p.stop)
    for s in p.stop:
        s.encode("utf-8")


@pytest.mark.parametrize("model", [GenerateRequest, CompletionRequest, ChatCompletionRequest, OpenSessionRequest,
                                   SessionParams])
def test_request_models_accept_or_refuse_cleanly(model):
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=objects(model))
    def check(data):
        try:
            parsed = model.model_validate(data)
        except ValidationError as e:
            assert e.errors() and e.errors()[0].get("loc") is not None
            return
        _numbers_are_finite(parsed)
        parsed.model_dump_json()  # everything accepted can be sent back as JSON

    check()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=objects(SamplingParams))
def test_engine_applies_the_same_rules(engine, data):
    """The Engine refuses exactly what the model refuses; what it accepts runs (kept short)."""
    data = {k: v for k, v in data.items() if k not in ("max_new_tokens", "min_new_tokens", "n")}
    try:
        SamplingParams.from_dict(data)
        valid = True
    except ValueError:
        valid = False
    params = {**data, "max_new_tokens": 2}
    if not valid:
        with pytest.raises(ValueError):
            engine.generate(input_ids=[5, 6, 7], sampling_params=params)
        return
    out = engine.generate(input_ids=[5, 6, 7], sampling_params=params)
    assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop")


def test_engine_and_http_models_agree_on_sessions(engine):
    with pytest.raises(ValueError, match="timeout"):
        engine.open_session(10, timeout=float("nan"))
    with pytest.raises(ValueError, match="session_params.id"):
        engine.generate(input_ids=[5, 6], sampling_params=GREEDY, session_params={"id": ["x"]})
    with pytest.raises(ValueError, match="prompt is not valid Unicode"):
        engine.generate("abc\ud800", sampling_params=GREEDY)
