"""Shared fixtures: tiny random checkpoints built with transformers' config classes."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub

# The device the engines under test run on: cpu (the default) hides every GPU from this process and
# the servers and ranks it starts, so an engine's device "auto" is the CPU; cuda runs them on the GPU
# (`BABY_SGL_TEST_DEVICE=cuda python -m pytest`), skipping only the tests marked cpu_only.
TEST_DEVICE = os.environ.get("BABY_SGL_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import baby_sgl  # noqa: F401,E402  (before torch: baby_sgl/native_env.py)
import pytest  # noqa: E402
import torch  # noqa: E402

from baby_sgl.distributed.processes import end_without_collecting  # noqa: E402
from helpers import ARCHS, TINY_KW, build_for

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_configure(config):
    end_without_collecting()  # pytest and each worker end ~1 s sooner (baby_sgl/distributed/processes.py)
    if TEST_DEVICE not in ("cpu", "cuda"):
        pytest.exit(f"BABY_SGL_TEST_DEVICE must be cpu or cuda, got {TEST_DEVICE!r}", returncode=4)
    if TEST_DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.exit("BABY_SGL_TEST_DEVICE=cuda, but torch sees no CUDA device", returncode=4)


def pytest_collection_modifyitems(config, items):
    if TEST_DEVICE == "cpu":
        return
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker is not None:
            reason = marker.args[0] if marker.args else marker.kwargs.get("reason", "")
            item.add_marker(pytest.mark.skip(reason=f"CPU-only: {reason}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (CI=true) nothing may be skipped: every skip here is a missing tool (a C++ compiler
    for the CPU kernels, chromium for the dashboard), which scripts/setup.sh installs there."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI") == "true" and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if reason.startswith("CPU-only:"):  # BABY_SGL_TEST_DEVICE=cuda: skipped by design, not for a missing tool
            return
        report.outcome, report.longrepr = "failed", f"skipped in CI, where it must run: {reason}"



@pytest.fixture(scope="module", params=ARCHS)
def ops(request):
    """The CPU kernels built for each instruction set the tests cover (helpers.ARCHS)."""
    with pytest.MonkeyPatch.context() as mp:
        yield build_for(request.param, mp)


# Each family's tiny checkpoint: the config class, the model class and what it sets beyond TINY_KW.
# Qwen3: more query heads than hidden_size / head_dim (an explicit head_dim), q/k norms. The MoE
# families: 8 experts, 2 per token; Qwen3-MoE with a dense layer between MoE ones and without
# renormalised routing weights, Mixtral with them. Mistral: a sliding window of 16 positions.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": True, "num_attention_heads": 6,
                                                  "head_dim": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "tie_word_embeddings": False, "num_hidden_layers": 3, "mlp_only_layers": [1], "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": False}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"tie_word_embeddings": False, "num_local_experts": 8,
                                                        "num_experts_per_tok": 2, "intermediate_size": 64}),
    # A window shorter than most test prompts, so attention outside it must be left out.
    "mistral": ("MistralConfig", "MistralForCausalLM", {"tie_word_embeddings": False, "sliding_window": 16}),
    # Phi-3: fused qkv and gate_up in the checkpoint, a sliding window, and (as Phi-4-mini) rope on
    # half of each head.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {
        "tie_word_embeddings": False, "sliding_window": 24, "pad_token_id": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
    # Gemma 3: windowed layers (16) with a global one between, each kind its own rope (the global
    # one scaled), q/k norms, sandwich norms scaled by 1 + weight, GELU-tanh, the embedding scale,
    # an attention scale of its own and soft-capped logits.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "tie_word_embeddings": True, "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 16,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "query_pre_attn_scalar": 24, "final_logit_softcapping": 30.0, "pad_token_id": 0,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}),
}


def _save_tiny(path, kind: str, **overrides) -> str:
    import transformers
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    torch.manual_seed(0)
    config_cls, model_cls, extra = FAMILIES[kind]
    config = getattr(transformers, config_cls)(**(TINY_KW | extra | overrides), bos_token_id=1, eos_token_id=2)
    model = getattr(transformers, model_cls)(config)
    # Larger weights make the logits decisive, so greedy choices are not near-ties (the experts'
    # stacked matrices included, and the routers', so experts are not picked by a hair).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
            elif "q_norm" in name or "k_norm" in name:  # unlike ones, these show which norm went where
                p.normal_(1.0, 0.3)
    model.save_pretrained(path)
    # A byte-level BPE tokenizer with no merges: every byte is a token, so any text encodes.
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"])}
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    for ch in sorted(byte_chars):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    fast.save_pretrained(path)
    return str(path)


def _tiny(kind: str):
    """A session fixture: the family's tiny random checkpoint (a directory), built once."""

    @pytest.fixture(scope="session")
    def checkpoint(tmp_path_factory) -> str:
        return _save_tiny(tmp_path_factory.mktemp(f"tiny-{kind.replace('_', '-')}"), kind)

    return checkpoint


tiny_llama, tiny_qwen2, tiny_qwen3 = _tiny("llama"), _tiny("qwen2"), _tiny("qwen3")
tiny_qwen3_moe, tiny_mixtral, tiny_mistral = _tiny("qwen3_moe"), _tiny("mixtral"), _tiny("mistral")
tiny_phi3, tiny_gemma3 = _tiny("phi3"), _tiny("gemma3")


@pytest.fixture(scope="session")
def tiny_phi3_longrope(tmp_path_factory) -> str:
    """The tiny Phi-3 with longrope scaling: pre-trained context 64, served up to 1024 (so an
    attention factor of sqrt(1 + ln 16 / ln 64)), rope on half of each head."""
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.3, 1.7, 2.5], "long_factor": [1.0, 3.0, 9.0, 27.0],
                "original_max_position_embeddings": 64}
    return _save_tiny(tmp_path_factory.mktemp("tiny-phi3-longrope"), "phi3", rope_parameters=longrope,
                      original_max_position_embeddings=64)


@pytest.fixture(scope="session")
def tiny_llama_long(tmp_path_factory) -> str:
    """The tiny Llama with a 32k context, for tests that need a request still running seconds after
    it started: at ~0.2 ms a token, the 1024-token context of tiny_llama ends within a fraction of
    a second."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama-long"), "llama", max_position_embeddings=32768)


@pytest.fixture(scope="session")
def wide_llama(tmp_path_factory) -> str:
    """The tiny Llama with rows of 256 and 512 values: whole K-quant super-blocks."""
    return _save_tiny(tmp_path_factory.mktemp("wide-llama"), "llama", hidden_size=256, intermediate_size=512)


@pytest.fixture(scope="session")
def wide_qwen2(tmp_path_factory) -> str:
    """The same shapes with the embedding tied to the output head."""
    return _save_tiny(tmp_path_factory.mktemp("wide-qwen2"), "qwen2", hidden_size=256, intermediate_size=512)


@pytest.fixture(scope="session")
def tiny_llama_head64(tmp_path_factory) -> str:
    """The tiny Llama with heads of 64 values (as SmolLM2's and most small models'), where a KV
    pool of 1-byte elements holds ~2x the tokens of bfloat16 (a 16-value head's scale costs a fifth)."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama-head64"), "llama", head_dim=64)


@pytest.fixture(scope="module")
def _tiny_engine(tiny_llama):
    from baby_sgl import Engine

    with Engine(tiny_llama, dtype="float32", max_total_tokens=4096) as eng:
        yield eng


@pytest.fixture
def engine(_tiny_engine):
    """A shared engine on the tiny Llama; the memory invariant is checked after each test."""
    yield _tiny_engine
    _tiny_engine.check_memory()


@pytest.fixture(scope="session")
def deep_llama(tmp_path_factory) -> str:
    """The tiny Llama with 32 layers: ~260 barriers a decode step, as a real model's."""
    return _save_tiny(tmp_path_factory.mktemp("deep-llama"), "llama", num_hidden_layers=32)
