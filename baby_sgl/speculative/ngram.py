"""N-gram drafts for speculative decoding (--speculative-algorithm NGRAM): no draft model, the
next tokens are guessed by finding the request's last few tokens earlier in some text and
proposing what followed them there.

Two places are searched, in order: the request's own prompt and output (code being rewritten, a
document being quoted), then the text of every request the prefix cache has taken in (an answer
another request already gave, the previous turns of other chats). Each is an index from every
n-gram (n between the min and max match window) to the position after its latest occurrence; the
longest suffix of the request that occurs wins. The model verifies the drafts in one pass
(managers/scheduler/speculation.py), so a wrong guess costs compute, never correctness.

When drafting does not pay it stops: a request whose recent drafts were mostly rejected pauses
(RequestDrafts.record); the batch rule is in managers/scheduler/speculation.py.
"""

from __future__ import annotations

from collections import deque

# A request proposes at most twice its recent mean accepted run plus two tokens (a wrong draft's
# rows are paid for: at batch 1 a pass of 8 rows took ~2x a one-token step's time, logits and
# sampling included, on the default model), and pauses drafting when, over its last verifies (at
# least MIN_DRAFTED draft tokens, or RECENT_VERIFIES verifies), fewer than MIN_ACCEPT_RATE of its
# drafts were accepted. It drafts again after PAUSE_STEPS decode steps (the text may change).
RECENT_VERIFIES, MIN_DRAFTED, MIN_ACCEPT_RATE, PAUSE_STEPS = 8, 16, 0.1, 16


class NgramIndex:
    """n-gram -> (the sequence it was last seen in, the position after it there)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.table: dict[tuple[int, ...], tuple[list[int], int]] = {}

    def add(self, seq: list[int], start: int, end: int) -> None:
        """Indexes the n-grams of seq that end right before position p, for p in [start, end)."""
        table, lo = self.table, self.min_n
        for p in range(max(start, lo), end):
            for n in range(lo, min(self.max_n, p) + 1):
                table[tuple(seq[p - n : p])] = (seq, p)

    def remove(self, seq: list[int]) -> None:
        """Forgets seq's n-grams (those not seen since in another sequence)."""
        for p in range(self.min_n, len(seq)):
            for n in range(self.min_n, min(self.max_n, p) + 1):
                key = tuple(seq[p - n : p])
                if self.table.get(key, (None,))[0] is seq:
                    del self.table[key]

    def continuation(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest indexed suffix of tokens (none if no suffix
        of at least min_n tokens is indexed)."""
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            hit = self.table.get(tuple(tokens[-n:]))
            if hit is not None:
                seq, p = hit
                return seq[p : p + k]
        return []


class RequestDrafts:
    """One request's drafting state: its own text, indexed as it grows, and its recent acceptance."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.tokens: list[int] = []
        self.index = NgramIndex(min_n, max_n)
        self.recent: deque[tuple[int, int]] = deque(maxlen=RECENT_VERIFIES)  # (drafted, accepted)
        self.paused = 0  # decode steps left without drafting

    def sync(self, prompt: list[int], output: list[int]) -> None:
        """Takes in the tokens the request gained since the last call (without copying the rest)."""
        old = len(self.tokens)
        self.tokens.extend(prompt[old:] if old < len(prompt) else ())
        self.tokens.extend(output[max(0, old - len(prompt)):])
        self.index.add(self.tokens, old, len(self.tokens))

    def max_drafts(self, limit: int) -> int:
        if not self.recent:
            return limit
        return min(limit, 2 + 2 * sum(a for _, a in self.recent) // len(self.recent))

    def record(self, drafted: int, accepted: int) -> None:
        self.recent.append((drafted, accepted))
        total = sum(d for d, _ in self.recent)
        judged = total >= MIN_DRAFTED or len(self.recent) == RECENT_VERIFIES
        if judged and sum(a for _, a in self.recent) < MIN_ACCEPT_RATE * total:
            self.paused, self.recent = PAUSE_STEPS, deque(maxlen=RECENT_VERIFIES)


class NgramDrafter:
    def __init__(self, min_n: int, max_n: int, capacity: int, share: bool) -> None:
        self.min_n, self.max_n, self.capacity = min_n, max_n, capacity
        self.share = share  # draft from other requests' text too (the prefix cache is on)
        self.cache_index = NgramIndex(min_n, max_n)
        self.cached: deque[list[int]] = deque()  # the sequences cache_index holds, oldest first
        self.cached_tokens = 0

    def draft(self, state: RequestDrafts, prompt: list[int], output: list[int], k: int) -> list[int]:
        """Up to k tokens to verify after prompt + output; [] while the request is paused."""
        state.sync(prompt, output)
        if state.paused > 0:
            state.paused -= 1
            return []
        k = state.max_drafts(k)
        own = state.index.continuation(state.tokens, k)
        if own or not self.share:
            return own
        return self.cache_index.continuation(state.tokens, k)

    def clear(self) -> None:
        self.cache_index.table.clear()
        self.cached.clear()
        self.cached_tokens = 0

    def add_cached_text(self, tokens: list[int]) -> None:
        """A finished request's prompt and output, as the prefix cache takes them in; the oldest
        text leaves the index beyond its capacity."""
        if not self.share or len(tokens) <= self.min_n:
            return
        seq = list(tokens)
        self.cache_index.add(seq, 0, len(seq))
        self.cached.append(seq)
        self.cached_tokens += len(seq)
        while self.cached_tokens > self.capacity and len(self.cached) > 1:
            old = self.cached.popleft()
            self.cached_tokens -= len(old)
            self.cache_index.remove(old)
