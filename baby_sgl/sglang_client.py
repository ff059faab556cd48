"""SGLang's frontend language (`sgl.function`, `gen`, `select`, ...) as a client of this server,
without SGLang's runtime: `pip install --no-deps sglang` installs the frontend, but `import sglang`
then fails on the runtime's imports (triton, a CUDA-built torch). `import_sglang()` imports it
without them:

    from baby_sgl.sglang_client import import_sglang

    sgl = import_sglang()
    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000", chat_template_name="chatml"))
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path


def import_sglang() -> types.ModuleType:
    """The `sglang` package, imported without its runtime. `import sglang` calls
    sglang.srt.utils.hf_transformers_patches.apply_all(); importing that module runs the package
    file sglang/srt/utils/__init__.py, which star-imports the server's utilities and with them
    torch and triton. The frontend needs neither: that package is registered as a bare module (its
    real directory as __path__, so its submodules still load) and the patches module as a stub
    whose apply_all does nothing (transformers stays unpatched). With SGLang fully installed,
    plain `import sglang` works as well."""
    if "sglang" in sys.modules:
        return sys.modules["sglang"]
    spec = importlib.util.find_spec("sglang")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed: pip install --no-deps sglang (its frontend only)")
    utils_dir = Path(next(iter(spec.submodule_search_locations))) / "srt" / "utils"
    utils = types.ModuleType("sglang.srt.utils")
    utils.__path__ = [str(utils_dir)]
    patches = types.ModuleType("sglang.srt.utils.hf_transformers_patches")
    patches.apply_all = lambda: None  # type: ignore[attr-defined]
    sys.modules.update({utils.__name__: utils, patches.__name__: patches})
    import sglang

    return sglang
