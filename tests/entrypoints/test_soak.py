"""A soak of a real server process: 500 mixed requests (plain and streamed generations, chat,
aborts, disconnects, session turns, bad input) at concurrency 32. No valid request may be
lost, the memory check must pass afterwards and the RSS must come back near where it began."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from conftest import wait_idle
from test_server_process import start

TOTAL, CONCURRENCY = 500, 32
KINDS = ["generate", "stream", "chat", "abort", "disconnect", "session", "bad"]


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _params(rng: random.Random) -> dict:
    return {"max_new_tokens": rng.randrange(1, 24), "temperature": rng.choice([0, 0.8]), "ignore_eos": True}


async def one(client: httpx.AsyncClient, i: int) -> tuple[str, bool, int | None]:
    """Runs request i; returns (kind, whether it ended as it should, the output tokens the server
    reported for it: None for a disconnect, which never hears its total)."""
    rng = random.Random(i)
    kind = KINDS[i % len(KINDS)]
    prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 200))]
    if kind == "generate":
        r = await client.post("/generate", json={"input_ids": prompt, "sampling_params": _params(rng)})
        ok = r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "length"
        return kind, ok, r.json()["meta_info"]["completion_tokens"] if ok else 0
    if kind == "stream":
        body = {"input_ids": prompt, "sampling_params": _params(rng), "stream": True}
        async with client.stream("POST", "/generate", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        ok = r.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) >= 2
        return kind, ok, json.loads(lines[-2][6:])["meta_info"]["completion_tokens"] if ok else 0
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": "hi " * rng.randrange(1, 50)}], "max_tokens": 8,
                "stream": rng.random() < 0.5, "stream_options": {"include_usage": True}}
        if body["stream"]:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            ok = r.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) >= 3
            return kind, ok, json.loads(lines[-2][6:])["usage"]["completion_tokens"] if ok else 0
        del body["stream_options"]
        r = await client.post("/v1/chat/completions", json=body)
        ok = (r.status_code == 200 and 1 <= r.json()["usage"]["completion_tokens"] <= 8
              and r.json()["choices"][0]["finish_reason"] in ("stop", "length"))
        return kind, ok, r.json()["usage"]["completion_tokens"] if ok else 0
    if kind == "abort":
        rid = f"soak-{i}"
        task = asyncio.create_task(client.post("/generate", json={
            "input_ids": prompt, "rid": rid, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}))
        await asyncio.sleep(rng.random() * 0.2)
        aborted = await client.post("/abort_request", json={"rid": rid})
        r = await task
        if aborted.status_code != 200 or r.status_code != 200:
            return kind, False, 0
        meta = r.json()["meta_info"]
        # cut short by the abort, or (the abort came too late) finished whole: never anything else
        ok = ((meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 400)
              or (meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 400))
        return kind + ("ed" if meta["finish_reason"]["type"] == "abort" else ""), ok, meta["completion_tokens"]
    if kind == "disconnect":
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True}
        async with client.stream("POST", "/generate", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    first = json.loads(line[6:])
                    break  # leave after the first event: the server aborts the request (checked after the soak)
        return kind, r.status_code == 200 and first["meta_info"]["completion_tokens"] >= 1, None
    if kind == "session":
        sid = (await client.post("/open_session", json={"capacity_of_str_len": 1000,
                                                        "streaming": rng.random() < 0.5})).json()
        ok, last, tokens = True, None, 0
        for _ in range(2):
            r = await client.post("/generate", json={"input_ids": prompt[:20], "sampling_params": _params(rng),
                                                     "session_params": {"id": sid, "rid": last}})
            ok &= r.status_code == 200
            last = r.json()["meta_info"]["id"] if r.status_code == 200 else None
            tokens += r.json()["meta_info"]["completion_tokens"] if r.status_code == 200 else 0
        ok &= (await client.post("/close_session", json={"session_id": sid})).status_code == 200
        return kind, ok, tokens
    bad = rng.choice([{"text": "x", "sampling_params": {"top_k": 2**63}}, {"input_ids": [10**9]},
                      {"text": "x", "sampling_params": {"temperature": -1}}, {"text": ""}])
    r = await client.post("/generate", json=bad)
    return kind, r.status_code == 400, 0


async def soak(base: str, indices: range) -> list[tuple[str, bool, int | None]]:
    limit = asyncio.Semaphore(CONCURRENCY)

    async def bounded(client: httpx.AsyncClient, i: int) -> tuple[str, bool, int | None]:
        async with limit:
            return await one(client, i)

    async with httpx.AsyncClient(base_url=base, timeout=120,
                                 limits=httpx.Limits(max_connections=2 * CONCURRENCY)) as client:
        return await asyncio.gather(*(bounded(client, i) for i in indices))


def test_soak_500_mixed_requests(tiny_llama):
    proc, base = start(tiny_llama)
    try:
        asyncio.run(soak(base, range(-70, 0)))  # warm-up: every kind, ten times
        wait_idle(base, timeout=60)
        before, generated = rss_kb(proc.pid), httpx.get(base + "/server_info").json()["generation_tokens"]
        results = asyncio.run(soak(base, range(TOTAL)))
        counts = wait_idle(base, timeout=60)
        after, generated = rss_kb(proc.pid), httpx.get(base + "/server_info").json()["generation_tokens"] - generated
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    print(f"soak: {len(results)} requests, RSS {before} kB before, {after} kB after")
    failed = [(i, kind) for i, (kind, ok, _) in enumerate(results) if not ok]
    assert not failed, failed[:10]
    # A 400-token request takes seconds at this concurrency; its abort is sent within 0.2 s.
    kinds = [kind for kind, _, _ in results]
    assert kinds.count("aborted") >= kinds.count("abort"), "most aborts should cut their request short"
    # What the disconnected streams generated: everything the server made less what the others were told.
    disconnected = generated - sum(tokens for _, _, tokens in results if tokens is not None)
    assert 0 <= disconnected < kinds.count("disconnect") * 400 / 2, "a disconnect should abort its request"
    assert counts["free"] + counts["evictable"] + counts["protected"] + counts["session_held"] == counts["total"]
    assert after <= before * 1.10, f"RSS {before} kB -> {after} kB"
