"""Sessions under pressure: idle streaming sessions hold request rows and KV, which must never
block other requests or their own next turn; and a session turn whose built input is empty is
refused. A request that cannot run is aborted before the assertion, so a failure never hangs."""

from __future__ import annotations

import threading

import pytest

from baby_sgl import Engine
from baby_sgl.core.req import Req
from baby_sgl.core.sampling_params import SamplingParams
from baby_sgl.errors import ServerBusyError
from baby_sgl.managers import session_controller
from baby_sgl.managers.io_struct import OpenSessionReqInput, SessionParams
from helpers import GREEDY

WAIT_S = 10


def _submit(engine: Engine, ids: list[int], n: int, **session_params):
    done, got = threading.Event(), []
    req = engine.submit(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": n},
                        on_output=lambda c: (got.append(c), c["finished"] and done.set()),
                        session_params=session_params or None)[0]
    return req, done, got


def _finished_or_abort(engine: Engine, req, done: threading.Event) -> bool:
    ok = done.wait(WAIT_S)
    if not ok:  # unblock the scheduler so the engine can shut down
        engine.abort_request(req.rid)
        done.wait(WAIT_S)
    return ok


def test_held_row_does_not_take_the_request_slot_its_next_turn_needs(tiny_llama):
    """A resumed streaming turn reuses its session's row and needs no new request slot."""
    with Engine(tiny_llama, dtype="float32", page_size=4, max_running_requests=1, debug_memory_check=True) as engine:
        sid = engine.open_session(100, streaming=True)
        engine.generate(input_ids=list(range(10, 31)), sampling_params={**GREEDY, "max_new_tokens": 4},
                        session_params={"id": sid})
        req, done, _ = _submit(engine, [40, 41, 42], 3, id=sid)
        ok = _finished_or_abort(engine, req, done)
        engine.close_session(sid)
        assert ok, "the session's second turn never ran: its own held row occupies the only request slot"


def test_idle_streaming_sessions_do_not_lock_out_other_requests(tiny_llama):
    """Idle streaming sessions keep a request slot each; with max_running_requests of them, a
    new request takes the row of the session idle the longest."""
    with Engine(tiny_llama, dtype="float32", page_size=4, max_running_requests=2, debug_memory_check=True) as engine:
        sids = [engine.open_session(100, streaming=True) for _ in range(2)]
        for sid in sids:
            engine.generate(input_ids=[5] * 10, sampling_params={**GREEDY, "max_new_tokens": 3},
                            session_params={"id": sid})
        req, done, _ = _submit(engine, [7] * 5, 3)
        ok = _finished_or_abort(engine, req, done)
        for sid in sids:
            engine.close_session(sid)
        assert ok, "a plain request never ran while two idle streaming sessions were open"


def test_idle_session_kv_does_not_deadlock_admission(tiny_llama):
    """A session's held KV is locked in the tree and its partial page is its own. A request that
    passes the prompt-length check (<= 123 tokens here) but does not fit beside it makes the
    idle session give its row back; the session's next turn then recomputes from the tree."""
    with Engine(tiny_llama, dtype="float32", page_size=4, max_total_tokens=128, debug_memory_check=True) as engine:
        sid = engine.open_session(100, streaming=True)
        engine.generate(input_ids=list(range(10, 70)), sampling_params={**GREEDY, "max_new_tokens": 4},
                        session_params={"id": sid})
        assert 100 <= engine.max_input_len
        plain, plain_done, plain_out = _submit(engine, list(range(100, 200)), 2)
        turn, turn_done, _ = _submit(engine, [40, 41], 2, id=sid)
        turn_ok = _finished_or_abort(engine, turn, turn_done)
        plain_ok = _finished_or_abort(engine, plain, plain_done)
        engine.close_session(sid)
        engine.check_memory()
        assert turn_ok and plain_ok, (f"session turn finished: {turn_ok}, plain 100-token request finished: "
                                      f"{plain_ok} ({plain_out[-1]['meta_info']['finish_reason'] if plain_out else None})")


def test_session_offsets_that_cut_everything_or_overshoot_are_refused(tiny_llama):
    """A negative offset (it would cut the context from the end, or to nothing) or one past the
    end of the context is refused with an error naming the field; other requests are unaffected."""
    with Engine(tiny_llama, dtype="float32", page_size=4, debug_memory_check=True) as engine:
        sid = engine.open_session(100)
        first = engine.generate(input_ids=[10, 11, 12, 13, 14], sampling_params={**GREEDY, "max_new_tokens": 3},
                                session_params={"id": sid})
        other, other_done, other_out = _submit(engine, list(range(20, 60)), 3)
        for offset, message in ((-8, "session_params.offset: Input should be greater than or equal to 0"), (9, "past the end")):
            with pytest.raises(ValueError, match=message):
                engine.generate(input_ids=[engine.tokenizer.bos_token_id], sampling_params={"max_new_tokens": 3},
                                session_params={"id": sid, "rid": first["meta_info"]["id"], "offset": offset})
        assert other_done.wait(WAIT_S) and other_out[-1]["meta_info"]["completion_tokens"] == 3
        engine.close_session(sid)
        engine.check_memory()


def test_the_tokens_sessions_keep_are_bounded(tiny_llama, monkeypatch):
    """Every finished turn of a normal session is kept (any may be continued): 1024 sessions of
    1024 whole-context turns each would keep 32 GB. Past MAX_SESSION_TOKENS a new turn is refused
    as the server being busy; closing sessions (or replacing turns) gives the room back, and the
    memory check counts what the sessions keep."""
    monkeypatch.setattr(session_controller, "MAX_SESSION_TOKENS", 100)
    with Engine(tiny_llama, dtype="float32") as engine:
        sid = engine.open_session(100)
        params = {**GREEDY, "max_new_tokens": 2}
        first = engine.generate(input_ids=list(range(5, 45)), sampling_params=params, session_params={"id": sid})
        engine.generate(input_ids=list(range(5, 45)), sampling_params=params, session_params={"id": sid})
        engine.check_memory()  # two roots of 40 + 2 tokens kept
        with pytest.raises(ServerBusyError, match="sessions keep 84 tokens of turns"):
            engine.generate(input_ids=list(range(5, 45)), sampling_params=params, session_params={"id": sid})
        # A continuation keeps only its own tokens: one more token and its output fit.
        engine.generate(input_ids=[7], sampling_params=params,
                        session_params={"id": sid, "rid": first["meta_info"]["id"]})
        engine.check_memory()
        engine.close_session(sid)
        other = engine.open_session(100)
        engine.generate(input_ids=list(range(5, 45)), sampling_params=params, session_params={"id": other})
        engine.check_memory()


def test_running_turns_reserve_what_they_may_keep(monkeypatch):
    """Turns sent together are each checked against the others' reservations (the most each may
    keep: its own input and max_new_tokens), released when they end; a streaming session's turn
    keeps its whole context, and counts it."""
    monkeypatch.setattr(session_controller, "MAX_SESSION_TOKENS", 100)
    sessions = session_controller.SessionController(None, max_input_len=1000, bos_token_id=None, max_sessions=8)
    sid = sessions.open(OpenSessionReqInput(capacity_of_str_len=100))
    first = Req("a", list(range(40)), SamplingParams(max_new_tokens=20))
    sessions.attach(first, SessionParams(id=sid))
    assert sessions.stored_tokens == 60
    with pytest.raises(ServerBusyError, match="sessions keep 60 tokens"):
        sessions.attach(Req("b", list(range(40)), SamplingParams(max_new_tokens=2)), SessionParams(id=sid))
    first.output_ids = [1, 2]
    sessions.turn_ended(first)  # the reservation of 60 gives way to the 42 tokens kept
    assert sessions.stored_tokens == 42
    sessions.check()
    stream = sessions.open(OpenSessionReqInput(capacity_of_str_len=100, streaming=True))
    for i, new in enumerate(([5] * 10, [6] * 10)):
        turn = Req(f"s{i}", new, SamplingParams(max_new_tokens=1))
        sessions.attach(turn, SessionParams(id=stream))
        turn.output_ids = [7]
        sessions.turn_ended(turn)
        sessions.check()
    assert sessions.stored_tokens == 42 + 22  # the second streaming turn: both inputs and outputs
