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

from collections.abc import Sequence

import torch
from torch import nn

from baby_sgl.layers.activation import silu_and_mul
from baby_sgl.layers.linear import Linear, can_prepack, linear


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts and their weights, as transformers computes them: softmax in
    float32 over all experts, the k largest, optionally renormalised to sum to one, cast back."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


def experts_forward(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                    gate_up: Sequence[torch.Tensor] | torch.Tensor,
                    down: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """sum over each token's k choices of weight * expert(x); x: [tokens, hidden], weights and
    experts: [tokens, k]; gate_up and down: each expert's matrix (stacked, or one prepacked tensor
    each). Experts are visited in ascending order, as transformers does."""
    out = torch.zeros_like(x)
    top_k = experts.shape[1]
    flat = experts.flatten()
    order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert
    counts = torch.bincount(flat, minlength=len(gate_up)).tolist()
    flat_weights = weights.flatten()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // top_k
        h = linear(silu_and_mul(linear(x[tokens], gate_up[e])), down[e])
        out.index_add_(0, tokens, h * flat_weights[pairs, None])
    return out


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Linear(hidden_size, num_experts, bias=False)  # the router
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * size, hidden_size))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden_size, size))
        self.packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def prepack_pays(self) -> bool:
        """bfloat16 on a CPU with oneDNN: measured with scripts/moe_bench.py (2-core AVX-512 Xeon,
        8 experts of 768, top-2), prepacked experts decoded at 145-150 tok/s at batch 1 against 49
        with plain products, and 450 against 126 at batch 8. In float32 the plain products were
        faster (109-111 against 103 at batch 1, 304-312 against 248 at batch 8), so float32
        experts stay as they are. A rule by dtype, fixed: never a timing at run time."""
        return can_prepack(self.experts_down) and self.experts_down.dtype == torch.bfloat16

    def prepack(self) -> None:
        """Each expert's matrices in oneDNN's blocked layout, as Linear.prepack does for a dense
        layer (layers/linear.py); the stacked parameters are dropped."""
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self.packed = ([reorder(w.detach().contiguous(), 1) for w in self.experts_gate_up],
                       [reorder(w.detach().contiguous(), 1) for w in self.experts_down])
        del self._parameters["experts_gate_up"], self._parameters["experts_down"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)
        gate_up, down = self.packed or (self.experts_gate_up, self.experts_down)
        return experts_forward(x, weights, experts, gate_up, down)
