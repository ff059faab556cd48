"""SGLang's own test programs (the installed sglang package's sglang/test/test_programs.py, the
module SGLang's CI runs against its server) run against a server at BASE_URL through
`sgl.RuntimeEndpoint`; prints one JSON object: for each program asked for, whether it passed and,
if not, the error.

    python sglang_test_programs.py BASE_URL NAME[=KWARGS_JSON] ...

A program also fails when the frontend's executor caught an error (it reports those as warnings
and goes on) or when one of its HTTP requests was not answered 200; each result lists the paths
its program requested and the lines of each streamed answer.

Two imports of that module reach into SGLang's server package, which the frontend does not need
and which is installed without its dependencies: `is_hip` (is the GPU an AMD one; no) and, in
test_gen_min_new_tokens, SGLang's tokenizer loader, stood in for by transformers' AutoTokenizer
(a .gguf path loads the tokenizer the file holds, as SGLang's loader does: transformers' conversion
of it, which the engine has cached). That program also reads the backend as an `sgl.Runtime`,
which holds its RuntimeEndpoint as `.endpoint`: the endpoint is given itself under that name.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import traceback
import types
import warnings

from frontend_programs import record_http

from baby_sgl.sglang_client import import_sglang


def stand_ins() -> None:
    utils = sys.modules["sglang.srt.utils"]  # the bare package import_sglang registered
    utils.is_hip = lambda: False
    loader = types.ModuleType("sglang.srt.utils.hf_transformers_utils")

    def get_tokenizer(path: str, **kwargs):
        from transformers import AutoTokenizer

        from baby_sgl.model_loader.gguf_loader import converted_tokenizer

        if path.endswith(".gguf"):  # the file's tokenizer, as transformers converts it (once: cached)
            path = converted_tokenizer(path)
        return AutoTokenizer.from_pretrained(path, **kwargs)

    loader.get_tokenizer = get_tokenizer
    sys.modules[loader.__name__] = loader


def main() -> None:
    sgl = import_sglang()
    stand_ins()
    from sglang.test import test_programs

    wire: list[dict] = []
    record_http(wire)
    backend = sgl.RuntimeEndpoint(sys.argv[1])
    backend.endpoint = backend
    sgl.set_default_backend(backend)
    results = {}
    for arg in sys.argv[2:]:
        name, _, kwargs = arg.partition("=")
        t0, start = time.perf_counter(), len(wire)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with contextlib.redirect_stdout(sys.stderr):  # stdout holds our report only
                    getattr(test_programs, name)(**json.loads(kwargs or "{}"))
                error = None
            except Exception as e:  # the program's assertion or any error on the way
                error = f"{e!r}"[:2000] + "\n" + traceback.format_exc()[-4000:]
        executor_errors = [str(w.message)[-4000:] for w in caught if "Error in stream_executor" in str(w.message)]
        exchanges = wire[start:]
        refused = [(e["path"], e["status"], e.get("response")) for e in exchanges if e["status"] != 200]
        results[name] = {"passed": error is None and not executor_errors and not refused, "error": error,
                         "executor_errors": executor_errors, "refused": refused,
                         "paths": [e["path"] for e in exchanges], "seconds": round(time.perf_counter() - t0, 2),
                         "streams": [e["events"] for e in exchanges if e["stream"]]}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
