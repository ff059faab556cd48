"""The few model hyper-parameters the engine needs, read from a Hugging Face config dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: list[int]
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's queries and keys before rope
    # Mixture-of-experts: experts per MoE layer (0: every MLP dense), experts each token is routed
    # to, each expert's hidden size, whether the top-k routing weights are renormalised to sum to
    # one (Mixtral always; Qwen3-MoE as its config says), and which layers are MoE.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    # Attention over the last sliding_window positions only (Mistral, Phi-3); None: over everything.
    sliding_window: int | None = None
    rotary_dim: int = 0  # rope on the first rotary_dim values of each head (Phi-4-mini: 3/4); 0: all

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        heads = cfg["num_attention_heads"]
        # transformers 5 moved rope settings into "rope_parameters"; accept both spellings.
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = cfg.get("eos_token_id")
        layers = cfg["num_hidden_layers"]
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        dense_layers = set(cfg.get("mlp_only_layers") or [])
        step = cfg.get("decoder_sparse_step") or 1
        moe_layers = tuple(i for i in range(layers) if experts and i not in dense_layers and (i + 1) % step == 0)
        # Qwen2/Qwen3 configs carry a sliding_window that applies only with use_sliding_window.
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        partial = cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases; Llama only when attention_bias is set.
            attention_bias=arch == "Qwen2ForCausalLM" or cfg.get("attention_bias", False),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            num_experts=experts if moe_layers else 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
            # Mixtral names its experts' size intermediate_size (it has no dense MLP).
            moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
            norm_topk_prob=cfg.get("norm_topk_prob", True) if arch == "Qwen3MoeForCausalLM" else True,
            moe_layers=moe_layers,
            sliding_window=window or None,
            rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
        )
