"""SGLang's LoRA surface over HTTP: adapters loaded, used, unloaded and loaded again while requests
stream (an unload waits for its adapter's requests; nothing is lost), lora_path on /generate, the
model's adapter part on the OpenAI and Anthropic routes, /v1/models listing the adapters, and bad
adapters or names refused with a 400 naming the problem while the server goes on."""

from __future__ import annotations

import json
import threading

import anthropic
import httpx
import openai
import pytest
from safetensors.torch import load_file, save_file

from baby_sgl import Engine
from entrypoints.conftest import serve_checked, wait_idle
from helpers import GREEDY, random_prompts
from peft_adapters import ATTENTION, EVERY, AdapterSpec, make_adapter, peft_greedy

MAX_NEW = 8
PROMPTS = random_prompts(4, 512, 5, 20, seed=21)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    made = {"s0": make_adapter(tiny_llama, root / "s0", AdapterSpec(8, 16, tuple(EVERY)), 31),
            "s1": make_adapter(tiny_llama, root / "s1", AdapterSpec(4, 4, tuple(ATTENTION)), 32),
            "big": make_adapter(tiny_llama, root / "big", AdapterSpec(16, 16, tuple(ATTENTION)), 33),
            "head": make_adapter(tiny_llama, root / "head", AdapterSpec(4, 8, ("q_proj", "lm_head")), 34)}
    bad_shape = root / "bad_shape"
    bad_shape.mkdir()
    (bad_shape / "adapter_config.json").write_text((root / "s1" / "adapter_config.json").read_text())
    weights = load_file(root / "s1" / "adapter_model.safetensors")
    key = next(k for k in weights if "layers.0.self_attn.q_proj.lora_B" in k)
    weights[key] = weights[key][:-1]
    save_file(weights, bad_shape / "adapter_model.safetensors")
    return made | {"bad_shape": str(bad_shape), "missing": str(root / "nowhere")}


@pytest.fixture(scope="module")
def expected(tiny_llama, adapters):
    return {n: peft_greedy(tiny_llama, None if n is None else adapters[n], PROMPTS, MAX_NEW) for n in (None, "s0", "s1")}


@pytest.fixture(scope="module")
def server(tiny_llama, adapters):
    engine = Engine(tiny_llama, dtype="float32", lora_paths=[f"s0={adapters['s0']}"], max_lora_rank=8,
                    max_loaded_loras=2, max_loras_per_batch=2)
    with serve_checked(engine) as base:
        yield base


def generate(server: str, prompt: list[int], lora_path: str | None) -> httpx.Response:
    body = {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": MAX_NEW}, "lora_path": lora_path}
    return httpx.post(server + "/generate", json=body, timeout=60)


def stream_ids(server: str, prompt: list[int], lora_path: str | None,
               started: threading.Event | None = None) -> list[int] | str:
    """A streamed /generate's final output ids (its error text if refused); started is set once
    its first piece came, so the request is in the scheduler."""
    body = {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": MAX_NEW}, "lora_path": lora_path,
            "stream": True}
    last = None
    with httpx.stream("POST", server + "/generate", json=body, timeout=60) as r:
        if r.status_code != 200:
            return r.read().decode()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line.removeprefix("data: "))
                if started is not None:
                    started.set()
    assert last is not None
    return last["output_ids"]


def test_load_use_unload_reload_while_requests_stream(server, adapters, expected):
    """A loop of streamed requests with s0 and the base model runs throughout, while s1 is loaded,
    used, unloaded (the call waits for s1's running requests) and loaded again, twice: every
    request ends with PEFT's ids, and after the unload s1 is refused by name."""
    done = threading.Event()
    results: list[tuple[str | None, int, list[int] | str]] = []

    def loop() -> None:
        i = 0
        while not done.is_set():
            name = ("s0", None)[i % 2]
            results.append((name, i % 4, stream_ids(server, PROMPTS[i % 4], name)))
            i += 1

    background = threading.Thread(target=loop)
    background.start()
    try:
        for _ in range(2):
            r = httpx.post(server + "/load_lora_adapter", json={"lora_name": "s1", "lora_path": adapters["s1"]})
            assert r.status_code == 200 and r.json()["loaded_adapters"].keys() == {"s0", "s1"}, r.text
            started = [threading.Event() for _ in range(4)]
            users = [threading.Thread(target=lambda k=k, e=e: results.append(("s1", k, stream_ids(
                server, PROMPTS[k], "s1", e)))) for k, e in enumerate(started)]
            for t in users:
                t.start()
            for e in started:
                assert e.wait(60), "an s1 request never started"
            r = httpx.post(server + "/unload_lora_adapter", json={"lora_name": "s1"}, timeout=60)
            assert r.status_code == 200 and r.json()["loaded_adapters"].keys() == {"s0"}, r.text
            for t in users:
                t.join()
            refused = generate(server, PROMPTS[0], "s1")
            assert refused.status_code == 400 and "unknown LoRA adapter 's1'" in refused.json()["error"]["message"]
    finally:
        done.set()
        background.join()
    assert {name for name, _, _ in results} == {"s0", "s1", None}
    for name, k, ids in results:
        assert ids == expected[name][k], f"{name} prompt {k}: {ids}"
    wait_idle(server)


@pytest.mark.parametrize("name, problem", [("missing", "not found"), ("big", "rank 16 is above --max-lora-rank 8"),
                                           ("head", "target module 'lm_head' is not supported"),
                                           ("bad_shape", "lora_B (63, 4)")])
def test_a_bad_adapter_is_refused_naming_the_problem(server, adapters, name, problem):
    r = httpx.post(server + "/load_lora_adapter", json={"lora_name": name, "lora_path": adapters[name]})
    assert r.status_code == 400 and problem in r.json()["error"]["message"] and repr(name) in r.text, r.text
    assert generate(server, PROMPTS[0], "s0").status_code == 200  # the server goes on


def test_unknown_names_and_the_loaded_limit(server, adapters):
    r = generate(server, PROMPTS[0], "nope")
    assert r.status_code == 400 and "unknown LoRA adapter 'nope'" in r.text
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="unknown LoRA adapter 'nope'"):
        client.completions.create(model="tiny:nope", prompt=PROMPTS[0], max_tokens=2)
    r = httpx.post(server + "/load_lora_adapter", json={"lora_name": "s0", "lora_path": adapters["s0"]})
    assert r.status_code == 400 and "already loaded" in r.text
    assert httpx.post(server + "/load_lora_adapter", json={"lora_name": "x", "lora_path": adapters["s1"]}).status_code == 200
    r = httpx.post(server + "/load_lora_adapter", json={"lora_name": "y", "lora_path": adapters["s1"]})
    assert r.status_code == 400 and "--max-loaded-loras 2" in r.text
    # Both checked before the file is read (before: engine.py read and fused the whole adapter
    # first, so a full server still took a copy of each file in memory): a path that does not
    # exist is never looked at.
    for name, problem in (("y", "--max-loaded-loras 2"), ("s0", "already loaded")):
        r = httpx.post(server + "/load_lora_adapter", json={"lora_name": name, "lora_path": "/no/such/adapter"})
        assert r.status_code == 400 and problem in r.text, r.text
    assert httpx.post(server + "/unload_lora_adapter", json={"lora_name": "x"}).status_code == 200
    r = httpx.post(server + "/unload_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400 and "unknown LoRA adapter 'x'" in r.text


def test_openai_and_anthropic_models_name_the_adapter(server, expected):
    """model "adapter" or "base:adapter" runs the adapter; the base model's name runs the base;
    /v1/models lists the adapters with their parent."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    models = {m.id: m for m in client.models.list().data}
    assert "s0" in models and models["s0"].model_extra["parent"] in models
    text = {n: generate(server, PROMPTS[1], n).json()["text"] for n in ("s0", None)}
    for model, name in (("s0", "s0"), ("base:s0", "s0"), ("whatever", None)):
        out = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=MAX_NEW, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == text[name], model
    msg = anthropic.Anthropic(base_url=server, api_key="none").messages.create(
        model="base:s0", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert msg.model == "base:s0" and msg.content
