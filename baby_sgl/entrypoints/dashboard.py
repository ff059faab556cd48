"""`GET /dashboard`: RadixAttention at work, live in the browser — the radix tree, the KV pool by
owner, the running batch and waiting queue, recent batches and evictions, and throughput, cache
hit rate and time to first token over the last minutes. One static page (static/dashboard.html,
no build step, no library) that polls the JSON routes below once a second; scripts use them too:

- `GET /dashboard/state?max_nodes=200`: everything the page shows (Engine.scheduler_view, plus
  the model and the pool's page size);
- `GET /dashboard/tree?max_nodes=200`: the radix tree alone (what `baby-sgl tree` prints).

Each read runs in the scheduler thread between two steps (Scheduler.call), so it never races the
scheduler; a large tree is cut to its hottest paths, with a count of what is left out.
`--disable-dashboard` leaves these routes out; with `--api-key` they need the key like every
route (a browser is asked for it: any user name, the key as password).
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


def add_dashboard_routes(app: FastAPI) -> None:
    engine: Engine = app.state.engine

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page(), headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/state")
    async def state(max_nodes: int = Query(200, ge=1, le=MAX_NODES)) -> dict:
        view = await asyncio.to_thread(engine.scheduler_view, max_nodes)
        return {"model": app.state.model_name, **view}

    @app.get("/dashboard/tree")
    async def tree(max_nodes: int = Query(200, ge=1, le=MAX_NODES)) -> dict:
        view = await asyncio.to_thread(engine.scheduler_view, max_nodes)
        return {"model": app.state.model_name, "tree": view["tree"], "pool": view["pool"]}
