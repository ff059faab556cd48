"""Sessions: conversations whose turns continue from earlier requests, as in SGLang.

A normal session keeps its requests as a tree by rid. A turn names the request it continues
(`session_params["rid"]`); its input is that request's input + output + the new input
(`offset` cuts the old context, `drop_previous_output` leaves the output out, `replace` drops
the named request's other continuations). Its KV comes back through the radix cache.

A streaming session is append-only with one turn in flight, and between turns it keeps the
last turn's KV row itself, so the next turn prefills only its new tokens. The whole pages of
that row are in the radix tree, locked by the session (other requests may share them); the
partial last page belongs to the session alone until it closes: the tree only ever owns whole
pages (invariant 3), however unaligned the conversation's length is.

Everything here runs in the scheduler thread. While a turn runs, its request owns the row;
between turns the session does (`held`). Either way exactly one owner releases it.
"""

from __future__ import annotations

import time
import uuid
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from baby_sgl.errors import ServerBusyError
from baby_sgl.errors import MemoryLeakError
from baby_sgl.managers.io_struct import OpenSessionReqInput, SessionParams
from baby_sgl.core.finish_reason import FinishAbort
from baby_sgl.core.req import KVPosition, Req
from baby_sgl.mem_cache.base_prefix_cache import BasePrefixCache

# A normal session keeps every turn (any of them may be continued); this bounds its memory.
MAX_SESSION_TURNS = 1024
# Tokens all sessions' finished turns keep (4 bytes each: 64 MB). Turns and sessions are counted
# too, but 1024 sessions of 1024 turns of a whole 8k context each would keep 32 GB; a turn that
# would pass this is refused (503) until sessions close. A running turn holds a reservation of
# the most it can keep (its own input and max_new_tokens) until it ends.
MAX_SESSION_TOKENS = 2**24


# A finished turn's tokens refer to the turn it continued this many times over at most; then it
# keeps a whole copy (reading a context walks the chain).
MAX_TURN_CHAIN = 64


@dataclass(frozen=True)
class FinishedTurn:
    """What a later turn needs of a finished one: its tokens, 4 bytes each (the request itself,
    with its logprobs and drafting state, is not kept). They are the first `kept` tokens of the
    turn it continued (`base`), then its own: a turn of one new token after a long context keeps
    that token and its output, not the context again (1023 such turns kept 1023 copies)."""

    base: FinishedTurn | None
    kept: int  # how many of base's tokens its input starts with
    own: array[int]  # the rest of its input, then its output
    input_len: int
    lora_id: str | None = None
    depth: int = 0  # turns in the chain of bases

    @staticmethod
    def of(req: Req, base: FinishedTurn | None, kept: int) -> FinishedTurn:
        """base: the turn it refers to (one that can_be_referred_to), or None for a whole copy."""
        own = array("i", req.origin_input_ids[kept:] + req.output_ids)
        return FinishedTurn(base, kept, own, len(req.origin_input_ids), req.lora_id, 0 if base is None else base.depth + 1)

    def can_be_referred_to(self) -> bool:
        """A later turn may keep only its own tokens and refer to this one (MAX_TURN_CHAIN)."""
        return self.depth < MAX_TURN_CHAIN

    def context(self, with_output: bool) -> list[int]:
        return self.prefix(self.kept + len(self.own) if with_output else self.input_len)

    def prefix(self, n: int) -> list[int]:
        """Its first n tokens."""
        parts: list[array[int]] = []
        turn: FinishedTurn | None = self
        while turn is not None and n > 0:
            if n > turn.kept:
                parts.append(turn.own[: n - turn.kept])
                n = turn.kept
            turn = turn.base
        out: list[int] = []
        for part in reversed(parts):
            out.extend(part)
        return out


@dataclass
class Session:
    id: str
    capacity_of_str_len: int
    streaming: bool
    timeout: float | None
    reqs: dict[str, Req | FinishedTurn] = field(default_factory=dict)  # every turn by rid: running or finished
    children: dict[str | None, list[str]] = field(default_factory=dict)  # rid -> continuations; None: roots
    last_rid: str | None = None
    in_flight: set[str] = field(default_factory=set)
    # A running turn's input as the finished turn it continued and the tokens of it kept.
    bases: dict[str, tuple[FinishedTurn, int]] = field(default_factory=dict)
    reserved: dict[str, int] = field(default_factory=dict)  # a running turn's reservation of kept tokens
    held: Req | None = None  # streaming: the finished turn whose KV row the session keeps
    closing: bool = False
    last_active: float = field(default_factory=time.monotonic)

    def descendants(self, rid: str | None) -> list[str]:
        out, stack = [], list(self.children.get(rid, []))
        while stack:
            child = stack.pop()
            out.append(child)
            stack.extend(self.children.get(child, []))
        return out


class SessionController:
    def __init__(self, tree_cache: BasePrefixCache[Any], max_input_len: int, bos_token_id: int | None,
                 max_sessions: int) -> None:
        self.tree_cache = tree_cache
        self.max_input_len = max_input_len
        self.max_sessions = max_sessions
        self.bos_token_id = bos_token_id
        self.sessions: dict[str, Session] = {}
        # In the finished turns of sessions' `reqs`, plus running turns' reservations (MAX_SESSION_TOKENS).
        self.stored_tokens = 0

    # ---- open and close ------------------------------------------------------------------
    def open(self, params: OpenSessionReqInput) -> str:
        """Opens a session (params already validated) and returns its id."""
        if len(self.sessions) >= self.max_sessions:
            raise ServerBusyError(f"too many open sessions (the limit is {self.max_sessions}); close one first")
        session_id = params.session_id or uuid.uuid4().hex
        if session_id in self.sessions:
            raise ValueError(f"session {session_id!r} is already open")
        self.sessions[session_id] = Session(session_id, params.capacity_of_str_len, params.streaming, params.timeout)
        return session_id

    def close(self, session_id: str) -> None:
        """Releases what the session holds now, or when its running turns end."""
        session = self.sessions.get(session_id)
        if session is None or session.closing:
            raise ValueError(f"session {session_id!r} is not open")
        session.closing = True
        self._close_if_done(session)

    def _close_if_done(self, session: Session) -> None:
        if session.closing and not session.in_flight:
            if session.held is not None:
                self.tree_cache.release_req(session.held)
                session.held = None
            self._forget(session.reqs.values())
            self.sessions.pop(session.id, None)

    def _forget(self, turns: Iterable[Req | FinishedTurn]) -> None:
        """Turns leaving a session's `reqs`: their kept tokens no longer count."""
        self.stored_tokens -= sum(len(t.own) for t in turns if isinstance(t, FinishedTurn))

    def expire(self) -> float | None:
        """Closes idle sessions past their timeout; returns the seconds until the next may expire."""
        now, soonest = time.monotonic(), None
        for session in list(self.sessions.values()):
            if session.timeout is None or session.in_flight or session.closing:
                continue
            left = session.last_active + session.timeout - now
            if left <= 0:
                session.closing = True
                self._close_if_done(session)
            else:
                soonest = left if soonest is None else min(soonest, left)
        return soonest

    def held_reqs(self) -> list[Req]:
        return [s.held for s in self.sessions.values() if s.held is not None]

    def check(self) -> None:
        """Its own integrity: a held turn keeps its request slot, no two sessions share one, and
        the count of kept tokens is what the sessions keep."""
        kept = sum(len(t.own) for s in self.sessions.values() for t in s.reqs.values() if isinstance(t, FinishedTurn))
        kept += sum(n for s in self.sessions.values() for n in s.reserved.values())
        if kept != self.stored_tokens:
            raise MemoryLeakError(f"sessions keep and reserve {kept} tokens of turns, counted {self.stored_tokens}")
        held = self.held_reqs()
        if any(r.kv.req_pool_idx is None for r in held):
            raise MemoryLeakError("a streaming session holds a turn without its request slot")
        if len({r.kv.req_pool_idx for r in held}) != len(held):
            raise MemoryLeakError("two streaming sessions hold one request slot")

    # ---- a new turn ----------------------------------------------------------------------
    def attach(self, req: Req, params: SessionParams) -> None:
        """Makes req a turn of the session named in params (already validated): checks the
        operation, builds its input from the turn it continues and registers it. Raises
        ValueError, changing nothing."""
        session = self.sessions.get(params.id)
        if session is None or session.closing:
            raise ValueError(f"session {params.id!r} is not open")
        rid, offset, replace, drop_output = params.rid, params.offset, params.replace, params.drop_previous_output
        if len(session.reqs) >= MAX_SESSION_TURNS and not replace:
            raise ValueError(f"session {session.id!r} holds {MAX_SESSION_TURNS} turns, the most one session keeps; "
                             f"close it and open another")
        if req.rid in session.reqs or req.rid in session.in_flight:
            raise ValueError(f"request id {req.rid!r} is already used in session {session.id!r}")
        if rid is not None and rid not in session.reqs:
            raise ValueError(f"session {session.id!r} has no request {rid!r}")
        if session.streaming:
            if replace or offset or drop_output:
                raise ValueError("a streaming session is append-only: replace, offset and drop_previous_output "
                                 "are not allowed")
            if session.in_flight:
                raise ValueError(f"streaming session {session.id!r} already has a request in flight "
                                 f"({next(iter(session.in_flight))!r}); send the next turn when it finishes")
            if rid is not None and rid != session.last_rid:
                raise ValueError(f"a streaming session continues its last request ({session.last_rid!r}), not {rid!r}")
            rid = session.last_rid
        prev = session.reqs[rid] if rid is not None else None
        if isinstance(prev, Req) and not prev.finished and not replace:
            raise ValueError(f"request {rid!r} is still running; a turn can only continue a finished request "
                             f"(or replace it)")
        lora_id = self._turn_adapter(session.id, prev, req)
        input_ids, kept = self._turn_input(prev, req.origin_input_ids, offset, drop_output)
        if not input_ids:
            raise ValueError("the session turn's input is empty (offset 0 and a new input that is only BOS)")
        if session.held is not None and len(input_ids) <= session.held.kv.kv_len:
            raise ValueError("the turn adds no tokens to the session's context (its input is empty or only BOS)")
        if len(input_ids) > self.max_input_len:
            raise ValueError(f"prompt is too long: the session's context plus the new input is {len(input_ids)} "
                             f"tokens, the limit is {self.max_input_len}")
        # What the turn keeps when it ends: its input past what it refers to in the turn it
        # continues (all of it when that is running, or the chain is full, or the session
        # streams), and its output.
        chained = isinstance(prev, FinishedTurn) and prev.can_be_referred_to() and not session.streaming
        reserve = len(input_ids) - (kept if chained else 0) + min(req.sampling_params.max_new_tokens, self.max_input_len)
        freed = 0  # what a replace drops
        if replace:
            freed = sum(len(t.own) for t in map(session.reqs.get, session.descendants(rid)) if isinstance(t, FinishedTurn))
        if self.stored_tokens - freed + reserve > MAX_SESSION_TOKENS:
            raise ServerBusyError(f"sessions keep {self.stored_tokens} tokens of turns (finished, or reserved by "
                                  f"running ones), and this turn would pass the limit of {MAX_SESSION_TOKENS}; "
                                  f"close sessions first")
        if replace:
            self._drop_continuations(session, rid)
        req.origin_input_ids = input_ids
        req.session, req.lora_id = session, lora_id
        if session.streaming:  # append-only: only the last turn can be continued, keep just it
            self._forget(session.reqs.values())
            session.reqs.clear()
            session.children.clear()
        session.reqs[req.rid] = req
        session.reserved[req.rid] = reserve
        self.stored_tokens += reserve
        if chained:
            assert isinstance(prev, FinishedTurn)
            session.bases[req.rid] = (prev, kept)
        session.children.setdefault(rid, []).append(req.rid)
        session.last_rid = req.rid
        session.in_flight.add(req.rid)
        session.last_active = time.monotonic()

    def _turn_input(self, prev: Req | FinishedTurn | None, new: list[int], offset: int,
                    drop_output: bool) -> tuple[list[int], int]:
        """The turn's input, and how many of its tokens are prev's."""
        if prev is None:
            return list(new), 0
        if new and new[0] == self.bos_token_id:  # an appended turn does not start a new sequence
            new = new[1:]
        if isinstance(prev, FinishedTurn):
            context = prev.context(with_output=not drop_output)
        else:  # a running turn being replaced: its output so far
            context = list(prev.origin_input_ids) if drop_output else prev.origin_input_ids + prev.output_ids
        if offset > len(context):
            raise ValueError(f"session_params.offset {offset} is past the end of the context ({len(context)} tokens)")
        kept = context[:offset] if offset else context
        return kept + new, len(kept)

    def _drop_continuations(self, session: Session, rid: str | None) -> None:
        """`replace`: the named request (if still running) and everything that continued it are
        dropped; running ones are aborted and release their KV at the next step."""
        doomed = session.descendants(rid) + ([rid] if rid is not None else [])
        for r in doomed:
            req = session.reqs[r]
            if isinstance(req, Req) and not req.finished:
                req.to_abort = "replaced by a later request in its session"
        for r in session.descendants(rid):
            self._forget([session.reqs.pop(r)])
            session.children.pop(r, None)
        session.children[rid] = []

    # ---- the KV of streaming sessions ----------------------------------------------------
    @staticmethod
    def _turn_adapter(session_id: str, prev: Req | FinishedTurn | None, req: Req) -> str | None:
        """A turn runs with the LoRA adapter of the turn it continues (its context was computed
        with it): naming none keeps it, naming another is refused."""
        if prev is None or prev.lora_id == req.lora_id or req.lora_id is None:
            return req.lora_id if prev is None else prev.lora_id
        raise ValueError(f"session {session_id!r} continues a turn run with LoRA adapter {prev.lora_id!r}; "
                         f"a turn cannot change it (got {req.lora_id!r})")

    def held_prefix(self, req: Req) -> torch.Tensor | None:
        """For a streaming turn whose session holds the previous turn's row: the KV slots of
        that row (its prefix), else None."""
        held = req.session.held if req.session is not None else None
        if held is None:
            return None
        assert held.fill_ids[: held.kv.kv_len] == req.fill_ids[: held.kv.kv_len], "held KV is not the turn's prefix"
        assert held.kv.kv_len < req.seqlen
        table = self.tree_cache.req_to_token_pool.req_to_token
        return table[held.row(), : held.kv.kv_len].cpu()

    def release_idle_row(self, waiting: list[Req]) -> bool:
        """Under memory pressure (no free request row, or KV for the next admission or decode):
        gives back the row of the session idle the longest, preferring sessions with no turn
        waiting. Its whole pages stay in the tree, evictable; its next turn recomputes the rest.
        Returns False when no session holds a row."""
        held = [s for s in self.sessions.values() if s.held is not None]
        if not held:
            return False
        queued = {id(r.session) for r in waiting if r.session is not None}
        victim = min(held, key=lambda s: (id(s) in queued, s.last_active))
        row, victim.held = victim.held, None
        assert row is not None
        self.tree_cache.release_req(row)
        return True

    def hand_over(self, req: Req) -> None:
        """At admission: the turn takes the session's row (and the session's tree lock with it)."""
        session = req.session
        if session is None or session.held is None:
            return
        held, session.held = session.held, None
        req.kv.req_pool_idx, req.kv.kv_len, req.kv.alloc_len = held.kv.req_pool_idx, held.kv.kv_len, held.kv.alloc_len
        req.kv.cache_protected_len, req.kv.last_node = held.kv.cache_protected_len, held.kv.last_node
        held.kv = KVPosition()

    def keep_row(self, req: Req) -> bool:
        """A turn ended. A streaming session that stays open keeps the row of a turn that ended
        normally: its whole pages go to the tree (locked), the partial page stays in the row.
        Returns False when the row is not kept; the caller releases it through the cache."""
        session = req.session
        if session is not None and session.held is req:
            return True
        if (session is None or not session.streaming or session.closing or req.kv.req_pool_idx is None
                or isinstance(req.finished_reason, FinishAbort)):
            return False
        self.tree_cache.cache_unfinished_req(req)
        session.held = req
        return True

    def turn_ended(self, req: Req) -> None:
        """Bookkeeping once a turn's KV is settled: the session may close now."""
        session = req.session
        if session is not None:
            base, kept = session.bases.pop(req.rid, (None, 0))
            self.stored_tokens -= session.reserved.pop(req.rid, 0)
            if session.reqs.get(req.rid) is req:  # (a replaced turn is gone already)
                turn = session.reqs[req.rid] = FinishedTurn.of(req, base, kept)
                self.stored_tokens += len(turn.own)
            session.in_flight.discard(req.rid)
            session.last_active = time.monotonic()
            self._close_if_done(session)
