"""GET /dashboard and its JSON routes on a real server: after requests that share a prefix the tree
shows the prefix's node with its text, the latest hit's path and the pool identity; evictions and
large trees; `baby-sgl tree`; --disable-dashboard and --api-key; and the page rendered by a real
headless Chromium, checked from its DOM."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from baby_sgl import Engine
from baby_sgl.entrypoints.tree_cli import main as tree_main
from baby_sgl.server_args import ServerArgs
from entrypoints.conftest import serve_in_thread, wait_idle

SHARED = "The quick brown fox jumps over the lazy dog. " * 3
OWNERS = ("free", "evictable", "protected", "request_owned", "session_held")


@pytest.fixture(scope="module")
def dash_server(tiny_llama):
    engine = Engine(tiny_llama, dtype="float32", max_total_tokens=1024)
    with serve_in_thread(engine) as base:
        yield base, engine


@pytest.fixture(scope="module")
def dash(dash_server):
    return dash_server[0]


def _send_shared(base: str, n: int = 3) -> None:
    for i in range(n):
        body = {"text": SHARED + f"question {i}?", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        assert httpx.post(base + "/generate", json=body, timeout=60).status_code == 200


def _nodes(node: dict) -> list[dict]:
    out = [node]
    for child in node["children"]:
        out += _nodes(child)
    return out


def test_state_after_shared_prefix_requests(dash):
    httpx.post(dash + "/flush_cache").raise_for_status()
    _send_shared(dash)
    wait_idle(dash)
    state = httpx.get(dash + "/dashboard/state").json()
    pool = state["pool"]
    assert sum(pool[k] for k in OWNERS) == pool["total"] == 1024
    nodes = _nodes(state["tree"]["root"])[1:]
    shared = [n for n in nodes if n["text"].startswith("The quick brown fox")]
    assert len(shared) == 1 and len(shared[0]["children"]) == 3  # one prefix node, a branch per question
    assert shared[0]["state"] == "evictable" and shared[0]["lock_ref"] == 0
    assert sum(n["tokens"] for n in nodes) == state["tree"]["tokens"] == pool["evictable"]
    hit = state["activity"]["last_hit"]
    assert hit["cached_tokens"] >= len(SHARED) - 1 and shared[0]["hit"]  # bytes are tokens here
    assert [n for n in shared[0]["children"] if n["hit"]] == []  # the hit ended at the shared prefix
    modes = {b["mode"] for b in state["activity"]["batches"]}
    assert {"EXTEND", "DECODE"} <= modes
    history = state["activity"]["history"]
    assert sum(b["generated"] for b in history) >= 12 and sum(b["cached"] for b in history) >= len(SHARED) - 1


def test_large_trees_show_the_hottest_paths(dash):
    httpx.post(dash + "/flush_cache").raise_for_status()
    for i in range(12):
        body = {"text": "abcdefghijkl"[i] + f" distinct prompt number {i}", "sampling_params": {"max_new_tokens": 1}}
        httpx.post(dash + "/generate", json=body, timeout=60).raise_for_status()
    tree = httpx.get(dash + "/dashboard/tree", params={"max_nodes": 5}).json()["tree"]
    root = tree["root"]
    assert tree["shown"] == 5 and tree["nodes"] >= 12
    shown = len(_nodes(root)) - 1
    assert shown == 5 and shown + root["more"]["nodes"] == tree["nodes"]
    assert [c["text"][0] for c in root["children"]] == list("hijkl")  # the most recently used
    assert httpx.get(dash + "/dashboard/tree", params={"max_nodes": 0}).status_code == 400


def test_readers_of_one_snapshot_share_its_view(dash_server, monkeypatch):
    """Every GET /dashboard/state built its own view of the snapshot all readers share (a sort and
    subtree walks over the whole tree, holding the GIL: 1.3 s at 200k nodes, times the readers).
    Readers of one snapshot and max_nodes now share one build, even those that come while it runs;
    another max_nodes, or a new snapshot, is built anew."""
    base, engine = dash_server
    _send_shared(base)
    wait_idle(base)
    builds = []
    describe = engine.describe_snapshot

    def slow_describe(snapshot, max_nodes, full_rids):
        builds.append(max_nodes)
        time.sleep(0.5)  # the other readers come while it builds
        return describe(snapshot, max_nodes, full_rids)

    monkeypatch.setattr(engine, "describe_snapshot", slow_describe)

    def read(route: str, max_nodes: int) -> dict:
        return httpx.get(base + route, params={"max_nodes": max_nodes}, timeout=60).json()

    with ThreadPoolExecutor(4) as pool:
        states = list(pool.map(lambda _: read("/dashboard/state", 7), range(4)))
    shared = [{k: v for k, v in s.items() if k != "snapshot_age_s"} for s in states]  # the age is each reader's
    assert builds == [7] and all(s == shared[0] for s in shared) and states[0]["tree"]["nodes"] > 0
    assert read("/dashboard/tree", 7)["tree"] == states[0]["tree"] and builds == [7]  # the same view
    assert read("/dashboard/state", 3)["tree"]["shown"] <= 3 and builds == [7, 3]
    _send_shared(base, 1)  # the scheduler moves on: the next reader gets a new snapshot
    wait_idle(base)
    read("/dashboard/state", 7)
    assert builds == [7, 3, 7]


def test_an_idle_servers_view_ages_with_the_clock(dash):
    """An idle scheduler's snapshot stands until something changes: its node ages and activity
    clock were frozen, so the page showed a node idle 0.1 s and the last minute's throughput
    however long ago they were. The answer now says how old its snapshot is."""
    _send_shared(dash, 1)
    wait_idle(dash)
    first = httpx.get(dash + "/dashboard/state").json()
    time.sleep(1.5)
    second = httpx.get(dash + "/dashboard/state").json()
    assert second["activity"]["now"] == first["activity"]["now"]  # the same snapshot: nothing ran
    assert second["snapshot_age_s"] - first["snapshot_age_s"] >= 1.4
    tree = httpx.get(dash + "/dashboard/tree").json()
    assert tree["snapshot_age_s"] >= second["snapshot_age_s"]


def test_evictions_are_recorded(dash):
    httpx.post(dash + "/flush_cache").raise_for_status()
    before = httpx.get(dash + "/dashboard/state").json()["activity"]["evicted_tokens"]
    for i in range(8):  # 8 x ~200 tokens through a 1024-slot pool: older prompts are evicted
        body = {"text": f"{i} " + "lorem ipsum dolor sit amet " * 7, "sampling_params": {"max_new_tokens": 2}}
        httpx.post(dash + "/generate", json=body, timeout=60).raise_for_status()
    activity = httpx.get(dash + "/dashboard/state").json()["activity"]
    assert activity["evicted_tokens"] > before
    last = activity["evictions"][-1]
    assert last["tokens"] > 0 and any("lorem ipsum" in t for t in last["texts"])


def test_tree_command_prints_the_tree(dash, capsys):
    httpx.post(dash + "/flush_cache").raise_for_status()
    _send_shared(dash)
    assert tree_main(["--base-url", dash]) == 0
    out = capsys.readouterr().out
    assert "KV pool: free" in out and "(total 1024)" in out
    line = next(line for line in out.splitlines() if "The quick brown fox" in line)
    assert "evictable" in line and "<- latest hit" in line
    assert all(f'"{i}?"' in out for i in range(3))  # a branch per question, below the shared prefix
    assert tree_main(["--base-url", "http://127.0.0.1:9"]) == 1  # nothing listens: a clear failure


def test_disable_dashboard_and_api_key(tiny_llama):
    engine = Engine(tiny_llama, dtype="float32", max_total_tokens=512)
    with serve_in_thread(engine, ServerArgs(disable_dashboard=True)) as base:
        assert httpx.get(base + "/dashboard").status_code == 404
        assert httpx.get(base + "/dashboard/state").status_code == 404
    engine = Engine(tiny_llama, dtype="float32", max_total_tokens=512)
    with serve_in_thread(engine, ServerArgs(api_key="sekret")) as base:
        r = httpx.get(base + "/dashboard")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")  # a browser asks
        assert httpx.get(base + "/dashboard/state").status_code == 401
        assert httpx.get(base + "/dashboard/state", headers={"Authorization": "Bearer sekret"}).status_code == 200
        basic = "Basic " + base64.b64encode(b"anyone:sekret").decode()
        assert httpx.get(base + "/dashboard", headers={"Authorization": basic}).status_code == 200
        wrong = "Basic " + base64.b64encode(b"anyone:nope").decode()
        assert httpx.get(base + "/dashboard/state", headers={"Authorization": wrong}).status_code == 401
        # Basic is for the browser's pages only; the API keeps Bearer.
        assert httpx.get(base + "/server_info", headers={"Authorization": basic}).status_code == 401


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="Debian's chromium is not installed (scripts/setup.sh installs it)")
def test_page_renders_in_headless_chromium(dash, tmp_path):
    httpx.post(dash + "/flush_cache").raise_for_status()
    _send_shared(dash)
    wait_idle(dash)
    httpx.get(dash + "/dashboard/state").raise_for_status()  # the snapshot the page will read, idle since
    time.sleep(2)
    dom = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=4000",
                          f"--user-data-dir={tmp_path}", "--dump-dom", dash + "/dashboard"],
                         capture_output=True, text=True, timeout=120).stdout
    assert 'id="tree"' in dom and "The quick brown fox" in dom, dom[-2000:]
    # the shared prefix's node, evictable, on the latest hit's path, with its three branches below
    node = re.search(r'<li class="node evictable hit" data-node-id="\d+" data-tokens="(\d+)"[^>]*>'
                     r'.*?The quick brown fox', dom, re.S)
    assert node and int(node.group(1)) >= len(SHARED) - 1
    assert all(f'"{i}?"' in dom for i in range(3))  # the three branches below it
    idle = [float(x) for x in re.findall(r"· idle ([\d.]+)s", dom)]  # ages as of now, not of the snapshot
    assert len(idle) >= 4 and min(idle) >= 2.0, idle
    total = int(re.search(r'id="pool" data-total="(\d+)"', dom).group(1))
    counts = [int(c) for c in re.findall(r'class="seg" data-owner="\w+" data-count="(\d+)"', dom)]
    assert len(counts) == 5 and sum(counts) == total == 1024


def test_deep_trees_are_cut_at_a_depth(dash, capsys):
    """Each prompt extends the one before: a chain of 220 nodes. The view stops at MAX_DEPTH levels and
    counts the rest (JSON encoders recurse once per level), and the tree command prints it."""
    from baby_sgl.managers.scheduler.view import MAX_DEPTH

    httpx.post(dash + "/flush_cache").raise_for_status()
    text = ""
    for i in range(220):
        text += "abcdefghijklmnopqrstuvwxyz"[i % 26] * 2 + "."
        body = {"text": text, "sampling_params": {"max_new_tokens": 1}}
        httpx.post(dash + "/generate", json=body, timeout=60).raise_for_status()
    r = httpx.get(dash + "/dashboard/tree", params={"max_nodes": 2000})
    assert r.status_code == 200, r.text[:500]
    tree = r.json()["tree"]
    node, depth = tree["root"], 0
    while node["children"]:
        node, depth = node["children"][-1], depth + 1
    assert depth == MAX_DEPTH and tree["nodes"] > MAX_DEPTH and node["more"]["nodes"] > 0
    assert tree_main(["--base-url", dash, "--max-nodes", "2000"]) == 0
    assert "more nodes" in capsys.readouterr().out
