"""How our processes end: the CLI, a server and a tensor-parallel rank skip the interpreter's last
garbage collections (~1 s a process with torch loaded), so a stopped server or rank is gone at once;
and `baby-sgl --help` answers without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from baby_sgl import cli, launch_server
from baby_sgl.distributed import processes, tp_worker

# A reference cycle whose object says when the collector frees it, and an exit handler registered
# before the call, which must still run.
_CHILD = """
import atexit, os
atexit.register(os.write, 1, b"handler ")
{call}
class Cycle:
    def __del__(self):
        os.write(1, b"collected")
def make():
    c = Cycle()
    c.me = c
make()
"""


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("skip", [False, True])
def test_a_process_that_asks_ends_without_collecting(skip):
    call = "from baby_sgl.distributed.processes import end_without_collecting; end_without_collecting()" if skip else ""
    out = _run(_CHILD.format(call=call))
    assert out.startswith("handler ")  # the other exit handlers run either way
    assert out.endswith("collected") is not skip  # without the call, Python's exit collects the cycle


@pytest.mark.parametrize("main", [cli.main, launch_server.main, tp_worker.main], ids=["cli", "server", "tp-rank"])
def test_each_entry_point_asks(monkeypatch, main):
    asked = []
    monkeypatch.setattr(processes.atexit, "register", lambda fn: asked.append(fn))
    monkeypatch.setattr(processes.atexit, "unregister", lambda fn: asked.remove(fn) if fn in asked else None)
    with pytest.raises(SystemExit):
        main(["--help"])
    processes.end_without_collecting()  # `baby-sgl serve` asks twice: the cli, then the server
    assert asked == [processes.gc.freeze]


def test_help_does_not_import_the_engine():
    out = _run("import sys\nfrom baby_sgl.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
               "print(sorted(m for m in ('torch', 'transformers', 'baby_sgl.engine') if m in sys.modules))")
    assert out.strip().endswith("[]")
