"""Faults injected into the scheduler: one request's failure ends that request alone, a failed
forward pass ends its batch, and neither leaks a KV slot or a request row."""

from __future__ import annotations

import pytest

from baby_sgl import Engine
from baby_sgl.errors import EngineDeadError
from baby_sgl.managers.scheduler.memory import KVMemory
from baby_sgl.sampling.sampler import Sampler
from helpers import GREEDY, random_prompts

PROMPTS = random_prompts(6, 512, 5, 40, seed=7)
POISON = [9, 8, 7, 6, 5, 4, 3]
# The poisoned prompt's seed marks its rows for the sampler (greedy decoding draws nothing with it).
POISON_SEED = 987654


def _run(engine: Engine, prompts: list[list[int]], max_new_tokens: int = 12) -> list[dict]:
    params = [{**GREEDY, "max_new_tokens": max_new_tokens} | ({"seed": POISON_SEED} if p == POISON else {})
              for p in prompts]
    return engine.generate(input_ids=prompts, sampling_params=params)


def _poisoned(after: int):
    """Sampler.sample, raising whenever the poisoned prompt is among the rows it is asked to
    sample, after `after` successful steps of that request."""
    real = Sampler.sample

    def sample(self, logits, batch):
        if any(p.seed == POISON_SEED and n >= after for p, n in zip(batch.params, batch.num_output)):
            raise RuntimeError("injected sampling fault")
        return real(self, logits, batch)

    return sample


@pytest.mark.parametrize("config", [{}, {"page_size": 16}, {"disable_radix_cache": True, "page_size": 4}])
@pytest.mark.parametrize("after", [0, 3])  # in its prefill, or in the middle of decoding
def test_sampling_fault_ends_only_that_request(tiny_llama, config, after, monkeypatch):
    with Engine(tiny_llama, dtype="float32", debug_memory_check=True, **config) as engine:
        clean = _run(engine, PROMPTS)
        engine.flush_cache()
        monkeypatch.setattr(Sampler, "sample", _poisoned(after))
        outs = _run(engine, PROMPTS[:3] + [POISON] + PROMPTS[3:])
        bad = outs.pop(3)
        assert bad["meta_info"]["finish_reason"]["type"] == "abort"
        assert "injected sampling fault" in bad["meta_info"]["finish_reason"]["message"]
        assert len(bad["output_ids"]) == after
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in clean]
        assert engine.get_server_info()["num_failed_reqs"] == 1
        engine.check_memory()
        # The engine keeps serving, the poisoned prompt included once the fault is gone.
        monkeypatch.undo()
        assert _run(engine, [POISON], 4)[0]["meta_info"]["finish_reason"]["type"] == "length"
        engine.check_memory()


@pytest.mark.parametrize("config", [{}, {"page_size": 16, "chunked_prefill_size": 16},
                                    {"page_size": 4, "chunked_prefill_size": 8, "enable_mixed_chunk": True}])
def test_forward_fault_ends_its_batch_and_frees_its_slots(tiny_llama, config):
    with Engine(tiny_llama, dtype="float32", debug_memory_check=True, **config) as engine:
        runner = engine.runner
        real_forward, calls = runner.forward, []
        fail_on = "MIXED" if config.get("enable_mixed_chunk") else None

        def flaky_forward(batch):
            calls.append(batch.mode.name)
            # A pass after the prompts' slots were allocated; with mixing, the first mixed pass.
            if (calls.count(fail_on) == 1 and calls[-1] == fail_on) if fail_on else len(calls) == 3:
                raise RuntimeError("injected forward fault")
            return real_forward(batch)

        runner.forward = flaky_forward
        outs = _run(engine, PROMPTS, 8)
        runner.forward = real_forward
        assert fail_on is None or fail_on in calls
        aborted = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "abort"]
        assert aborted and all("injected forward fault" in o["meta_info"]["finish_reason"]["message"] for o in aborted)
        engine.check_memory()
        again = _run(engine, PROMPTS, 8)
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in again)
        engine.check_memory()


def test_a_failing_output_callback_aborts_its_own_request(engine):
    def broken(_chunk):
        raise RuntimeError("consumer bug")

    engine.submit(input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 50}, on_output=broken,
                  stream=True)
    outs = _run(engine, PROMPTS[1:3], 6)
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)


def test_a_dead_scheduler_fails_waiters_instead_of_hanging(tiny_llama):
    class Fatal(BaseException):
        pass

    engine = Engine(tiny_llama, dtype="float32")
    deaths = []
    engine.on_death(deaths.append)

    def die():
        raise Fatal("injected")

    engine.scheduler.step = die
    with pytest.raises(EngineDeadError):
        _run(engine, PROMPTS[:2])
    assert not engine.is_alive() and isinstance(deaths[0], Fatal)
    with pytest.raises(EngineDeadError):
        engine.get_server_info()
    with pytest.raises(EngineDeadError):
        engine.generate(input_ids=PROMPTS[0])
    engine.shutdown()


def test_a_request_that_finished_in_a_failed_step_keeps_its_result(tiny_llama, monkeypatch):
    """A failure found after a step (here the memory check) fails what is still in flight;
    a request that finished in that step was already answered and must stay as it was."""
    calls = []

    real = KVMemory.check

    def failing_once(memory, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise AssertionError("injected memory check failure")
        return real(memory, *args, **kwargs)

    monkeypatch.setattr(KVMemory, "check", failing_once)
    with Engine(tiny_llama, dtype="float32", debug_memory_check=True) as engine:
        done, running = engine.generate(input_ids=PROMPTS[:2], sampling_params=[
            {**GREEDY, "max_new_tokens": 1}, {**GREEDY, "max_new_tokens": 50}])
        assert done["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
        assert running["meta_info"]["finish_reason"]["type"] == "abort"
        assert engine.get_server_info()["num_failed_reqs"] == 1
        engine.check_memory()
