"""How our processes end: the CLI, a server and a tensor-parallel rank skip the interpreter's last
garbage collections (~1 s a process with torch loaded), so a stopped server or rank is gone at once."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A reference cycle whose object says when the collector frees it.
_CHILD = """
import os
{call}
class Cycle:
    def __del__(self):
        os.write(1, b"collected")
def make():
    c = Cycle()
    c.me = c
make()
"""


@pytest.mark.parametrize("skip", [False, True])
def test_a_process_that_asks_ends_without_collecting(skip):
    call = "from baby_sgl.distributed.processes import end_without_collecting; end_without_collecting()" if skip else ""
    out = subprocess.run([sys.executable, "-c", _CHILD.format(call=call)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (out.stdout == "collected") is not skip  # without the call, Python's exit collects the cycle
