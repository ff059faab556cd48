"""What the dashboard and `baby-sgl tree` see of the scheduler: the radix tree, the KV pool by
owner, the running batch and waiting queue, and recent activity.

Two halves: `take_snapshot` copies what is needed as plain data in the scheduler thread (the
scheduler publishes one at a bounded rate, see snapshots.py), and `scheduler_view` builds the
view from a snapshot in the reader's thread: cutting a large tree to its hottest paths, nesting
and counting cost the scheduler nothing, whatever max_nodes each reader asks for. Token ids only:
the server decodes the texts outside the scheduler thread."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from baby_sgl.core.req import Req
    from baby_sgl.managers.activity import Activity
    from baby_sgl.managers.scheduler.memory import KVMemory
    from baby_sgl.managers.scheduler.queues import RequestQueues

HEAD_TOKENS = 24  # tokens of each node sent for its text
# Deeper nodes are counted, not shown: JSON encoders recurse once per level (the server's refused
# a chain of 200 nodes, 400 levels of nesting: "Maximum serialization depth exceeded").
MAX_DEPTH = 100
MAX_LISTED_REQS = 64  # running / waiting requests listed (all are counted)
SHORT_RID_CHARS = 8  # a request id shown to a reader without the API key: at most this much of it


class NodeInfo(NamedTuple):
    id: int
    parent: int | None  # None: the root
    tokens: int
    head: list[int]
    lock_ref: int
    last_access_time: float


@dataclass(frozen=True)
class SchedulerSnapshot:
    nodes: list[NodeInfo] | None  # root first; None: the radix cache is disabled
    hit_path: frozenset[int]
    pool: dict[str, int]
    page_size: int
    running: dict[str, Any]
    waiting: dict[str, Any]
    activity: dict[str, Any]
    taken: float  # time.monotonic() when it was taken: a view of it is as of then, whenever built

    def age(self) -> dict[str, float]:
        """What a view of it adds for its reader: how long ago it was taken (an idle scheduler's
        stands until something changes, so its ages and times are as of then)."""
        return {"snapshot_age_s": round(time.monotonic() - self.taken, 3)}


def take_snapshot(memory: KVMemory, queues: RequestQueues, held: list[Req], activity: Activity) -> SchedulerSnapshot:
    """In the scheduler thread: one pass over the tree, copies of the rest (held: the rows
    streaming sessions keep between turns)."""
    root = getattr(memory.tree_cache, "root", None)
    nodes = []
    stack = [root] if root is not None else []
    while stack:
        n = stack.pop()
        nodes.append(NodeInfo(n.id, None if n is root else n.up().id, len(n.key), n.key[:HEAD_TOKENS], n.lock_ref,
                              n.last_access_time))
        stack.extend(n.children.values())
    running, waiting = queues.active(), queues.waiting
    return SchedulerSnapshot(
        nodes=nodes if root is not None else None, hit_path=frozenset(activity.hit_path()),
        pool=memory.pool_counts(running, held), page_size=memory.allocator.page_size,
        running={"count": len(running), "reqs": [_req_view(r) for r in running[:MAX_LISTED_REQS]]},
        waiting={"count": len(waiting), "reqs": [_req_view(r) for r in waiting[:MAX_LISTED_REQS]]},
        activity=activity.snapshot(), taken=time.monotonic())


def _req_view(req: Req) -> dict[str, Any]:
    return {"rid": req.rid, "prompt_tokens": len(req.origin_input_ids), "output_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens}


def short_rid(rid: str) -> str:
    """Enough of a request id to tell requests apart, never all of it: a full id is all that
    /abort_request needs to end someone else's request."""
    return rid[: min(SHORT_RID_CHARS, len(rid) // 2)] + "…"


class _Tree:
    def __init__(self, nodes: list[NodeInfo]) -> None:
        self.root = nodes[0]
        self.children: dict[int, list[NodeInfo]] = defaultdict(list)
        for n in nodes[1:]:
            assert n.parent is not None
            self.children[n.parent].append(n)

    def subtree(self, node: NodeInfo) -> tuple[int, int]:
        """(nodes, tokens) below and including node."""
        nodes, tokens, stack = 0, 0, [node]
        while stack:
            n = stack.pop()
            nodes, tokens = nodes + 1, tokens + n.tokens
            stack.extend(self.children[n.id])
        return nodes, tokens

    def kept(self, max_nodes: int) -> set[int]:
        """Ids of the nodes shown: when the tree is large, the most recently used first, each with
        its path to the root (the hottest paths), up to max_nodes, and never deeper than MAX_DEPTH."""
        nodes, stack = [], [(c, 1) for c in self.children[self.root.id]]
        parent: dict[int, NodeInfo] = {}
        while stack:
            n, depth = stack.pop()
            if depth <= MAX_DEPTH:
                nodes.append(n)
                for c in self.children[n.id]:
                    parent[c.id] = n
                    stack.append((c, depth + 1))
        if len(nodes) <= max_nodes:
            return {n.id for n in nodes}
        keep: set[int] = set()
        for n in sorted(nodes, key=lambda n: (-n.last_access_time, n.id)):
            if len(keep) >= max_nodes:
                break
            path, p = [], n
            while p.id not in keep:
                path.append(p.id)
                if p.id not in parent:  # a child of the root
                    break
                p = parent[p.id]
            if len(keep) + len(path) <= max_nodes:
                keep.update(path)
        return keep


def tree_view(nodes: list[NodeInfo], max_nodes: int, hit_path: frozenset[int], now: float) -> dict[str, Any]:
    """Nested node views, built without recursion; what is left out is counted in each parent's
    `more` (nodes and tokens)."""
    tree = _Tree(nodes)
    keep = tree.kept(max_nodes)

    def node_view(n: NodeInfo) -> dict[str, Any]:
        view = {"id": n.id, "tokens": n.tokens, "head": n.head, "lock_ref": n.lock_ref,
                "state": "root" if n is tree.root else ("protected" if n.lock_ref > 0 else "evictable"),
                "hit": n.id in hit_path, "idle_s": round(now - n.last_access_time, 1), "children": []}
        hidden = [tree.subtree(c) for c in tree.children[n.id] if c.id not in keep]
        if hidden:
            view["more"] = {"nodes": sum(h[0] for h in hidden), "tokens": sum(h[1] for h in hidden)}
        return view

    top = node_view(tree.root)
    stack = [(tree.root, top)]
    while stack:
        node, view = stack.pop()
        for child in sorted((c for c in tree.children[node.id] if c.id in keep), key=lambda c: c.id):
            child_view = node_view(child)
            view["children"].append(child_view)
            stack.append((child, child_view))
    total_nodes, total_tokens = tree.subtree(tree.root)
    return {"root": top, "nodes": total_nodes - 1, "tokens": total_tokens, "shown": len(keep)}


def scheduler_view(snap: SchedulerSnapshot, max_nodes: int = 200, full_rids: bool = True) -> dict[str, Any]:
    """The view of a snapshot (any thread), a function of its arguments alone (node ages are as of
    the snapshot, like its activity), so readers can share it; request ids shortened unless full_rids."""
    def reqs(queue: dict[str, Any]) -> dict[str, Any]:
        return {"count": queue["count"], "reqs": [r | {"rid": shown(r["rid"])} for r in queue["reqs"]]}

    def shown(rid: str) -> str:
        return rid if full_rids else short_rid(rid)

    last_hit = snap.activity["last_hit"]
    activity = snap.activity | {"last_hit": last_hit and last_hit | {"rid": shown(last_hit["rid"])},
                                "evictions": [dict(e) for e in snap.activity["evictions"]]}  # readers fill in texts
    return {
        "tree": tree_view(snap.nodes, max_nodes, snap.hit_path, snap.taken) if snap.nodes else None,
        "pool": dict(snap.pool), "page_size": snap.page_size,
        "running": reqs(snap.running), "waiting": reqs(snap.waiting), "activity": activity,
    }
