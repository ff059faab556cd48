"""How a model is split over tp_size ranks (Megatron-style, as SGLang): q/k/v and gate/up are
split by output rows (each rank has whole heads and a slice of the MLP), o_proj and down_proj by
input columns, so each rank's output is a partial sum that one all-reduce completes.

Attention is split by KV group: a rank holds whole KV heads with the query heads that read them,
so attention needs no communication. The groups are dealt out as evenly as they go; when they do
not divide (SmolLM2-135M: 3 KV heads over 2 ranks), ranks get one group more or less. With more
ranks than KV heads, each KV head is copied to tp_size / num_kv_heads ranks, which split its
query heads evenly. The MLP's intermediate rows are dealt out the same way, and so are every
expert's in a mixture of experts (each rank holds a slice of every expert rather than whole experts:
the work stays even whichever experts the tokens pick, and the experts' sum stays one all-reduce).

The embedding and lm_head are replicated, not split by vocabulary: a vocab-split lm_head needs an
all-gather of the logits at every step (a collective is the dominant cost on CPU), and the
sampler, grammar masks and logprobs need the whole row on rank 0 anyway. Only rank 0 computes
logits. For the models this engine targets the copies are small (SmolLM2: 28M parameters).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from baby_sgl.model_config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """One rank's part: half-open ranges of query heads, KV heads, MLP intermediate rows and each
    expert's intermediate rows."""

    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    inter: tuple[int, int]
    moe_inter: tuple[int, int] = (0, 0)


def _deal(n: int, parts: int) -> list[tuple[int, int]]:
    """n items in contiguous ranges over parts, sizes differing by at most one."""
    size, extra = divmod(n, parts)
    ranges, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        ranges.append((start, end))
        start = end
    return ranges


def plan(cfg: ModelConfig, tp_size: int) -> list[Shard]:
    """Every rank's shard; ValueError naming the problem if the model cannot be split so."""
    heads, kv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if tp_size > heads:
        raise ValueError(f"tp_size {tp_size} is larger than the model's {heads} attention heads")
    group = heads // kv
    if tp_size <= kv:
        kv_ranges = _deal(kv, tp_size)
        head_ranges = [(a * group, b * group) for a, b in kv_ranges]
    else:
        copies = tp_size // kv
        if tp_size % kv or group % copies:
            raise ValueError(
                f"tp_size {tp_size} does not divide the model's heads: with more ranks than its {kv} KV heads, "
                f"each KV head goes to tp_size / {kv} ranks, which must split its {group} query heads evenly "
                f"(tp_size a multiple of {kv} that divides {heads})")
        per = group // copies
        kv_ranges = [(r // copies, r // copies + 1) for r in range(tp_size)]
        head_ranges = [(r * per, (r + 1) * per) for r in range(tp_size)]
    return [Shard(h, k, i, m) for h, k, i, m in
            zip(head_ranges, kv_ranges, _deal(inter, tp_size), _deal(cfg.moe_intermediate_size, tp_size))]


def local_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The config of one rank's model: its own heads and intermediate size."""
    return dataclasses.replace(cfg, num_heads=shard.heads[1] - shard.heads[0],
                               num_kv_heads=shard.kv_heads[1] - shard.kv_heads[0],
                               intermediate_size=shard.inter[1] - shard.inter[0],
                               moe_intermediate_size=shard.moe_inter[1] - shard.moe_inter[0])


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig,
                  shard: Shard) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (Hugging Face named) tensors cut down to one rank's part."""
    d = cfg.head_dim
    rows = {"q_proj": (shard.heads[0] * d, shard.heads[1] * d), "k_proj": (shard.kv_heads[0] * d, shard.kv_heads[1] * d),
            "gate_proj": shard.inter, "up_proj": shard.inter}
    rows["v_proj"] = rows["k_proj"]
    cols = {"o_proj": rows["q_proj"], "down_proj": shard.inter}
    # An expert's matrices (Mixtral's w1/w3/w2 are gate/up/down) are split by its own hidden size.
    expert_rows = {"gate_proj": shard.moe_inter, "up_proj": shard.moe_inter, "w1": shard.moe_inter,
                   "w3": shard.moe_inter}
    expert_cols = {"down_proj": shard.moe_inter, "w2": shard.moe_inter}
    # Checkpoints that store q/k/v or gate/up fused (Phi-3): each part cut, the cuts joined.
    fused = {"qkv_proj": [(0, cfg.num_heads * d, rows["q_proj"]),
                          (cfg.num_heads * d, cfg.num_kv_heads * d, rows["k_proj"]),
                          ((cfg.num_heads + cfg.num_kv_heads) * d, cfg.num_kv_heads * d, rows["v_proj"])],
             "gate_up_proj": [(0, cfg.intermediate_size, shard.inter),
                              (cfg.intermediate_size, cfg.intermediate_size, shard.inter)]}
    for name, tensor in weights:
        piece = name.split(".")[-2] if "." in name else ""
        if piece in fused:
            tensor = torch.cat([tensor[offset : offset + size][a:b] for offset, size, (a, b) in fused[piece]])
            yield name, tensor.contiguous()
            continue
        if ".experts." in name:
            if piece in expert_rows:
                a, b = expert_rows[piece]
                tensor = tensor[a:b]
            elif piece in expert_cols:
                a, b = expert_cols[piece]
                tensor = tensor[:, a:b]
            yield name, tensor.contiguous()
            continue
        if piece in rows:
            a, b = rows[piece]
            tensor = tensor[a:b]
        elif piece in cols and name.endswith(".weight"):
            a, b = cols[piece]
            tensor = tensor[:, a:b]
        yield name, tensor.contiguous()


def kv_heads_per_token(cfg: ModelConfig, tp_size: int) -> int:
    """KV heads stored per token over all ranks (copies included): for sizing the pools."""
    return sum(s.kv_heads[1] - s.kv_heads[0] for s in plan(cfg, tp_size))
