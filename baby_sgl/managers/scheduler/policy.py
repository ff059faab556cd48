"""The order in which waiting requests are considered for prefill (--schedule-policy), and the
cached prefix each one would reuse."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

from baby_sgl.core.req import Req
from baby_sgl.managers.session_controller import SessionController
from baby_sgl.mem_cache.base_prefix_cache import BasePrefixCache


def match_prefix(req: Req, tree_cache: BasePrefixCache[Any], sessions: SessionController) -> None:
    """Finds the request's cached prefix. The last token is always computed, because its
    logits give the next token, so at most len - 1 tokens can come from the cache. A streaming
    session's turn finds its prefix in the row its session holds (locked there already, so
    the root stands in as the node to lock). A match is kept while neither the cache nor the
    request changed since: matching again would find the same, at a cost proportional to the
    prompt, for every request that waits, at every step."""
    held = sessions.held_prefix(req)
    if held is not None:
        req.kv.prefix_indices, req.kv.last_node, req.kv.prefix_match_key = held, tree_cache.root, None
        return
    key = (tree_cache.version, req.seqlen)
    if req.kv.prefix_match_key == key:
        return
    limit = req.seqlen - 1
    start = req.logprobs.start_len
    if start is not None and req.input_logprobs_pending():  # prompt logprobs need those positions computed here
        limit = min(limit, start)
    match = tree_cache.match_prefix(req.fill_ids[:limit], req.lora_id)
    req.kv.prefix_indices, req.kv.last_node, req.kv.prefix_match_key = match.slots, match.node, key


CACHE_AWARE_POLICIES = ("lpm", "dfs-weight")  # need the radix tree; fcfs without it, as SGLang
# The cache-aware policies sort only queues up to this long (they need every waiting request's
# match); a longer one is served in arrival order, as SGLang does for lpm.
CACHE_AWARE_MAX_QUEUE = 128
# At most this many waiting requests are looked at (and matched) per step: admission stops there.
MAX_CONSIDERED_PER_STEP = 128


def sorts_by_prefix(policy: str, queue_len: int) -> bool:
    """Whether the policy's order needs every waiting request's prefix matched first."""
    return policy in CACHE_AWARE_POLICIES and queue_len <= CACHE_AWARE_MAX_QUEUE


def sort_waiting(waiting: list[Req], policy: str, rng: random.Random, root: Any = None) -> None:
    """Orders the waiting queue in place (for lpm and dfs-weight, every request's prefix is
    matched already; queues longer than CACHE_AWARE_MAX_QUEUE keep their arrival order):
    - fcfs: arrival order;
    - lpm: longest cached prefix first (stable on ties);
    - dfs-weight: a depth-first walk of the radix tree from `root`, heaviest subtree (most
      waiting requests under it) first, so requests sharing a prefix run together;
    - lof: longest output (max_new_tokens) first;
    - random: shuffled with the scheduler's seeded generator (same seed and arrivals, same order)."""
    if policy in CACHE_AWARE_POLICIES and not sorts_by_prefix(policy, len(waiting)):
        return
    if policy == "lpm":
        waiting.sort(key=lambda r: -len(r.prefix()))
    elif policy == "dfs-weight":
        waiting[:] = _dfs_weight_order(waiting, root)
    elif policy == "lof":
        waiting.sort(key=lambda r: -r.sampling_params.max_new_tokens)
    elif policy == "random":
        rng.shuffle(waiting)


def _dfs_weight_order(waiting: list[Req], root: Any) -> list[Req]:
    """Requests grouped by the tree node their cached prefix ends at; a node weighs as many
    requests as end in its subtree. Children are visited heaviest first, and a node's own
    requests come after its subtree's, in arrival order."""
    at_node: dict[int, list[Req]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    for req in waiting:
        node = req.kv.last_node if req.kv.last_node is not None else root
        at_node[id(node)].append(req)
        while node is not None:  # every ancestor's subtree holds this request too
            weight[id(node)] += 1
            node = node.parent
    order: list[Req] = []
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.extend(at_node.get(id(node), []))
            continue
        stack.append((node, True))
        children = [c for c in node.children.values() if weight.get(id(c))]
        # Pushed lightest first so the heaviest is popped (visited) first; ties keep tree order.
        for child in sorted(reversed(children), key=lambda c: weight[id(c)]):
            stack.append((child, False))
    seen = set(map(id, order))  # a prefix matched on a node evicted since cannot be reached
    return order + [r for r in waiting if id(r) not in seen]


# A waiting request whose uncached part starts with this many tokens of a request already in the
# batch waits one step: next step that prefix is in the tree and it is not computed twice.
IN_BATCH_PREFIX_THRESHOLD = 32


def shares_uncached_prefix(req: Req, batch: list[Req]) -> bool:
    k = len(req.prefix()) + IN_BATCH_PREFIX_THRESHOLD
    if req.seqlen <= k:
        return False
    head = req.fill_ids[:k]
    return any(other.fill_ids[:k] == head and other.lora_id == req.lora_id for other in batch)
