"""The CPU decode step in one call (csrc/cpu_step.cpp): a decode pass of any family the decoder
serves (models/llama.py: dense, mixtures of experts, sliding windows, partial rope, Gemma's norms)
with no Python between its ops and threads that spin between them instead of sleeping.

It reads the model's weights where they are (quantized blocks, or plain float32 / bfloat16
matrices), the runner's KV pool and the LoRA adapters' slots (each row adds its own adapter's
deltas), and returns the logits. It takes every decode batch: measured
on SmolLM2-135M (Q4_1, 2-core Zen 5, contexts of 200), it was faster than the op-by-op pass from 1
to 32 requests in float32 and bfloat16 (batch 1: 3.5 vs 6.9 ms, batch 32 in bfloat16: 43 vs 58 ms)
and level at 64 (bfloat16: 87 vs 83 ms). Prefill and mixed passes run here too, a row per token
(model_runner.py: _extend_in_step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from baby_sgl.core.memory_pool import KVPool, ReqToTokenPool
from baby_sgl.cpu.ops import cpu_ops
from baby_sgl.layers.layernorm import RMSNorm
from baby_sgl.layers.moe import SparseMoE
from baby_sgl.lora.adapter import MODULES
from baby_sgl.lora.memory_pool import LoRAMemoryPool
from baby_sgl.layers.quantization import DENSE_TYPES, StoredWeight, stored_parts
from baby_sgl.model_config import ModelConfig
from baby_sgl.models.llama import SandwichDecoderLayer

if TYPE_CHECKING:
    from baby_sgl.models.llama import DecoderLayer, LlamaForCausalLM

Rows = list[int] | torch.Tensor  # a value per row, as a list or an integer tensor


def int8_activations(mode: str, dtype: torch.dtype) -> bool:
    """--cpu-int8-activations resolved: auto rounds activations to int8 blocks in every dtype but
    float32 (llama.cpp always does; float32 keeps transformers' results)."""
    return mode == "on" or (mode == "auto" and dtype != torch.float32)


def matrix_tiles(mode: str, dtype: torch.dtype) -> bool:
    """--cpu-matrix-tiles resolved: bfloat16 batches on the matrix tiles (csrc/tile_products.h),
    with auto where the CPU has AMX and the kernel grants it, with on on any CPU."""
    ops = cpu_ops()
    return dtype == torch.bfloat16 and ops is not None and (mode == "on" or (mode == "auto" and ops.has_tile_products()))


def can_run(model: LlamaForCausalLM, dtype: torch.dtype) -> bool:
    """Any family the decoder serves, every matrix in a format the kernel reads (the experts' and
    the router's plain), activations in float32 or bfloat16, heads of a multiple of 16 values
    (whole vectors), at most 64 experts per token."""
    cfg = model.config
    if dtype not in DENSE_TYPES or cfg.head_dim % 16 or cfg.num_experts_per_tok > 64:
        return False
    linears = [model.embed_tokens, model.lm_head] + [m for layer in model.layers for m in
                                                      (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                       *_mlp_linears(layer))]
    experts = [t for layer in model.layers if isinstance(layer.mlp, SparseMoE)
               for t in (layer.mlp.experts_gate_up, layer.mlp.experts_down)]
    return all(isinstance(m.weight, StoredWeight) or _plain(cast(torch.Tensor, m.weight)) for m in linears) and \
        all(_plain(t) for t in experts)


def _plain(t: torch.Tensor) -> bool:
    return t.dtype in DENSE_TYPES and not t.is_mkldnn


def _mlp_linears(layer: DecoderLayer) -> tuple[torch.nn.Module, ...]:
    m = layer.mlp
    return (m.gate,) if isinstance(m, SparseMoE) else (m.gate_up_proj, m.down_proj)


def _norm(module: RMSNorm) -> torch.Tensor:
    """The scale a norm applies: its weight, or 1 + weight (Gemma), in float32."""
    w = module.weight.detach().float()
    return w + 1.0 if module.offset else w


def _layer(layer: DecoderLayer, cfg: ModelConfig) -> dict[str, Any]:
    a = layer.self_attn
    out: dict[str, Any] = dict(qkv=_parts(a.qkv_proj), o=_weight(a.o_proj), norm_in=_norm(layer.input_layernorm),
                               norm_post=_norm(layer.post_attention_layernorm),
                               window=cfg.sliding_window if a.windowed else 0,
                               local_rope=a.windowed and cfg.local_rope_theta is not None)
    if a.qk_norm_weights() is not None:
        out |= dict(q_norm=_norm(a.q_norm), k_norm=_norm(a.k_norm))
    if isinstance(layer, SandwichDecoderLayer):
        out |= dict(pre_ff_norm=_norm(layer.pre_feedforward_layernorm),
                    post_ff_norm=_norm(layer.post_feedforward_layernorm))
    m = layer.mlp
    if isinstance(m, SparseMoE):
        return out | dict(router=_weight(m.gate), experts_gate_up=[_matrix(w) for w in m.experts_gate_up.detach()],
                          experts_down=[_matrix(w) for w in m.experts_down.detach()])
    return out | dict(gate_up=_parts(m.gate_up_proj), down=_weight(m.down_proj))


def _lora_stacks(pool: LoRAMemoryPool | None, layer: int) -> dict[str, Any]:
    """A layer's adapter slots per module: A [slots, rank, in], B^T [slots, rank, out] (the model's dtype),
    the rows of B^T used per part [slots, rank, parts] and where the parts end."""
    return {} if pool is None else {f"lora_{m}": (pool.a[m][layer], pool.b[m][layer], pool.used[m][layer],
                                                  pool.part_ends[m]) for m in MODULES}


def _matrix(w: torch.Tensor) -> tuple:
    return (w, int(DENSE_TYPES[w.dtype]), w.shape[0], w.shape[1], None)


def _weight(module: torch.nn.Module) -> tuple:
    """(data, format, n, k, bias) as the kernel takes a matrix."""
    (part,) = _parts(module)
    return part


def _parts(module: torch.nn.Module) -> list[tuple]:
    """A fused projection as the kernel takes it: each part's (data, format, n, k, bias)."""
    w = cast("torch.Tensor | StoredWeight", module.weight)  # a Linear's or an Embedding's, maybe quantized
    bias = getattr(module, "bias", None)
    if isinstance(w, torch.Tensor):
        return [(*_matrix(w.detach())[:4], bias)]
    parts = stored_parts(w)
    biases = [None] * len(parts) if bias is None else bias.detach().split([p.shape[0] for p in parts])
    return [(p.data, p.code, *p.shape, b) for p, b in zip(parts, biases)]


class CpuDecodeStep:
    def __init__(self, ops: Any, model: LlamaForCausalLM, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool,
                 int8_activations: bool = False, deterministic: bool = False,
                 lora_pool: LoRAMemoryPool | None = None, matrix_tiles: bool = False) -> None:
        """int8_activations: products of quantized matrices with a few rows round the activations
        to int8 blocks (csrc/int8_products.h). deterministic: every product's kernel is chosen by
        its weight's format alone, not by the number of rows (--enable-deterministic-inference).
        matrix_tiles: products of many rows run on the matrix tiles (matrix_tiles()).
        lora_pool: the adapters' slots, read in place (each row's slot comes with the pass)."""
        cfg = model.config
        self.int8_activations = int8_activations
        # Gemma's embedding scale, rounded to the model's dtype as the op-by-op path rounds it.
        embed_scale = torch.tensor(cfg.embed_scale, dtype=model.norm.weight.dtype).item()
        config = dict(hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                      head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                      rms_norm_eps=cfg.rms_norm_eps, num_threads=torch.get_num_threads(),
                      bf16_products=kv_pool.dtype == torch.bfloat16, int8_activations=int8_activations,
                      deterministic=deterministic, tile_products=matrix_tiles,
                      attn_scale=model.layers[0].self_attn.scale,
                      embed_scale=embed_scale, final_logit_softcap=cfg.final_logit_softcap or 0.0,
                      hidden_act=cfg.hidden_act, num_experts_per_tok=cfg.num_experts_per_tok,
                      moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob)
        local = model.rotary_local or model.rotary
        layers = [_layer(l, cfg) | _lora_stacks(lora_pool, i) for i, l in enumerate(model.layers)]
        self.step = ops.DecodeStep(config, layers, _weight(model.embed_tokens),
                                   _weight(model.lm_head), _norm(model.norm), model.rotary.cos_cache,
                                   model.rotary.sin_cache, local.cos_cache, local.sin_cache,
                                   kv_pool.k_buffers, kv_pool.v_buffers, kv_pool.k_scales, kv_pool.v_scales)
        self.req_to_token = req_to_token_pool.req_to_token

    def run(self, input_ids: list[int], positions: torch.Tensor, out_cache_loc: torch.Tensor,
            req_pool_indices: Rows, seq_lens: Rows, lora_slots: Rows | None = None,
            logit_rows: Rows | None = None, hidden_rows: Rows | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass, a row per token: row m is token input_ids[m] at positions[m], written to KV
        slot out_cache_loc[m], of the request in req_to_token row req_pool_indices[m], seeing that
        row's first seq_lens[m] slots, with adapter slot lora_slots[m] (memory_pool.NO_ADAPTER:
        none; None: no adapters). Returns the float32 logits of logit_rows (default: every row)
        and the final hidden states of hidden_rows (default: none)."""
        dev = self.req_to_token.device

        def ints(values: Rows | None) -> torch.Tensor:
            if isinstance(values, torch.Tensor):
                return values.to(device=dev, dtype=torch.long).contiguous()
            return torch.tensor(values or [], dtype=torch.long, device=dev)

        return self.step.run(ints(input_ids), positions.contiguous(), out_cache_loc.contiguous(), self.req_to_token,
                             ints(req_pool_indices), ints(seq_lens), ints(lora_slots), torch.get_num_threads(),
                             torch.arange(len(input_ids), device=dev) if logit_rows is None else ints(logit_rows),
                             ints(hidden_rows))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states (run's hidden_rows), by the kernels run uses."""
        return self.step.logits(hidden.float().contiguous(), torch.get_num_threads())
