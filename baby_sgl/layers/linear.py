"""Linear layers, with kernels chosen by what the machine is, never by timing: the same
inputs always give the same bits.

On CPU with oneDNN (float32 or bfloat16) the weights are prepacked into oneDNN's blocked layout
(`Linear.prepack`): one-row products over weights streamed from memory ran at 19 GB/s against
10-13 for F.linear on a 2-core AVX-512 machine, and every batch size up to 512 rows was faster.
Without oneDNN, the orientation of skinny products is fixed by the CPU's vector width: `W @ x^T`
ran 8 rows x (576 -> 49152) at 37 GFLOP/s against 10 for `x @ W^T` on a 2-core AVX2 machine,
while on AVX-512 machines `x @ W^T` (F.linear) is as fast or faster.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from baby_sgl.layers.quantization import StoredWeight, stored_parts

SKINNY_ROWS = (2, 128)


@functools.cache
def skinny_transposed() -> bool:
    """W @ x^T for skinny CPU inputs: on CPUs whose widest vector unit is AVX2 or narrower."""
    return torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2")


def linear(x: torch.Tensor, weight: torch.Tensor | StoredWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, StoredWeight):
        return weight.matmul(x, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if (x.dim() == 2 and SKINNY_ROWS[0] <= x.shape[0] <= SKINNY_ROWS[1] and x.device.type == "cpu"
            and skinny_transposed()):
        out = (weight @ x.t()).t().contiguous()
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


def can_prepack(weight: torch.Tensor | StoredWeight) -> bool:
    """oneDNN's blocked layout: float32 on any CPU, bfloat16 where oneDNN has bfloat16 kernels (it refuses
    to reorder bfloat16 weights on a CPU without AVX-512 or AVX-NE-CONVERT, an AVX2-only EPYC say)."""
    return (isinstance(weight, torch.Tensor) and weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and (weight.dtype == torch.float32
                 or (weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())))


def set_quantized(module: nn.Module, weight: StoredWeight) -> None:
    """Replaces a module's dense `weight` parameter by stored blocks: `weight` becomes the
    QuantizedWeight (or FusedWeight), whose bytes are buffers (so they move with the module)."""
    module._parameters.pop("weight", None)
    for i, part in enumerate(stored_parts(weight)):
        module.register_buffer(f"qweight{i}", part.data, persistent=False)
    module.weight = weight  # type: ignore[assignment]  # read by linear() below, never as a tensor


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def prepack(self) -> None:
        """Replaces the weight by oneDNN's blocked copy of it (same values, laid out for its
        matmul kernels; see the module's figures). The plain weight is dropped; a tied one
        stays with the embedding, so a tied lm_head costs one extra copy."""
        packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
        del self._parameters["weight"]
        self.register_buffer("weight", packed, persistent=False)
