"""The Llama-like decoder every family we serve shares (Llama 2/3, SmolLM2, TinyLlama, Qwen2,
Qwen3, Qwen3-MoE, Mistral, Mixtral, Phi-3), our own PyTorch code. What differs between families is
configuration (model_config.py): q/k/v biases, per-head q/k norms, a mixture-of-experts MLP in
some or all layers, a sliding window, rope on part of each head, the checkpoint's tensor names
(Phi-3's are already fused as ours).

q/k/v and gate/up projections are fused into one matmul each; `load_weights` maps the
Hugging Face tensor names onto the fused parameters (and each expert's matrices onto the stacked
expert parameters of layers/moe.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
import functools
import re
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from baby_sgl.layers.activation import gelu_tanh_and_mul, silu_and_mul
from baby_sgl.layers.layernorm import RMSNorm, rms_norm, rms_norm_offset
from baby_sgl.layers.linear import Linear, linear, set_quantized
from baby_sgl.layers.moe import SparseMoE
from baby_sgl.layers.quantization import QuantizedWeight, fuse
from baby_sgl.layers.rotary_embedding import RotaryEmbedding
from baby_sgl.model_config import ModelConfig
from baby_sgl.core.forward_batch import ForwardBatch

# A pass's LoRA deltas bound to one layer: (module, input, base product) -> product plus delta.
LayerLoRA = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


def project(lin: Callable, x: torch.Tensor, w: torch.Tensor, lora: LayerLoRA | None, module: str,
            b: torch.Tensor | None = None) -> torch.Tensor:
    """x's product with a projection's weight (and bias), plus the rows' LoRA deltas if any."""
    y = lin(x, w) if b is None else lin(x, w, b)
    return y if lora is None else lora(module, x, y)


def attention_in(x: torch.Tensor, norm_w: torch.Tensor, eps: float, qkv_w: torch.Tensor, qkv_b: torch.Tensor | None,
                 cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                 lin: Callable = linear, qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
                 norm: Callable = rms_norm, lora: LayerLoRA | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's work before attention: norm, fused q/k/v projection, (Qwen3, Gemma) each head's q
    and k normalised, rope. Row-wise, and a function of tensors only, so one compiled graph serves
    every layer."""
    qkv = project(lin, norm(x, norm_w, eps), qkv_w, lora, "qkv", qkv_b)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qk = qkv[:, : q_size + kv_size].view(-1, heads + kv_heads, head_dim)
    if qk_norm is not None:
        q = norm(qk[:, :heads].reshape(-1, head_dim), qk_norm[0], eps).view(-1, heads, head_dim)
        k = norm(qk[:, heads:].reshape(-1, head_dim), qk_norm[1], eps).view(-1, kv_heads, head_dim)
        qk = torch.cat([q, k], dim=1)
    # Queries and keys sit side by side in the fused output: rotate them in one go.
    qk = RotaryEmbedding.rotate(qk, (cos, sin))
    v = qkv[:, q_size + kv_size :].view(-1, kv_heads, head_dim)
    return qk[:, :heads], qk[:, heads:], v


def attention_out_mlp(attn: torch.Tensor, x: torch.Tensor, o_w: torch.Tensor, norm_w: torch.Tensor, eps: float,
                      gate_up_w: torch.Tensor, down_w: torch.Tensor,
                      lin: Callable = linear, reduce: Callable | None = None,
                      lora: LayerLoRA | None = None) -> torch.Tensor:
    """A layer's work after attention: output projection, residual, norm, MLP, residual. With
    tensor parallelism o_proj and down_proj give partial sums, which reduce completes."""
    o = project(lin, attn.reshape(attn.shape[0], -1), o_w, lora, "o")
    x = x + (o if reduce is None else reduce(o))
    gate_up = project(lin, rms_norm(x, norm_w, eps), gate_up_w, lora, "gate_up")
    down = project(lin, silu_and_mul(gate_up), down_w, lora, "down")
    return x + (down if reduce is None else reduce(down))


def attention_out_moe(attn: torch.Tensor, x: torch.Tensor, o_w: torch.Tensor, norm_w: torch.Tensor, eps: float,
                      moe: SparseMoE, lin: Callable = linear, reduce: Callable | None = None,
                      lora: LayerLoRA | None = None) -> torch.Tensor:
    """attention_out_mlp with a mixture of experts for the MLP. With tensor parallelism each rank
    holds a slice of every expert, so the experts' sum is a partial sum too."""
    o = project(lin, attn.reshape(attn.shape[0], -1), o_w, lora, "o")
    x = x + (o if reduce is None else reduce(o))
    moe_out = moe(rms_norm(x, norm_w, eps))
    return x + (moe_out if reduce is None else reduce(moe_out))


def attention_out_sandwich(attn: torch.Tensor, x: torch.Tensor, o_w: torch.Tensor, post_attn_w: torch.Tensor,
                           pre_ff_w: torch.Tensor, post_ff_w: torch.Tensor, eps: float, gate_up_w: torch.Tensor,
                           down_w: torch.Tensor, lin: Callable = linear, reduce: Callable | None = None,
                           lora: LayerLoRA | None = None) -> torch.Tensor:
    """Gemma's layer after attention: each sublayer's output is normalised before its residual is
    added, and the MLP (GELU-tanh) has a norm on each side. With tensor parallelism the partial
    sums are completed before the norms."""
    o = project(lin, attn.reshape(attn.shape[0], -1), o_w, lora, "o")
    x = x + rms_norm_offset(o if reduce is None else reduce(o), post_attn_w, eps)
    gate_up = project(lin, rms_norm_offset(x, pre_ff_w, eps), gate_up_w, lora, "gate_up")
    down = project(lin, gelu_tanh_and_mul(gate_up), down_w, lora, "down")
    return x + rms_norm_offset(down if reduce is None else reduce(down), post_ff_w, eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.attn_scale or cfg.head_dim**-0.5
        self.windowed = layer_id in cfg.sliding_layers  # attends over the last sliding_window positions
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset)

    def qk_norm_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self.q_norm.weight, self.k_norm.weight) if hasattr(self, "q_norm") else None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Writes the new tokens' K/V to the pool and attends over each request's slots. Rows
        past the batch's real tokens (padding to a compiled bucket) are left out and come back
        as zeros."""
        n = fb.out_cache_loc.numel()
        fb.kv_pool.set_kv_buffer(self.layer_id, fb.out_cache_loc, k[:n], v[:n])
        out = fb.attn_backend.forward(q[:n], self.layer_id, self.scale, fb, windowed=self.windowed)
        return out if n == q.shape[0] else F.pad(out, (0, 0, 0, 0, 0, q.shape[0] - n))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp: MLP | SparseMoE = (
            SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                      cfg.norm_topk_prob) if layer_id in cfg.moe_layers else MLP(cfg))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, cos_sin: tuple[torch.Tensor, torch.Tensor],
                dense: DenseFns) -> torch.Tensor:
        lora = None if fb.lora is None else functools.partial(fb.lora.apply, self.self_attn.layer_id)
        q, k, v = self.dense_in(x, cos_sin, dense, lora)
        return self.dense_out(self.self_attn.attend(q, k, v, fb), x, dense, lora)

    def dense_in(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], dense: DenseFns,
                 lora: LayerLoRA | None = None):
        a, norm = self.self_attn, self.input_layernorm
        return dense.attention_in(x, norm.weight, norm.eps, a.qkv_proj.weight, a.qkv_proj.bias, *cos_sin,
                                  a.num_heads, a.num_kv_heads, a.head_dim, qk_norm=a.qk_norm_weights(), lora=lora)

    def dense_out(self, attn: torch.Tensor, x: torch.Tensor, dense: DenseFns,
                 lora: LayerLoRA | None = None) -> torch.Tensor:
        a, m, norm = self.self_attn, self.mlp, self.post_attention_layernorm
        if isinstance(m, SparseMoE):
            return dense.attention_out_moe(attn, x, a.o_proj.weight, norm.weight, norm.eps, m, lora=lora)
        return dense.attention_out_mlp(attn, x, a.o_proj.weight, norm.weight, norm.eps, m.gate_up_proj.weight,
                                       m.down_proj.weight, lora=lora)


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 3's layer: norms scaled by 1 + weight, also after attention and on both sides of the
    MLP (attention_out_sandwich)."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__(cfg, layer_id)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=True)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=True)

    def dense_in(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], dense: DenseFns,
                 lora: LayerLoRA | None = None):
        a, norm = self.self_attn, self.input_layernorm
        return dense.attention_in(x, norm.weight, norm.eps, a.qkv_proj.weight, a.qkv_proj.bias, *cos_sin,
                                  a.num_heads, a.num_kv_heads, a.head_dim, qk_norm=a.qk_norm_weights(),
                                  norm=rms_norm_offset, lora=lora)

    def dense_out(self, attn: torch.Tensor, x: torch.Tensor, dense: DenseFns,
                 lora: LayerLoRA | None = None) -> torch.Tensor:
        a, m = self.self_attn, cast(MLP, self.mlp)
        return dense.attention_out_sandwich(attn, x, a.o_proj.weight, self.post_attention_layernorm.weight,
                                            self.pre_feedforward_layernorm.weight,
                                            self.post_feedforward_layernorm.weight, self.input_layernorm.eps,
                                            m.gate_up_proj.weight, m.down_proj.weight, lora=lora)


@dataclass(frozen=True)
class DenseFns:
    """The dense parts of a layer: eager (EAGER) or compiled (model_executor/compile.py); the
    mixture-of-experts variant of the second (its routing decides the shapes) always runs eager."""

    attention_in: Callable
    attention_out_mlp: Callable
    attention_out_moe: Callable = attention_out_moe
    attention_out_sandwich: Callable = attention_out_sandwich


EAGER = DenseFns(attention_in, attention_out_mlp)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.rope_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        # Gemma 3's windowed layers rotate with a base (and scaling) of their own.
        self.rotary_local = None if cfg.local_rope_theta is None else RotaryEmbedding(
            cfg.rope_dim, cfg.max_position_embeddings, cfg.local_rope_theta, cfg.local_rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layer_cls = SandwichDecoderLayer if cfg.sandwich_norms else DecoderLayer
        # A ModuleList (registered, moved and loaded with the model), typed as the list of layers it holds.
        self.layers = cast("list[DecoderLayer]", nn.ModuleList(layer_cls(cfg, i) for i in range(cfg.num_layers)))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if not self.config.tie_word_embeddings:
            return
        if isinstance(self.embed_tokens.weight, QuantizedWeight):
            set_quantized(self.lm_head, self.embed_tokens.weight)
        else:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight
        if isinstance(weight, QuantizedWeight):
            x = weight.dequantize(self.norm.weight.dtype, input_ids)
        else:
            x = self.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:  # Gemma: the scale rounded to the model's dtype, as transformers does
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype, device=x.device)
        return x

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, dense: DenseFns = EAGER,
                logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Returns next-token logits (float32), one row per request, and the final hidden states
        of the rows fb.input_logprob_rows names (prompt logprobs; None if none); (None, None)
        without logits (tensor-parallel ranks but 0). input_ids may be padded past the batch's
        tokens (a compiled bucket); padded rows never reach the KV pool."""
        x = self.embed(fb.input_ids)
        cos_sin = self.rotary.cos_sin(fb.positions, x.dtype)
        local = cos_sin if self.rotary_local is None else self.rotary_local.cos_sin(fb.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, fb, local if layer.self_attn.windowed else cos_sin, dense)
        if not logits:
            return None, None
        # Only each request's last token needs logits: skip the vocab matmul for the rest.
        hidden = None if fb.input_logprob_rows is None else self.norm(x[fb.input_logprob_rows])
        return self.compute_logits(self.norm(x[fb.last_token_indices()])), hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcap
        if cap is not None:  # Gemma: squashed into (-cap, cap), in the model's dtype as transformers does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    _FUSED = {  # HF name piece -> (our fused parameter, shard index)
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    # A family's own checkpoint names -> the names above (Mixtral's block_sparse_moe/w1/w2/w3).
    _RENAMES: tuple[tuple[str, str], ...] = ()
    _EXPERT = re.compile(r"(layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        experts_loaded: dict[str, set[tuple[int, str]]] = {}
        quantized: dict[str, dict[int | None, QuantizedWeight]] = {}
        dense: set[str] = set()  # fused targets with a part that came dense
        for name, tensor in weights:
            name = name.removeprefix("model.")
            for pattern, replacement in self._RENAMES:
                name = re.sub(pattern, replacement, name)
            if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            if (expert := self._EXPERT.fullmatch(name)) is not None:
                self._load_expert(params, expert, tensor, experts_loaded)
                continue
            target, shard = name, None
            for piece, (fused, idx) in self._FUSED.items():
                if f".{piece}." in name:
                    target, shard = name.replace(piece, fused), idx
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {self.config.architecture}")
            loaded.add(target)
            if isinstance(tensor, QuantizedWeight):
                quantized.setdefault(target, {})[shard] = tensor
                continue
            dense.add(target)
            self._copy_part(params[target], target, shard, tensor)
        for target, shards in quantized.items():
            if target in dense:  # a fused matrix whose other parts are already in the dense parameter
                for shard, part in shards.items():
                    self._copy_part(params[target], target, shard, part.dequantize())
            else:
                self._load_quantized(target, [shards[i] for i in sorted(shards, key=lambda i: i or 0)])
        self.tie_weights()
        loaded |= {t for t, parts in experts_loaded.items() if len(parts) == 2 * self.config.num_experts
                   or (t.endswith("experts_down") and len(parts) == self.config.num_experts)}
        missing = set(params) - loaded - ({"lm_head.weight"} if self.config.tie_word_embeddings else set())
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")

    def _load_expert(self, params: dict[str, nn.Parameter], expert: re.Match,
                     tensor: torch.Tensor | QuantizedWeight, experts_loaded: dict[str, set[tuple[int, str]]]) -> None:
        """One expert's gate, up or down matrix into the layer's stacked expert parameters."""
        layer, e, piece = expert[1], int(expert[2]), expert[3]
        target = f"{layer}.experts_down" if piece == "down_proj" else f"{layer}.experts_gate_up"
        if target not in params or e >= params[target].shape[0]:
            raise ValueError(f"unexpected weight {expert[0]!r} for {self.config.architecture}")
        if isinstance(tensor, QuantizedWeight):
            raise ValueError("quantized expert matrices are not supported: load the checkpoint with "
                             "--quantization none")
        param = params[target]
        with torch.no_grad():
            if piece == "down_proj":
                param[e].copy_(tensor)
            else:
                start = 0 if piece == "gate_proj" else param.shape[1] // 2
                param[e, start : start + param.shape[1] // 2].copy_(tensor)
        experts_loaded.setdefault(target, set()).add((e, piece))

    def _copy_part(self, param: nn.Parameter, target: str, shard: int | None, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            if shard is None:
                param.copy_(tensor)
            else:
                param[self._shard_rows(target, shard)].copy_(tensor)

    def _load_quantized(self, target: str, parts: list[QuantizedWeight]) -> None:
        """Keeps a matrix as its blocks (a fused one as its parts' rows, each part in its format)."""
        set_quantized(self.get_submodule(target.rsplit(".", 1)[0]), fuse(parts))

    def _shard_rows(self, target: str, shard: int) -> slice:
        cfg = self.config
        if "qkv_proj" in target:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            return [slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)][shard]
        return slice(shard * cfg.intermediate_size, (shard + 1) * cfg.intermediate_size)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Same graph as Llama; ModelConfig turns on the q/k/v biases for this architecture."""


class MixtralForCausalLM(LlamaForCausalLM):
    """Every layer a mixture of experts, under Mixtral's own checkpoint names."""

    _RENAMES = ((r"\.block_sparse_moe\.", ".mlp."), (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
                (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."), (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."))
