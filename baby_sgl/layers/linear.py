"""A linear layer that learns the faster of two matmul orientations for skinny inputs on CPU.

For a few rows (decode batches) CPU BLAS speed depends on the orientation and on the machine:
`W @ x^T` with the [out, in] weight ran 8 rows x (576 -> 49152) at 37 vs 10 GFLOP/s for
`x @ W^T` on one 2-core AVX2 machine, while on a 2-core AVX-512 machine `x @ W^T` was the faster
one. A micro-benchmark on one cached weight misleads (in a real step the weights stream from
memory), so the choice is made on the real calls: for each (weight shape, dtype, row bucket) the
first calls alternate between the two and, once each has _TRIALS timings, the one with the lower
median is kept for good (shared by every layer of that shape). Both give the same result up to
float rounding. Large prefill blocks, single rows and non-CPU devices always use `F.linear`.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

SKINNY_ROWS = (2, 128)
_TRIALS = 9


class _Choice:
    def __init__(self) -> None:
        self.times: dict[bool, list[float]] = {False: [], True: []}
        self.transposed: bool | None = None  # decided: use W @ x^T

    def next_trial(self) -> bool:
        return len(self.times[True]) < len(self.times[False])

    def record(self, transposed: bool, seconds: float) -> None:
        self.times[transposed].append(seconds)
        if min(map(len, self.times.values())) >= _TRIALS:
            self.transposed = statistics.median(self.times[True]) < statistics.median(self.times[False])


_choices: dict[tuple, _Choice] = {}


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    if not transposed:
        return F.linear(x, weight, bias)
    out = (weight @ x.t()).t().contiguous()
    return out if bias is None else out + bias


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if x.dim() != 2 or not SKINNY_ROWS[0] <= rows <= SKINNY_ROWS[1] or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        key = (self.in_features, self.out_features, x.dtype, 1 << (rows - 1).bit_length())
        choice = _choices.get(key) or _choices.setdefault(key, _Choice())
        if choice.transposed is not None:
            return _matmul(x, self.weight, self.bias, choice.transposed)
        transposed = choice.next_trial()
        start = time.perf_counter()
        out = _matmul(x, self.weight, self.bias, transposed)
        choice.record(transposed, time.perf_counter() - start)
        return out
