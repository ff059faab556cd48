"""What the dashboard and `baby-sgl tree` see of the scheduler: the radix tree, the KV pool by
owner, the running batch and waiting queue, and recent activity. Called through Scheduler.call,
so it reads the scheduler's state in its own thread between steps and never races it. Token ids
only: the server decodes the texts outside the scheduler thread."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from baby_sgl.managers.memory_checker import pool_counts

if TYPE_CHECKING:
    from baby_sgl.core.req import Req
    from baby_sgl.managers.scheduler import Scheduler
    from baby_sgl.mem_cache.radix_cache import TreeNode

HEAD_TOKENS = 24  # tokens of each node sent for its text
# Deeper nodes are counted, not shown: JSON encoders recurse once per level (the server's refused
# a chain of 200 nodes, 400 levels of nesting: "Maximum serialization depth exceeded").
MAX_DEPTH = 100
MAX_LISTED_REQS = 64  # running / waiting requests listed (all are counted)


def _subtree(node: TreeNode) -> tuple[int, int]:
    """(nodes, tokens) below and including node."""
    nodes, tokens, stack = 0, 0, [node]
    while stack:
        n = stack.pop()
        nodes, tokens = nodes + 1, tokens + len(n.key)
        stack.extend(n.children.values())
    return nodes, tokens


def _kept(root: TreeNode, max_nodes: int) -> set[int]:
    """Ids of the nodes shown: when the tree is large, the most recently used first, each with its
    path to the root (the hottest paths), up to max_nodes, and never deeper than MAX_DEPTH."""
    nodes, stack = [], [(c, 1) for c in root.children.values()]
    while stack:
        n, depth = stack.pop()
        if depth <= MAX_DEPTH:
            nodes.append(n)
            stack.extend((c, depth + 1) for c in n.children.values())
    if len(nodes) <= max_nodes:
        return {n.id for n in nodes}
    keep: set[int] = set()
    for n in sorted(nodes, key=lambda n: (-n.last_access_time, n.id)):
        if len(keep) >= max_nodes:
            break
        path, p = [], n
        while p is not root and p.id not in keep:
            path.append(p.id)
            p = p.up()
        if len(keep) + len(path) <= max_nodes:
            keep.update(path)
    return keep


def tree_view(root: TreeNode, max_nodes: int, hit_path: set[int], now: float) -> dict[str, Any]:
    """Nested node views, built without recursion; what is left out is counted in each parent's
    `more` (nodes and tokens)."""
    keep = _kept(root, max_nodes)

    def node_view(n: TreeNode) -> dict[str, Any]:
        view = {"id": n.id, "tokens": len(n.key), "head": n.key[:HEAD_TOKENS], "lock_ref": n.lock_ref,
                "state": "root" if n is root else ("protected" if n.lock_ref > 0 else "evictable"),
                "hit": n.id in hit_path, "idle_s": round(now - n.last_access_time, 1), "children": []}
        hidden = [_subtree(c) for c in n.children.values() if c.id not in keep]
        if hidden:
            view["more"] = {"nodes": sum(h[0] for h in hidden), "tokens": sum(h[1] for h in hidden)}
        return view

    top = node_view(root)
    stack = [(root, top)]
    while stack:
        node, view = stack.pop()
        for child in sorted((c for c in node.children.values() if c.id in keep), key=lambda c: c.id):
            child_view = node_view(child)
            view["children"].append(child_view)
            stack.append((child, child_view))
    total_nodes, total_tokens = _subtree(root)
    return {"root": top, "nodes": total_nodes - 1, "tokens": total_tokens, "shown": len(keep)}


def _req_view(req: Req) -> dict[str, Any]:
    return {"rid": req.rid, "prompt_tokens": len(req.origin_input_ids), "output_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens}


def scheduler_view(sched: Scheduler, max_nodes: int = 200) -> dict[str, Any]:
    root = getattr(sched.tree_cache, "root", None)  # None: the radix cache is disabled
    running = sched.running + ([sched.chunked_req] if sched.chunked_req else [])
    return {
        "tree": tree_view(root, max_nodes, sched.activity.hit_path(), time.monotonic()) if root else None,
        "pool": pool_counts(sched),
        "page_size": sched.allocator.page_size,
        "running": {"count": len(running), "reqs": [_req_view(r) for r in running[:MAX_LISTED_REQS]]},
        "waiting": {"count": len(sched.waiting), "reqs": [_req_view(r) for r in sched.waiting[:MAX_LISTED_REQS]]},
        "activity": sched.activity.snapshot(),
    }
