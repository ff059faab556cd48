"""`GET /dashboard`: RadixAttention at work, live in the browser — the radix tree, the KV pool by
owner, the running batch and waiting queue, recent batches and evictions, and throughput, cache
hit rate and time to first token over the last minutes. One static page (static/dashboard.html,
no build step, no library) that polls the JSON routes below once a second; scripts use them too:

- `GET /dashboard/state?max_nodes=200`: everything the page shows (Engine.scheduler_view, plus
  the model and the pool's page size);
- `GET /dashboard/tree?max_nodes=200`: the radix tree alone (what `baby-sgl tree` prints).

Node ages (`idle_s`) and activity times are as of the snapshot, taken `snapshot_age_s` before the
answer: an idle server's snapshot stands until something changes, and the page adds its age, so
ages go on growing and the charts go on moving while nothing runs.

The scheduler publishes a snapshot of itself at a bounded rate (managers/snapshots.py) that all
readers share, so however many poll, it never races the scheduler nor costs it more; the view is
built from the snapshot outside the scheduler thread, a large tree cut to its hottest paths with a
count of what is left out, once per snapshot and max_nodes however many read it (`ViewCache`).
`--disable-dashboard` leaves these routes out; with `--api-key` they need the key like every route
(a browser is asked for it: any user name, the key as password). Request ids are shown whole
only to holders of the key: without one they are shortened, since a full id is all /abort_request
needs to end someone else's request.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections import OrderedDict
from collections.abc import Callable
from importlib import resources
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse

from baby_sgl.engine import Engine
from baby_sgl.managers.scheduler.view import SchedulerSnapshot

MAX_NODES = 2000  # the most nodes one read returns
CACHED_VIEWS = 8  # views kept: a few max_nodes of the latest snapshots (a view is at most MAX_NODES nodes)


@functools.cache
def page() -> str:
    return resources.files("baby_sgl.entrypoints").joinpath("static/dashboard.html").read_text(encoding="utf-8")


class ViewCache:
    """Views of the scheduler's snapshots by (snapshot, max_nodes), on the server's event loop.
    Building one walks and sorts the whole tree holding the GIL (0.24 s at 50k nodes, 1.3 s at 200k),
    and every reader gets the same snapshot, so each view is built once however many read it: a
    reader that comes while it is being built waits for that build (single-flight). A view is a
    function of its snapshot and max_nodes alone (see scheduler_view); the readers share it unchanged."""

    def __init__(self, build: Callable[[SchedulerSnapshot, int], dict[str, Any]]) -> None:
        self._build = build
        # (id(snapshot), max_nodes) -> (a weak reference to the snapshot, its build, done or under
        # way). Weak: the cache keeps no old tree alive, and an id reused by a new object is told apart.
        self._views: OrderedDict[tuple[int, int], tuple[weakref.ref, asyncio.Task]] = OrderedDict()

    async def get(self, snapshot: SchedulerSnapshot, max_nodes: int) -> dict[str, Any]:
        key = (id(snapshot), max_nodes)
        entry = self._views.get(key)
        if entry is None or entry[0]() is not snapshot:
            build = asyncio.ensure_future(asyncio.to_thread(self._build, snapshot, max_nodes))
            build.add_done_callback(functools.partial(self._forget_failed, key))
            entry = self._views[key] = (weakref.ref(snapshot), build)
            while len(self._views) > CACHED_VIEWS:
                self._views.popitem(last=False)
        self._views.move_to_end(key)
        return await asyncio.shield(entry[1])  # a reader that leaves does not cancel the others' build

    def _forget_failed(self, key: tuple[int, int], build: asyncio.Task) -> None:
        """A build that failed is not kept: the next reader tries again."""
        if (build.cancelled() or build.exception() is not None) and self._views.get(key, (None, None))[1] is build:
            del self._views[key]


def add_dashboard_routes(app: FastAPI, full_rids: bool) -> None:
    """full_rids: every reader holds the API key (the server has one and lets no one else in)."""
    engine: Engine = app.state.engine
    views = ViewCache(lambda snapshot, max_nodes: engine.describe_snapshot(snapshot, max_nodes, full_rids))

    async def view(max_nodes: int) -> dict:
        """The shared view, and how long ago its snapshot was taken (SchedulerSnapshot.age)."""
        snapshot = await engine.scheduler_snapshot_async()
        return await views.get(snapshot, max_nodes) | snapshot.age()

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page(), headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/state")
    async def state(max_nodes: int = Query(200, ge=1, le=MAX_NODES)) -> dict:
        return {"model": app.state.model_name, **await view(max_nodes)}

    @app.get("/dashboard/tree")
    async def tree(max_nodes: int = Query(200, ge=1, le=MAX_NODES)) -> dict:
        state = await view(max_nodes)
        return {"model": app.state.model_name, "tree": state["tree"], "pool": state["pool"],
                "snapshot_age_s": state["snapshot_age_s"]}
