"""Building the CPU kernels: a build that was killed half-way never blocks the next one, and a build
is named by what it depends on, so checkouts on one machine share it instead of rebuilding it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import baby_sgl
from baby_sgl.cpu import ops, toolchain

_LOAD = "from baby_sgl.cpu import ops; assert ops.cpu_ops() is not None; print('loaded', ops.__file__)"
needs_compiler = pytest.mark.skipif(toolchain.cxx_compiler() is None, reason="no C++ compiler: nothing is built")


def _load(env: dict[str, str], timeout: float, code: str = _LOAD, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-P", "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-2000:]
    return proc.stdout


# A module of one line, built as our kernels are (toolchain.build_extension): a build of its own
# takes seconds where the kernels take ~40 s.
_PROBE = '#include <torch/csrc/utils/pybind.h>\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.attr("answer") = 42; }\n'
_LOAD_PROBE = ("import sys; from pathlib import Path; from baby_sgl.cpu import toolchain; "
               "m = toolchain.build_extension('baby_sgl_lock_probe', (Path(sys.argv[1]),), 'a test'); "
               "print('loaded', m.answer)")


@needs_compiler
def test_a_lock_left_by_a_killed_build_does_not_block_the_next(tmp_path):
    # torch's loader locks a build with a file that its process removes when the build ends; a
    # process killed mid-build (a server stopped while it loads) leaves it, and without a lock of
    # our own around the build every later load waited for that file forever. A build is put back
    # in that state (it is whole again after the load).
    source = tmp_path / "probe.cpp"
    source.write_text(_PROBE)
    assert "loaded 42" in _load(dict(os.environ), 300, _LOAD_PROBE, str(source))  # built once (or already)
    build = toolchain.build_dir("baby_sgl_lock_probe", (source,))
    (build / "built").unlink()  # a killed build never stamps its directory
    (build / "lock").touch()  # what the killed build left
    assert "loaded 42" in _load(dict(os.environ), 300, _LOAD_PROBE, str(source))
    assert not (build / "lock").exists() and (build / "built").exists()


def _key(csrc: Path, arch: str = "native") -> str:
    return toolchain.build_key(ops.NAME, tuple(csrc / s.name for s in ops.SOURCES), arch)


def test_a_build_is_named_by_its_sources_contents_not_their_place(tmp_path):
    csrc = ops.SOURCES[0].parent
    a, b = shutil.copytree(csrc, tmp_path / "a"), shutil.copytree(csrc, tmp_path / "b")
    assert _key(a) == _key(b) == _key(csrc)
    (b / "vec.h").write_text((b / "vec.h").read_text() + "\n")  # a header no source list names
    assert _key(b) != _key(a)
    assert _key(a, "x86-64") != _key(a)


@needs_compiler
def test_a_second_checkout_with_the_same_sources_loads_the_first_ones_build(tmp_path):
    # Before: toolchain.kernel_cache_dir named the build directory by torch's version and the CPU
    # only, and torch's loader rebuilt it whenever the sources' paths in its command lines changed,
    # so two checkouts took turns rebuilding it (1-2 minutes at each engine start).
    def first_on_path(checkout: Path) -> dict[str, str]:  # before what the environment adds (its packages)
        paths = [str(checkout), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}  # no empty entry: it would add the cwd

    _load(first_on_path(Path(baby_sgl.__file__).parent.parent), timeout=600)
    build = toolchain.build_dir(ops.NAME, ops.SOURCES)
    library = build / (build / "built").read_text()
    built_at = library.stat().st_mtime_ns
    shutil.copytree(Path(baby_sgl.__file__).parent, tmp_path / "checkout" / "baby_sgl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = _load(first_on_path(tmp_path / "checkout"), timeout=600)
    assert str(tmp_path / "checkout") in out  # the other checkout's code ran
    assert library.stat().st_mtime_ns == built_at
