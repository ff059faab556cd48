"""`GET /dashboard`: RadixAttention at work, live in the browser — the radix tree, the KV pool by
owner, the running batch and waiting queue, recent batches and evictions, and throughput, cache
hit rate and time to first token over the last minutes. One static page (static/dashboard.html,
no build step, no library) that polls the JSON routes below once a second; scripts use them too:

- `GET /dashboard/state?max_nodes=200`: everything the page shows (Engine.scheduler_view, plus
  the model and the pool's page size);
- `GET /dashboard/tree?max_nodes=200`: the radix tree alone (what `baby-sgl tree` prints).

The scheduler publishes a snapshot of itself at a bounded rate (managers/snapshots.py) that all
readers share, so however many poll, it never races the scheduler nor costs it more; the view is
built from the snapshot outside the scheduler thread, a large tree cut to its hottest paths with a
count of what is left out. `--disable-dashboard` leaves these routes out; with `--api-key` they
need the key like every route (a browser is asked for it: any user name, the key as password).
Request ids are shown whole only to holders of the key: without one they are shortened, since a
full id is all /abort_request needs to end someone else's request.
"""

from __future__ import annotations

import asyncio
import functools
from importlib import resources

from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse

from baby_sgl.engine import Engine

MAX_NODES = 2000  # the most nodes one read returns


@functools.cache
def page() -> str:
    return resources.files("baby_sgl.entrypoints").joinpath("static/dashboard.html").read_text(encoding="utf-8")


def add_dashboard_routes(app: FastAPI, full_rids: bool) -> None:
    """full_rids: every reader holds the API key (the server has one and lets no one else in)."""
    engine: Engine = app.state.engine

    async def view(max_nodes: int) -> dict:
        snapshot = await engine.scheduler_snapshot_async()
        return await asyncio.to_thread(engine.describe_snapshot, snapshot, max_nodes, full_rids)

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page(), headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/state")
    async def state(max_nodes: int = Query(200, ge=1, le=MAX_NODES)) -> dict:
        return {"model": app.state.model_name, **await view(max_nodes)}

    @app.get("/dashboard/tree")
    async def tree(max_nodes: int = Query(200, ge=1, le=MAX_NODES)) -> dict:
        state = await view(max_nodes)
        return {"model": app.state.model_name, "tree": state["tree"], "pool": state["pool"]}
