"""Helpers shared by the tests."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import os
import platform
import random
import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

TINY_KW = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)

GREEDY = {"temperature": 0, "ignore_eos": True}


def sglang_package_dir() -> Path:
    """Where the installed sglang package lives (found, never imported). If it is not installed
    the calling test (or its module, when called at import) is skipped with the reason, or fails
    in CI."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        reason = "SGLang's package is not installed (scripts/setup.sh installs it without its dependencies)"
        if os.environ.get("CI") == "true":  # where nothing may be skipped (conftest.py): an error
            raise RuntimeError(reason)
        pytest.skip(reason, allow_module_level=True)
    return Path(next(iter(spec.submodule_search_locations)))


def wait_until(condition: Callable[[], object], what: str, timeout: float = 60.0, interval: float = 0.02):
    """Polls condition() until it is true and returns its value; fails naming `what` if it never
    is. The timeout only bounds a failure: no test passes or fails by how fast something is."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(interval)
    return value


async def wait_until_async(condition: Callable[[], object], what: str, timeout: float = 60.0,
                           interval: float = 0.02):
    """wait_until inside an event loop: condition() may return an awaitable, which is awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        await asyncio.sleep(interval)


def hold_submissions(engine, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Makes engine.submit wait, as tokenizing a long prompt does: returns (submitting, release),
    the first set once a submission has begun, which then waits for the second."""
    submitting, release = threading.Event(), threading.Event()
    real_submit = engine.submit

    def slow_submit(**kwargs):
        submitting.set()
        assert release.wait(30)
        return real_submit(**kwargs)

    monkeypatch.setattr(engine, "submit", slow_submit)
    return submitting, release


# Every setting the engine must be exact under (invariant 6).
CONFIGS = {
    "radix": {},
    "no-radix": {"disable_radix_cache": True},
    "page16": {"page_size": 16},
    "chunked": {"chunked_prefill_size": 16, "page_size": 4, "debug_memory_check": True},
    "retract": {"max_total_tokens": 320, "page_size": 4, "schedule_conservativeness": 0.0,
                "debug_memory_check": True},
    "retract-page1-lpm": {"max_total_tokens": 256, "schedule_policy": "lpm"},
    # Decode batches of up to 4 run the compiled graphs (padded to 1, 2, 4), larger ones eager.
    "compile": {"enable_torch_compile": True, "torch_compile_max_bs": 4, "page_size": 4},
    "compile-chunked-retract": {"enable_torch_compile": True, "torch_compile_max_bs": 4, "chunked_prefill_size": 16,
                                "page_size": 4, "max_total_tokens": 320, "schedule_conservativeness": 0.0,
                                "debug_memory_check": True},
    # Prefill chunks share passes with running decodes (--enable-mixed-chunk).
    "mixed-chunk": {"enable_mixed_chunk": True, "chunked_prefill_size": 16, "page_size": 4, "debug_memory_check": True},
    "mixed-chunk-retract": {"enable_mixed_chunk": True, "chunked_prefill_size": 16, "max_total_tokens": 320,
                            "schedule_conservativeness": 0.0, "debug_memory_check": True},
    # Speculative decoding (n-gram drafts verified in one pass); at most 6 running requests, so
    # that every decode pass may draft (managers/scheduler/speculation.py: MAX_SPEC_REQUESTS).
    "spec-ngram": {"speculative_algorithm": "NGRAM", "max_running_requests": 6, "debug_memory_check": True},
    "spec-ngram-page4-chunked-retract": {"speculative_algorithm": "NGRAM", "max_running_requests": 6, "page_size": 4,
                                         "chunked_prefill_size": 16, "max_total_tokens": 320,
                                         "schedule_conservativeness": 0.0, "debug_memory_check": True},
    "spec-ngram-mixed-no-radix": {"speculative_algorithm": "NGRAM", "max_running_requests": 6,
                                  "speculative_ngram_min_match_window_size": 1, "enable_mixed_chunk": True,
                                  "chunked_prefill_size": 16, "disable_radix_cache": True,
                                  "debug_memory_check": True},
}


def assert_setting_exercised(engine, config: str, prompts: list[list[int]], first: list[dict],
                             second: list[dict]) -> None:
    """What the setting CONFIGS[config] is there for happened in two rounds of the same prompts:
    retraction (each counted on its request), prefill chunks sharing passes with decodes, drafts
    verified (and accepted in the second round, drafted from the first's text in the cache), and
    the second round's prompts found in the radix cache, a page at a time."""
    settings, info = CONFIGS[config], engine.get_server_info()
    if "retract" in config:
        assert info["num_retractions"] > 0, "the small pool was meant to force retraction"
        per_request = sum(o["meta_info"]["num_retractions"] for o in first + second)
        assert per_request == info["num_retractions"], "each retraction is counted on its request"
    if settings.get("enable_mixed_chunk"):
        assert info["mixed_steps"] > 0, "prefill chunks were meant to share passes with decodes"
    if settings.get("speculative_algorithm"):
        assert info["spec_verify_steps"] > 0, "drafts were meant to be verified"
        if not settings.get("disable_radix_cache"):
            assert info["spec_accepted_tokens"] > 0, "drafts from the cache's text were meant to be accepted"
    if not settings.get("disable_radix_cache") and "retract" not in config:
        page = settings.get("page_size", 1)
        for p, out in zip(prompts, second):
            assert out["meta_info"]["cached_tokens"] >= (len(p) - 1) // page * page


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def shared_prefix_prompts(n: int, vocab: int, prefix_len: int, seed: int = 1) -> list[list[int]]:
    """Prompts sharing a long prefix: they exercise the cache within one batch and across batches."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def hf_greedy(model, prompts_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy output ids, one prompt at a time (no padding effects)."""
    outs = []
    for ids in prompts_ids:
        x = torch.tensor([ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens)
        outs.append(y[0, len(ids):].tolist())
    return outs


def assert_first_step_logprobs(engine, hf, prompts: list[list[int]], top: int) -> None:
    """The engine's top logprobs of each prompt's first output token are transformers' within 1e-4;
    then the memory invariant."""
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 1}, top_logprobs_num=top)
    for p, out in zip(prompts, outs):
        ref = torch.log_softmax(hf(torch.tensor([p])).logits[0, -1].float(), dim=-1)
        for logprob, token, _ in out["meta_info"]["output_top_logprobs"][0]:
            assert abs(logprob - ref[token].item()) < 1e-4
    engine.check_memory()


def _kernel_isa(arch: str) -> frozenset[str] | None:
    """The instruction-set macros the CPU kernels' sources test (#if defined(__AVX2__), ...) that
    the compiler defines for -march=arch; None without a compiler."""
    from baby_sgl.cpu import toolchain

    cxx = toolchain.cxx_compiler()
    if cxx is None:
        return None
    csrc = Path(toolchain.__file__).parent / "csrc"
    tested = {m for f in csrc.iterdir() for m in re.findall(r"defined\((__\w+__)\)", f.read_text())}
    out = subprocess.run([cxx, f"-march={arch}", "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True,
                         text=True, check=True).stdout
    defined = {words[1] for words in map(str.split, out.splitlines()) if len(words) > 1}
    return frozenset(defined & tested)


def _archs() -> list[str]:
    """Instruction sets the CPU kernels are built for in the tests: this CPU's, and on x86 also
    AVX2 (x86-64-v3) and no SIMD at all (x86-64), so every path runs whatever the machine. Where
    this CPU's build compiles the same paths as the AVX2 one (an AVX2-only CPU: the kernels test
    the same macros), the AVX2 build would run them twice and is left out."""
    if platform.machine() != "x86_64":
        return ["native"]
    native = _kernel_isa("native")
    return ["native", "x86-64"] if native is not None and native == _kernel_isa("x86-64-v3") else \
        ["native", "x86-64-v3", "x86-64"]


ARCHS = _archs()


def build_for(arch: str, monkeypatch, kernels: str = "ops"):
    """The CPU kernels built for arch (cached per arch in ~/.cache/baby-sgl/kernels) and made the
    ones the engine uses, or a skip without a compiler. kernels: cpu/ops.py's, or
    "decode_attention" (cpu/decode_attention.py's)."""
    from baby_sgl.cpu import decode_attention, ops as cpu_ops, toolchain

    module = decode_attention if kernels == "decode_attention" else cpu_ops
    monkeypatch.setenv("BABY_SGL_CPU_ARCH", arch)
    monkeypatch.setattr(module, "_loaded", {})
    built = decode_attention.decode_kernel() if module is decode_attention else cpu_ops.cpu_ops()
    if built is None:
        if toolchain.cxx_compiler() is not None:
            pytest.fail(f"the CPU kernels failed to build for {arch} (see the log)")
        pytest.skip("no C++ compiler: the portable path is tested by the engine tests")
    return built


def decode_forward_batch(rows: list[list[int]], pool, kernel: bool, group: int):
    """A decode batch over `pool` whose request i attends to the slots rows[i] (its last is the new
    token), with the attention backend (our CPU kernel, or the portable path) set up for it."""
    from baby_sgl.attention.torch_native import TorchNativeAttnBackend
    from baby_sgl.core.forward_batch import ForwardBatch, ForwardMode
    from baby_sgl.core.memory_pool import ReqToTokenPool

    cpu = torch.device("cpu")
    req_pool = ReqToTokenPool(len(rows), max(2048, max(map(len, rows))), cpu)
    for i, r in enumerate(rows):
        req_pool.write(i, 0, torch.tensor(r, device=cpu))
    backend = TorchNativeAttnBackend(cpu if kernel else None, group)
    lens = [len(r) for r in rows]
    fb = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.zeros(len(rows), dtype=torch.long, device=cpu),
        positions=torch.tensor([n - 1 for n in lens], device=cpu),
        out_cache_loc=torch.tensor([r[-1] for r in rows], device=cpu),
        req_pool_indices=torch.arange(len(rows), device=cpu), seq_lens=torch.tensor(lens, device=cpu),
        req_to_token_pool=req_pool, kv_pool=pool, attn_backend=backend, seq_lens_cpu=lens,
    )
    backend.init_forward_metadata(fb)
    return backend, fb


def scattered_extend_requests(g: torch.Generator, slots: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """Three prefill requests over a pool of `slots`: no prefix, a 70-slot cached prefix, one new
    token after 33 (a decode-like row); their slots scattered and not in order. Returns the
    request-to-slot rows [3, 128], the prefix lengths and the new-token counts."""
    prefix_lens, extend_lens = [0, 70, 33], [45, 40, 1]
    perm = torch.randperm(slots, generator=g)
    rows = torch.zeros(3, 128, dtype=torch.long)
    used = 0
    for r, n in enumerate(p + e for p, e in zip(prefix_lens, extend_lens)):
        rows[r, :n] = perm[used : used + n]
        used += n
    return rows, prefix_lens, extend_lens


# Measured on the default model's 16 questions (bfloat16 weights, KV and activations against
# float32): 15 of 16 first tokens and 14 of 16 second ones agreed, each other one at a float32
# near-tie (top two 0.06 and 0.14 nats apart); the chosen token's log-probability moved by at
# most 0.16 nats.
BF16_MAX_LOGPROB_DIFF = 0.3
BF16_MIN_AGREEMENT = 0.8


def assert_bfloat16_close(outs: list[dict], ref: list[dict], tokens: int) -> None:
    """bfloat16 outputs (with logprobs) against float32's (with the top two logprobs), on each of
    the first `tokens` tokens where the contexts still agree: the token's logprob within
    BF16_MAX_LOGPROB_DIFF, a different token only where float32's own top two are that close (a
    near-tie), and at least BF16_MIN_AGREEMENT of the outputs agreeing."""
    for token in range(tokens):
        same_context = [(o, r) for o, r in zip(outs, ref) if o["output_ids"][:token] == r["output_ids"][:token]]
        agree = [o["output_ids"][token] == r["output_ids"][token] for o, r in same_context]
        for (_, r), ok in zip(same_context, agree):
            top = r["meta_info"]["output_top_logprobs"][token]
            assert ok or top[0][0] - top[1][0] <= BF16_MAX_LOGPROB_DIFF, f"bfloat16 left a clear float32 choice: {top}"
        diffs = [abs(o["meta_info"]["output_token_logprobs"][token][0] - r["meta_info"]["output_token_logprobs"][token][0])
                 for (o, r), ok in zip(same_context, agree) if ok]
        print(f"bf16 vs fp32, token {token}: agreement {sum(agree)}/{len(agree)}, max logprob difference {max(diffs):.3f}")
        assert sum(agree) >= BF16_MIN_AGREEMENT * len(outs)
        assert max(diffs) <= BF16_MAX_LOGPROB_DIFF
