"""The CPU decode step in one call (csrc/cpu_step.cpp): a decode pass of a Llama-family model with
no Python between its ops and threads that spin between them instead of sleeping.

It reads the model's weights where they are (quantized blocks, or plain float32 / bfloat16
matrices) and the runner's KV pool, and returns the logits. It takes every decode batch: measured
on SmolLM2-135M (Q4_1, 2-core Zen 5, contexts of 200), it was faster than the op-by-op pass from 1
to 32 requests in float32 and bfloat16 (batch 1: 3.5 vs 6.9 ms, batch 32 in bfloat16: 43 vs 58 ms)
and level at 64 (bfloat16: 87 vs 83 ms). Prefill and mixed passes run op by op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from baby_sgl.layers.quantization import DENSE_TYPES, QuantizedWeight
from baby_sgl.core.memory_pool import KVPool, ReqToTokenPool

if TYPE_CHECKING:
    from baby_sgl.models.llama import MLP, DecoderLayer, LlamaForCausalLM


def can_run(model: LlamaForCausalLM, dtype: torch.dtype) -> bool:
    """A Llama/Qwen2/Qwen3-shaped model (no experts, sliding window, partial rope or Gemma norms), every matrix in a format the kernel
    reads, activations in float32 or bfloat16, heads of a multiple of 16 values (whole vectors)."""
    cfg = model.config
    if dtype not in DENSE_TYPES or cfg.head_dim % 16 or cfg.norm_offset or cfg.num_experts or cfg.sliding_window \
            or cfg.rotary_dim:
        return False  # the kernel has no Gemma norms, experts, windows or partial rope (yet): op by op
    linears = [model.embed_tokens, model.lm_head] + [m for layer in model.layers for m in
                                                      (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                       _mlp(layer).gate_up_proj, _mlp(layer).down_proj)]
    return all(isinstance(m.weight, QuantizedWeight) or
               (m.weight.dtype in DENSE_TYPES and not m.weight.is_mkldnn) for m in linears)


def _mlp(layer: DecoderLayer) -> MLP:
    return cast("MLP", layer.mlp)  # dense in every model can_run accepts


def _qk_norms(layer: DecoderLayer) -> dict[str, torch.Tensor]:
    norms = layer.self_attn.qk_norm_weights()
    return {} if norms is None else {"q_norm": norms[0].detach(), "k_norm": norms[1].detach()}


def _weight(module: torch.nn.Module) -> tuple:
    """(data, format, n, k, bias) as the kernel takes a matrix."""
    w = cast("torch.Tensor | QuantizedWeight", module.weight)  # a Linear's or an Embedding's, maybe quantized
    bias = getattr(module, "bias", None)
    if isinstance(w, QuantizedWeight):
        return (w.data, int(w.qtype), *w.shape, bias)
    return (w.detach(), int(DENSE_TYPES[w.dtype]), w.shape[0], w.shape[1], bias)


class CpuDecodeStep:
    def __init__(self, ops: Any, model: LlamaForCausalLM, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool) -> None:
        cfg = model.config
        layers = [dict(qkv=_weight(l.self_attn.qkv_proj), o=_weight(l.self_attn.o_proj),
                       gate_up=_weight(_mlp(l).gate_up_proj), down=_weight(_mlp(l).down_proj),
                       norm_in=l.input_layernorm.weight.detach(), norm_post=l.post_attention_layernorm.weight.detach(),
                       **_qk_norms(l))
                  for l in model.layers]
        config = dict(hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                      head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                      rms_norm_eps=cfg.rms_norm_eps, num_threads=torch.get_num_threads(),
                      bf16_products=kv_pool.dtype == torch.bfloat16)
        self.step = ops.DecodeStep(config, layers, _weight(model.embed_tokens), _weight(model.lm_head),
                                   model.norm.weight.detach(), model.rotary.cos_cache, model.rotary.sin_cache,
                                   kv_pool.k_buffers, kv_pool.v_buffers)
        self.req_to_token = req_to_token_pool.req_to_token

    def run(self, input_ids: list[int], positions: torch.Tensor, out_cache_loc: torch.Tensor,
            req_pool_indices: list[int], seq_lens: list[int]) -> torch.Tensor:
        """Logits (float32, one row per request) of one decode pass; writes the new tokens' KV."""
        dev = self.req_to_token.device

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=dev)

        return self.step.run(ints(input_ids), positions.contiguous(), out_cache_loc.contiguous(), self.req_to_token,
                             ints(req_pool_indices), ints(seq_lens), torch.get_num_threads())
