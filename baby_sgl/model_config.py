"""The few model hyper-parameters the engine needs, read from a Hugging Face config dict."""

from __future__ import annotations

import math
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
    sliding_layers: tuple[int, ...] = ()  # the layers that attend over the window (all of Mistral's)
    # Gemma 3: the windowed layers' own rope base and scaling, norms scaled by 1 + weight, the
    # embeddings times sqrt(hidden_size), a GELU-tanh MLP, norms after attention and around the MLP
    # too, query_pre_attn_scalar ** -0.5 as the attention scale, logits soft-capped.
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = None
    norm_offset: bool = False
    embed_scale: float = 1.0
    hidden_act: str = "silu"
    sandwich_norms: bool = False
    attn_scale: float | None = None
    final_logit_softcap: float | None = None

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], context_length: int | None = None) -> ModelConfig:
        """context_length: the longest sequence served (--context-length; None: the model's), which
        picks Phi-3's longrope factors."""
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        layers = cfg["num_hidden_layers"]
        eos = cfg.get("eos_token_id")
        # Qwen2/Qwen3 configs carry a sliding_window that applies only with use_sliding_window.
        window = (cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None) or None
        common: dict[str, Any] = dict(
            architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=layers, num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            sliding_window=window)
        if arch == "Gemma3ForCausalLM":
            return cls(**common, **cls._gemma3(cfg, head_dim, layers, window))
        # transformers 5 moved rope settings into "rope_parameters"; accept both spellings.
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
            scaling = cls._longrope(cfg, scaling, context_length)
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        dense_layers = set(cfg.get("mlp_only_layers") or [])
        step = cfg.get("decoder_sparse_step") or 1
        moe_layers = tuple(i for i in range(layers) if experts and i not in dense_layers and (i + 1) % step == 0)
        partial = cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
        return cls(
            **common,
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases; Llama only when attention_bias is set.
            attention_bias=arch == "Qwen2ForCausalLM" or cfg.get("attention_bias", False),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            num_experts=experts if moe_layers else 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
            # Mixtral names its experts' size intermediate_size (it has no dense MLP).
            moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
            norm_topk_prob=cfg.get("norm_topk_prob", True) if arch == "Qwen3MoeForCausalLM" else True,
            moe_layers=moe_layers,
            rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
            sliding_layers=cls._sliding_layers(cfg, layers) if window else (),
        )

    @staticmethod
    def _longrope(cfg: dict[str, Any], scaling: dict, context_length: int | None) -> dict:
        """Phi-3's longrope settled for the context served: the long factors when it is longer than
        the pre-training context (original_max_position_embeddings), else the short ones, for every
        position; and the attention factor, sqrt(1 + ln(s) / ln(original)) for s = max / original
        unless the config gives it. transformers switches factors by the current sequence's length
        instead (a prompt within the original context starts short and switches once it grows past
        it), which no cache can follow: a position's keys would depend on how long its sequence
        became. The rule by the served context (llama.cpp's) keeps them fixed."""
        max_pos = cfg.get("max_position_embeddings", 4096)
        original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings") \
            or max_pos
        factor = scaling.get("factor") or max_pos / original
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
        served = min(context_length or max_pos, max_pos)
        return {**scaling, "rope_type": "longrope", "original_max_position_embeddings": original,
                "attention_factor": attention, "long": served > original}

    @staticmethod
    def _sliding_layers(cfg: dict[str, Any], layers: int) -> tuple[int, ...]:
        """The windowed layers: as layer_types says (transformers 5), else Qwen2/Qwen3's rule
        (the layers from max_window_layers on), else all of them (Mistral, Phi-3)."""
        if cfg.get("layer_types"):
            return tuple(i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention")
        if cfg.get("max_window_layers") is not None and cfg.get("use_sliding_window"):
            return tuple(range(cfg["max_window_layers"], layers))
        return tuple(range(layers))

    @staticmethod
    def _gemma3(cfg: dict[str, Any], head_dim: int, layers: int, window: int | None) -> dict[str, Any]:
        """Gemma 3's text decoder, what it sets beyond the common fields: from the config of
        transformers 5 (layer_types, rope_parameters per layer type) or of the checkpoints'
        original format (sliding_window_pattern, rope_theta, rope_local_base_freq, rope_scaling for
        the global layers)."""
        if cfg.get("attn_logit_softcapping") is not None:
            raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")
        types = cfg.get("layer_types") or ["full_attention" if (i + 1) % (cfg.get("sliding_window_pattern") or 6) == 0
                                           else "sliding_attention" for i in range(layers)]
        rope = cfg.get("rope_parameters") or {}
        if "full_attention" in rope:
            full, local = rope["full_attention"], rope.get("sliding_attention") or rope["full_attention"]
        else:
            full = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1_000_000.0)}
            local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}

        def scaling(r: dict) -> dict | None:
            return r if r.get("rope_type", r.get("type", "default")) != "default" else None

        return dict(
            rope_theta=full["rope_theta"], rope_scaling=scaling(full),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True), attention_bias=cfg.get("attention_bias", False),
            qk_norm=True,
            sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else (),
            local_rope_theta=local["rope_theta"], local_rope_scaling=scaling(local), norm_offset=True,
            embed_scale=cfg["hidden_size"] ** 0.5, hidden_act="gelu_tanh", sandwich_norms=True,
            attn_scale=cfg.get("query_pre_attn_scalar", head_dim) ** -0.5,
            final_logit_softcap=cfg.get("final_logit_softcapping"),
        )
