"""Sessions over HTTP: /open_session, /generate with session_params (streamed too), /close_session."""

from __future__ import annotations

import json

import httpx

GREEDY = {"temperature": 0, "ignore_eos": True}


def _turn(server: str, sid: str, ids: list[int], n: int, **extra) -> httpx.Response:
    return httpx.post(server + "/generate", timeout=60, json={
        "input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": n},
        "session_params": {"id": sid, **extra}})


def test_streaming_session_over_http(server, idle_counts):
    sid = httpx.post(server + "/open_session", json={"capacity_of_str_len": 1000, "streaming": True}).json()
    assert isinstance(sid, str) and sid
    turns = [[40 + i for i in range(23)], [90, 91, 92, 93, 94], [7] * 11]
    context: list[int] = []
    for i, turn in enumerate(turns):
        if i == 1:  # one turn streamed: SSE events with cumulative ids
            with httpx.stream("POST", server + "/generate", timeout=60, json={
                    "input_ids": turn, "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": 6},
                    "session_params": {"id": sid}}) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            out = events[-1]
        else:
            r = _turn(server, sid, turn, 6)
            assert r.status_code == 200, r.text
            out = r.json()
        if context:
            assert out["meta_info"]["cached_tokens"] >= len(context) - 1
        context += turn
        # The same conversation generated from scratch, outside any session.
        scratch = httpx.post(server + "/generate", timeout=60, json={
            "input_ids": context, "sampling_params": {**GREEDY, "max_new_tokens": 6}}).json()
        assert out["output_ids"] == scratch["output_ids"], f"turn {i}"
        context += out["output_ids"]
        held = idle_counts()  # page_size 1: the tree holds (locked) all the session's KV
        assert held["session_held"] == 0 and held["protected"] == len(context) - 1

    # Errors name the problem; the session and the server carry on.
    r = _turn(server, sid, [5], 2, replace=True)
    assert r.status_code == 400 and "append-only" in r.json()["error"]["message"]
    r = _turn(server, "nope", [5], 2)
    assert r.status_code == 400 and "is not open" in r.json()["error"]["message"]
    r = httpx.post(server + "/open_session", json={"capacity_of_str_len": 10, "session_id": sid})
    assert r.status_code == 400 and "already open" in r.json()["error"]["message"]

    assert httpx.post(server + "/close_session", json={"session_id": sid}).status_code == 200
    counts = idle_counts()
    assert counts["session_held"] == 0 and counts["protected"] == 0
    r = httpx.post(server + "/close_session", json={"session_id": sid})
    assert r.status_code == 400 and "is not open" in r.json()["error"]["message"]


def test_normal_session_branches_over_http(server):
    sid = httpx.post(server + "/open_session", json={"capacity_of_str_len": 1000, "session_id": "chat-1"}).json()
    assert sid == "chat-1"
    first = _turn(server, sid, [30 + i for i in range(17)], 5).json()
    rid = first["meta_info"]["id"]
    a = _turn(server, sid, [60, 61, 62], 5, rid=rid).json()
    b = _turn(server, sid, [70, 71], 5, rid=rid, offset=9).json()
    ctx = [30 + i for i in range(17)] + first["output_ids"]
    for out, ids in ((a, ctx + [60, 61, 62]), (b, ctx[:9] + [70, 71])):
        scratch = httpx.post(server + "/generate", json={
            "input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": 5}}).json()
        assert out["output_ids"] == scratch["output_ids"]
    assert httpx.post(server + "/close_session", json={"session_id": sid}).status_code == 200
