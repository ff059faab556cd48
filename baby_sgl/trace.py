"""Trace log: one JSON line per scheduled batch and per cache event (insert, evict, retract).

Off by default; when off, no Tracer exists and callers skip building the records.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any


class Tracer:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    def event(self, kind: str, **fields: Any) -> None:
        record = {"t": round(time.perf_counter() - self._t0, 6), "event": kind, **fields}
        with self._lock:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        self._file.close()
