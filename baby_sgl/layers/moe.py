"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k
experts, and each expert runs only on the tokens routed to it.

The tokens are grouped by expert (one sort of the flat (token, choice) list) and each active
expert does one matmul for its gate/up projections and one for its down projection over its
group; the weighted results are added back into their tokens' rows. No token passes through an
expert it was not routed to. The experts' matrices are stacked ([experts, 2 * size, hidden] and
[experts, hidden, size]) so that tensor parallelism can split every expert's hidden size the same
way it splits a dense MLP's (distributed/tp_plan.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baby_sgl.layers.activation import silu_and_mul
from baby_sgl.layers.linear import Linear


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts and their weights, as transformers computes them: softmax in
    float32 over all experts, the k largest, optionally renormalised to sum to one, cast back."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


def experts_forward(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """sum over each token's k choices of weight * expert(x); x: [tokens, hidden], weights and
    experts: [tokens, k]. Experts are visited in ascending order, as transformers does."""
    out = torch.zeros_like(x)
    top_k = experts.shape[1]
    flat = experts.flatten()
    order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    flat_weights = weights.flatten()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // top_k
        h = F.linear(silu_and_mul(F.linear(x[tokens], gate_up[e])), down[e])
        out.index_add_(0, tokens, h * flat_weights[pairs, None])
    return out


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Linear(hidden_size, num_experts, bias=False)  # the router
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * size, hidden_size))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden_size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)
        return experts_forward(x, weights, experts, self.experts_gate_up, self.experts_down)
