"""Which waiting requests to prefill next, within the KV and token budgets."""

from __future__ import annotations

import enum
import random
from collections import defaultdict
from typing import Any

from baby_sgl.core.req import Req
from baby_sgl.managers.session_controller import SessionController
from baby_sgl.mem_cache.allocator import PagedTokenAllocator
from baby_sgl.mem_cache.base_prefix_cache import BasePrefixCache

# Output tokens a running request is assumed to still need, at most, when reserving KV room.
_MAX_RESERVED_PER_REQ = 4096
_UNCHUNKED = 1 << 62  # the chunk budget of unchunked prefill: more tokens than any pass holds


def match_prefix(req: Req, tree_cache: BasePrefixCache[Any], sessions: SessionController) -> None:
    """Finds the request's cached prefix. The last token is always computed, because its
    logits give the next token, so at most len - 1 tokens can come from the cache. A streaming
    session's turn finds its prefix in the row its session holds (locked there already, so
    the root stands in as the node to lock). A match is kept while neither the cache nor the
    request changed since: matching again would find the same, at a cost proportional to the
    prompt, for every request that waits, at every step."""
    held = sessions.held_prefix(req)
    if held is not None:
        req.prefix_indices, req.last_node, req.prefix_match_key = held, tree_cache.root, None
        return
    key = (tree_cache.version, req.seqlen)
    if req.prefix_match_key == key:
        return
    limit = req.seqlen - 1
    start = req.logprobs.start_len
    if start is not None and req.input_logprobs_pending():  # prompt logprobs need those positions computed here
        limit = min(limit, start)
    match = tree_cache.match_prefix(req.fill_ids[:limit])
    req.prefix_indices, req.last_node, req.prefix_match_key = match.slots, match.node, key


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
        node = req.last_node if req.last_node is not None else root
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
    return any(other.fill_ids[:k] == head for other in batch)


class AddResult(enum.Enum):
    CONTINUE = enum.auto()
    NO_ROOM = enum.auto()  # out of KV slots, prefill tokens or chunk budget: stop adding


def reserved_tokens(req: Req, ratio: float) -> int:
    remaining = req.sampling_params.max_new_tokens - len(req.output_ids)
    return int(min(remaining, _MAX_RESERVED_PER_REQ) * ratio)


class PrefillAdder:
    def __init__(self, tree_cache: BasePrefixCache[Any], allocator: PagedTokenAllocator, running: list[Req], new_token_ratio: float,
                 max_prefill_tokens: int, chunked_prefill_size: int | None, sessions: SessionController,
                 mixed_decode_tokens: int = 0) -> None:
        self.tree_cache, self.allocator, self.ratio = tree_cache, allocator, new_token_ratio
        self.sessions = sessions
        self.page_size = allocator.page_size
        # KV room kept for the decode steps of requests already running.
        self.reserved = sum(reserved_tokens(r, new_token_ratio) + self.page_size for r in running)
        self.idle = not running
        # A mixed pass also carries one token per running request: they count against the budgets.
        self.rem_input_tokens = max_prefill_tokens - mixed_decode_tokens
        self.rem_chunk_tokens = (chunked_prefill_size or _UNCHUNKED) - mixed_decode_tokens
        self.can_run: list[Req] = []
        self.new_chunked_req: Req | None = None

    @property
    def rem_total_tokens(self) -> int:
        return self.allocator.available_size() + self.tree_cache.evictable_size() - self.reserved

    def add_chunked_req(self, req: Req) -> bool:
        """Next chunk of a request whose prefill is split across steps, if KV room allows."""
        extend = min(req.seqlen - req.kv_len, self._chunk_room())
        if extend + self.page_size > self.rem_total_tokens:
            return False
        self._add(req, extend)
        return True

    def add_one_req(self, req: Req) -> AddResult:
        extend = req.seqlen - len(req.prefix())
        if self.can_run and extend > self.rem_input_tokens:
            return AddResult.NO_ROOM
        # Lock first: the matched prefix must survive this step's evictions, so it no longer
        # counts as room that eviction could free.
        self.tree_cache.inc_lock_ref(req.last_node)
        # An idle engine takes its first request whenever the prompt fits: were its future output
        # reserved too, a long max_new_tokens in a small pool would wait forever.
        reserve = 0 if self.idle and not self.can_run else reserved_tokens(req, self.ratio)
        if extend + reserve + self.page_size > self.rem_total_tokens:
            self.tree_cache.dec_lock_ref(req.last_node)
            return AddResult.NO_ROOM
        req.cached_tokens = max(req.cached_tokens, len(req.prefix()))
        self.sessions.hand_over(req)  # a streaming turn resumes in its session's row
        self._add(req, min(extend, self._chunk_room()))
        return AddResult.NO_ROOM if req.is_chunked or self.rem_chunk_tokens <= 0 else AddResult.CONTINUE

    def _chunk_room(self) -> int:
        # A chunk ends on a page boundary so the tree can take all of it between chunks.
        return max(self.rem_chunk_tokens // self.page_size * self.page_size, self.page_size)

    def _add(self, req: Req, extend: int) -> None:
        start = req.kv_len if req.req_pool_idx is not None else len(req.prefix())
        req.extend_input_len = extend
        req.is_chunked = start + extend < req.seqlen
        if req.is_chunked:
            self.new_chunked_req = req
        self.can_run.append(req)
        self.reserved += extend + reserved_tokens(req, self.ratio) + self.page_size
        self.rem_input_tokens -= extend
        self.rem_chunk_tokens -= extend
