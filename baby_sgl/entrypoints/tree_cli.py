"""`baby-sgl tree --base-url URL`: a running server's radix tree as text, from GET /dashboard/tree.

    (root) 412 tokens in 5 nodes; KV pool: free 3684, evictable 380, protected 32, ...
    └─ "<|im_start|>system\\nYou are a helpful" 32 tok, protected (lock 1)  <- latest hit
       ├─ "Question 0: what" 18 tok, evictable
       └─ ...
"""

from __future__ import annotations

import argparse
import json
import sys

import httpx

OWNERS = ("free", "evictable", "protected", "request_owned", "session_held")


def _line(child: dict, width: int) -> str:
    text = json.dumps(child["text"], ensure_ascii=False)
    text = text if len(text) <= width else text[: width - 2] + '…"'
    lock = f" (lock {child['lock_ref']})" if child["lock_ref"] else ""
    hit = "  <- latest hit" if child["hit"] and not any(c["hit"] for c in child["children"]) else ""
    return f"{text} {child['tokens']} tok, {child['state']}{lock}{hit}"


def render(body: dict, width: int = 48) -> str:
    pool = body["pool"]
    lines = ["KV pool: " + ", ".join(f"{k} {pool[k]}" for k in OWNERS) + f" (total {pool['total']})"]
    tree = body["tree"]
    if tree is None:
        return "\n".join(lines + ["the radix cache is disabled"])
    lines.append(f"(root) {tree['tokens']} tokens in {tree['nodes']} nodes"
                 + (f", the {tree['shown']} most recently used shown" if tree["shown"] < tree["nodes"] else ""))
    # Depth first without recursion (trees can be deep): a node's line, then its subtree.
    stack: list = [(tree["root"], "")]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            lines.append(item)
            continue
        node, prefix = item
        children, more = node["children"], node.get("more")
        pending = []
        for i, child in enumerate(children):
            last = i == len(children) - 1 and not more
            branch, indent = ("└─ ", "   ") if last else ("├─ ", "│  ")
            pending += [prefix + branch + _line(child, width), (child, prefix + indent)]
        if more:
            pending.append(f"{prefix}└─ + {more['nodes']} more nodes ({more['tokens']} tokens)")
        stack.extend(reversed(pending))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baby-sgl tree", description="print a running server's radix tree")
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server (default: http://127.0.0.1:30000)")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    p.add_argument("--max-nodes", type=int, default=200, help="show at most this many nodes (the hottest paths)")
    p.add_argument("--json", action="store_true", help="the raw JSON of GET /dashboard/tree")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.get(args.base_url.rstrip("/") + "/dashboard/tree", params={"max_nodes": args.max_nodes},
                      headers=headers, timeout=30)
    except httpx.HTTPError as e:
        print(f"baby-sgl tree: cannot reach {args.base_url}: {e}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        print(f"baby-sgl tree: {r.status_code} from the server: {r.text[:300]}", file=sys.stderr)
        return 1
    print(json.dumps(r.json(), ensure_ascii=False, indent=1) if args.json else render(r.json()))
    return 0
