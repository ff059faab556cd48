"""A linear layer whose matmul orientation for skinny inputs on CPU is fixed by the CPU's
instruction set, never by timing, so the same inputs always give the same bits.

For a few rows (decode batches) CPU BLAS speed depends on the orientation: `W @ x^T` with the
[out, in] weight ran 8 rows x (576 -> 49152) at 37 GFLOP/s against 10 for `x @ W^T` on a 2-core
AVX2 machine, while on AVX-512 machines `x @ W^T` (F.linear) is as fast or faster. The two forms
differ in float rounding, so the choice is made once per process from the CPU's capability and
kept: choosing by stopwatch would make outputs depend on machine load.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

SKINNY_ROWS = (2, 128)


@functools.cache
def skinny_transposed() -> bool:
    """W @ x^T for skinny CPU inputs: on CPUs whose widest vector unit is AVX2 or narrower."""
    return torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if (x.dim() == 2 and SKINNY_ROWS[0] <= x.shape[0] <= SKINNY_ROWS[1] and x.device.type == "cpu"
            and skinny_transposed()):
        out = (weight @ x.t()).t().contiguous()
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
