"""What other threads put in the scheduler's inbox."""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from baby_sgl.core.req import Req


@dataclass
class NewReq:
    req: Req


@dataclass
class AbortReq:
    rid: str


@dataclass
class Call:
    """Run fn in the scheduler thread between steps; (True, result) or (False, exception) goes to done."""

    fn: Callable[[], Any]
    done: queue.Queue[tuple[bool, Any]]


@dataclass
class Stop:
    pass


@dataclass
class Wake:
    """Makes an idle loop turn: a reader wants something published (snapshots.py)."""


Message = NewReq | AbortReq | Call | Stop | Wake
