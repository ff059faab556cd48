"""Building the CPU kernels: a build that was killed half-way never blocks the next one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from baby_sgl.cpu import toolchain

_LOAD = "from baby_sgl.cpu import ops; assert ops.cpu_ops() is not None; print('loaded')"


def _load(env: dict[str, str], timeout: float) -> None:
    proc = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.skipif(toolchain.cxx_compiler() is None, reason="no C++ compiler: nothing is built")
def test_a_lock_left_by_a_killed_build_does_not_block_the_next(tmp_path):
    # torch's loader locks a build with a file that its process removes when the build ends; a
    # process killed mid-build (a server stopped while it loads) leaves it, and without a lock of
    # our own around the build every later load waited for that file forever.
    _load(dict(os.environ), timeout=600)  # the kernels of this machine, built once (or already)
    native = toolchain.kernel_cache_dir() / "baby_sgl_cpu_ops"
    build = tmp_path / "cache" / "kernels" / native.parent.name / native.name
    shutil.copytree(native, build)
    (build / "lock").touch()  # what the killed build left
    _load({**os.environ, "BABY_SGL_CACHE": str(tmp_path / "cache")}, timeout=300)
    assert not (build / "lock").exists()
