"""What the scheduler did lately, kept in memory for the dashboard: recent batches, evictions,
the latest cache hit, and per-second counters over the last minutes. Written only by the
scheduler thread; read through Scheduler.call (between steps), so it needs no lock. Bounded:
a few hundred small records whatever the load."""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from baby_sgl.managers.scheduler.batch import ScheduleBatch
    from baby_sgl.mem_cache.radix_cache import TreeNode

HISTORY_S = 300  # seconds of per-second counters
RECENT = 40  # batches and evictions kept
HEAD_TOKENS = 24  # tokens kept of an evicted node, to show its text
# Per-second history: its name -> the scheduler's cumulative counter (Scheduler.stats).
_COUNTERS = {"generated": "generation_tokens", "prompt": "prompt_tokens", "cached": "cached_tokens",
             "spec_steps": "spec_verify_steps", "spec_accepted": "spec_accepted_tokens"}


class Activity:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.batches: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.evictions: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.evicted_tokens = 0
        self.last_hit: dict[str, Any] | None = None
        self.last_hit_node: TreeNode | None = None
        self.history: deque[dict[str, float]] = deque(maxlen=HISTORY_S)
        self._last: dict[str, int] = {}  # the scheduler's counters at the last step

    def _now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def _bucket(self) -> dict[str, float]:
        second = int(time.monotonic() - self.t0)
        if not self.history or self.history[-1]["t"] != second:
            self.history.append({"t": second, "ttft_sum": 0.0, "ttft_n": 0, **{name: 0 for name in _COUNTERS}})
        return self.history[-1]

    def record_batch(self, batch: ScheduleBatch) -> None:
        n_extend = 0 if batch.mode.name == "DECODE" else len(batch.reqs) - batch.num_decode_reqs
        spans = list(zip(batch.reqs, batch.prefix_lens, batch.seq_lens))[:n_extend]
        self.batches.append({
            "t": self._now(), "mode": batch.mode.name, "extend_reqs": n_extend,
            "decode_reqs": len(batch.reqs) - n_extend, "extend_tokens": sum(b - a for _, a, b in spans),
            "cached_tokens": sum(r.cached_tokens for r, a, _ in spans if a == r.cached_tokens),
            "draft_tokens": sum(map(len, batch.drafts)),
        })
        for req, start, _ in spans:
            if start == req.cached_tokens and req.kv.last_node is not None:  # its first pass: the cache hit
                self.last_hit_node = req.kv.last_node
                self.last_hit = {"t": self._now(), "rid": req.rid, "cached_tokens": req.cached_tokens,
                                 "prompt_tokens": len(req.origin_input_ids)}

    def record_eviction(self, leaves: list[TreeNode]) -> None:
        tokens = sum(len(n.key) for n in leaves)
        self.evicted_tokens += tokens
        self.evictions.append({"t": self._now(), "nodes": len(leaves), "tokens": tokens,
                               "heads": [n.key[:HEAD_TOKENS] for n in leaves[:3]]})

    def record_ttft(self, seconds: float) -> None:
        bucket = self._bucket()
        bucket["ttft_sum"] += seconds
        bucket["ttft_n"] += 1

    def record_step(self, stats: dict[str, int]) -> None:
        """After each step: what the scheduler's counters gained since the last one goes to this
        second's bucket."""
        bucket = self._bucket()
        for name, key in _COUNTERS.items():
            bucket[name] += stats[key] - self._last.get(key, 0)
            self._last[key] = stats[key]

    def hit_path(self) -> set[int]:
        """Node ids from the latest hit's node up to the root (a later split only adds nodes on
        the way up, which the walk also passes)."""
        ids, node = set(), self.last_hit_node
        while node is not None:
            ids.add(node.id)
            node = node.parent
        return ids

    def snapshot(self) -> dict[str, Any]:
        """Copies (the records go on changing in the scheduler thread once this is read)."""
        return {"now": self._now(), "batches": [dict(b) for b in self.batches],
                "evictions": [dict(e) for e in self.evictions], "evicted_tokens": self.evicted_tokens,
                "last_hit": dict(self.last_hit) if self.last_hit else None,
                "history": [dict(h) for h in self.history]}
