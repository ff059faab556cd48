"""--enable-mixed-chunk: a long prompt is prefilled in chunks that share every pass with the
running requests' decode steps, so their streams never wait for the whole prompt."""

from __future__ import annotations

import pytest

from baby_sgl import Engine
from helpers import GREEDY, random_prompts

SHORT = random_prompts(3, 512, 4, 6, seed=3)
LONG = random_prompts(1, 512, 300, 301, seed=4)[0]


def _run_and_record(path: str, **config) -> tuple[list[dict], list[tuple[str, int, int]]]:
    """Outputs, and each pass as (mode, extend tokens, decoding requests)."""
    with Engine(path, dtype="float32", page_size=4, debug_memory_check=True, **config) as engine:
        runner, passes = engine.runner, []
        real_forward = runner.forward

        def recording_forward(b):
            decoding = b.num_decode_reqs if b.mode.name == "MIXED" else len(b.seq_lens) * (b.mode.name == "DECODE")
            passes.append((b.mode.name, len(b.input_ids) - decoding, decoding))
            return real_forward(b)

        runner.forward = recording_forward
        params = [{**GREEDY, "max_new_tokens": 40}] * 3 + [{**GREEDY, "max_new_tokens": 4}]
        outs = engine.generate(input_ids=SHORT + [LONG], sampling_params=params)
        engine.check_memory()
    return outs, passes


def test_running_requests_decode_in_every_pass_of_a_long_prefill(tiny_llama):
    outs, passes = _run_and_record(tiny_llama, enable_mixed_chunk=True, chunked_prefill_size=16)
    # After the first pass (short prompts first) every pass until the long prompt is in carries
    # a decode step of the requests already running, all within the 16-token budget.
    assert passes[0][0] == "EXTEND"
    prefill = passes[1 : 1 + sum(1 for mode, _, _ in passes[1:] if mode == "MIXED")]
    assert sum(ext for _, ext, _ in passes[:1 + len(prefill)]) == sum(map(len, SHORT)) + len(LONG)
    assert len(prefill) > len(LONG) // 16
    assert all(mode == "MIXED" and dec >= 2 and ext + dec <= 16 for mode, ext, dec in prefill)
    assert [dec for _, _, dec in prefill[1:]] == [3] * (len(prefill) - 1)
    assert passes[1 + len(prefill)][0] == "DECODE"
    # Same tokens as without mixing (where the short ones wait for the whole prompt).
    plain, plain_passes = _run_and_record(tiny_llama, chunked_prefill_size=16)
    assert "MIXED" not in {mode for mode, _, _ in plain_passes}
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]


def test_mixing_needs_chunked_prefill(tiny_llama):
    _, passes = _run_and_record(tiny_llama, enable_mixed_chunk=True, chunked_prefill_size=-1)
    assert "MIXED" not in {mode for mode, _, _ in passes}


@pytest.mark.cpu_only("the CPU's default prefill chunk")
def test_cpu_default_chunk_is_small_only_when_mixing(tiny_llama):
    with Engine(tiny_llama, dtype="float32", enable_mixed_chunk=True) as engine:
        assert engine.engine_args.chunked_prefill_size == 64
    with Engine(tiny_llama, dtype="float32") as engine:
        assert engine.engine_args.chunked_prefill_size == 2048
