"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama) and Qwen2, our own PyTorch code.

q/k/v and gate/up projections are fused into one matmul each; `load_weights` maps the
Hugging Face tensor names onto the fused parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from baby_sgl.layers.activation import silu_and_mul
from baby_sgl.layers.layernorm import RMSNorm, rms_norm
from baby_sgl.layers.linear import Linear, linear, set_quantized
from baby_sgl.layers.quantization import QuantizedWeight
from baby_sgl.layers.rotary_embedding import RotaryEmbedding
from baby_sgl.model_config import ModelConfig
from baby_sgl.core.forward_batch import ForwardBatch


def attention_in(x: torch.Tensor, norm_w: torch.Tensor, eps: float, qkv_w: torch.Tensor, qkv_b: torch.Tensor | None,
                 cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                 lin: Callable = linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's work before attention: norm, fused q/k/v projection, rope. Row-wise, and a
    function of tensors only, so one compiled graph serves every layer."""
    qkv = lin(rms_norm(x, norm_w, eps), qkv_w, qkv_b)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    # Queries and keys sit side by side in the fused output: rotate them in one go.
    qk = RotaryEmbedding.rotate(qkv[:, : q_size + kv_size].view(-1, heads + kv_heads, head_dim), (cos, sin))
    v = qkv[:, q_size + kv_size :].view(-1, kv_heads, head_dim)
    return qk[:, :heads], qk[:, heads:], v


def attention_out_mlp(attn: torch.Tensor, x: torch.Tensor, o_w: torch.Tensor, norm_w: torch.Tensor, eps: float,
                      gate_up_w: torch.Tensor, down_w: torch.Tensor,
                      lin: Callable = linear, reduce: Callable | None = None) -> torch.Tensor:
    """A layer's work after attention: output projection, residual, norm, MLP, residual. With
    tensor parallelism o_proj and down_proj give partial sums, which reduce completes."""
    o = lin(attn.reshape(attn.shape[0], -1), o_w)
    x = x + (o if reduce is None else reduce(o))
    down = lin(silu_and_mul(lin(rms_norm(x, norm_w, eps), gate_up_w)), down_w)
    return x + (down if reduce is None else reduce(down))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Writes the new tokens' K/V to the pool and attends over each request's slots. Rows
        past the batch's real tokens (padding to a compiled bucket) are left out and come back
        as zeros."""
        n = fb.out_cache_loc.numel()
        fb.kv_pool.set_kv_buffer(self.layer_id, fb.out_cache_loc, k[:n], v[:n])
        out = fb.attn_backend.forward(q[:n], self.layer_id, self.scale, fb)
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
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, cos_sin: tuple[torch.Tensor, torch.Tensor],
                dense: DenseFns) -> torch.Tensor:
        q, k, v = self.dense_in(x, cos_sin, dense)
        return self.dense_out(self.self_attn.attend(q, k, v, fb), x, dense)

    def dense_in(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], dense: DenseFns):
        a, norm = self.self_attn, self.input_layernorm
        return dense.attention_in(x, norm.weight, norm.eps, a.qkv_proj.weight, a.qkv_proj.bias, *cos_sin,
                                  a.num_heads, a.num_kv_heads, a.head_dim)

    def dense_out(self, attn: torch.Tensor, x: torch.Tensor, dense: DenseFns) -> torch.Tensor:
        a, m, norm = self.self_attn, self.mlp, self.post_attention_layernorm
        return dense.attention_out_mlp(attn, x, a.o_proj.weight, norm.weight, norm.eps, m.gate_up_proj.weight,
                                       m.down_proj.weight)


@dataclass(frozen=True)
class DenseFns:
    """The two dense parts of a layer: eager (EAGER) or compiled (model_executor/compile.py)."""

    attention_in: Callable
    attention_out_mlp: Callable


EAGER = DenseFns(attention_in, attention_out_mlp)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # A ModuleList (registered, moved and loaded with the model), typed as the list of layers it holds.
        self.layers = cast("list[DecoderLayer]", nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers)))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
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
            return weight.dequantize(self.norm.weight.dtype, input_ids)
        return self.embed_tokens(input_ids)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, dense: DenseFns = EAGER,
                logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Returns next-token logits (float32), one row per request, and the final hidden states
        of the rows fb.input_logprob_rows names (prompt logprobs; None if none); (None, None)
        without logits (tensor-parallel ranks but 0). input_ids may be padded past the batch's
        tokens (a compiled bucket); padded rows never reach the KV pool."""
        x = self.embed(fb.input_ids)
        cos_sin = self.rotary.cos_sin(fb.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, fb, cos_sin, dense)
        if not logits:
            return None, None
        # Only each request's last token needs logits: skip the vocab matmul for the rest.
        hidden = None if fb.input_logprob_rows is None else self.norm(x[fb.input_logprob_rows])
        return self.compute_logits(self.norm(x[fb.last_token_indices()])), hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    _FUSED = {  # HF name piece -> (our fused parameter, shard index)
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        quantized: dict[str, dict[int | None, QuantizedWeight]] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
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
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    param.copy_(tensor)
                else:
                    param[self._shard_rows(target, shard)].copy_(tensor)
        for target, shards in quantized.items():
            self._load_quantized(target, [shards[i] for i in sorted(shards, key=lambda i: i or 0)], params[target])
        self.tie_weights()
        missing = set(params) - loaded - ({"lm_head.weight"} if self.config.tie_word_embeddings else set())
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")

    def _load_quantized(self, target: str, parts: list[QuantizedWeight], param: nn.Parameter) -> None:
        """Keeps a matrix as its blocks (a fused one as its parts' rows), unless its parts differ
        in format: then they are dequantized into the dense parameter."""
        if len({p.qtype for p in parts}) == 1:
            set_quantized(self.get_submodule(target.rsplit(".", 1)[0]), QuantizedWeight.cat(parts))
            return
        with torch.no_grad():
            param.copy_(torch.cat([p.dequantize() for p in parts]))

    def _shard_rows(self, target: str, shard: int) -> slice:
        cfg = self.config
        if "qkv_proj" in target:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            return [slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)][shard]
        return slice(shard * cfg.intermediate_size, (shard + 1) * cfg.intermediate_size)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Same graph as Llama; ModelConfig turns on the q/k/v biases for this architecture."""
