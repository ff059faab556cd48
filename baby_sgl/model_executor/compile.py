"""`--enable-torch-compile`: the dense parts of every layer (norms, projections, rope, MLP,
residuals) compiled by torch.compile (inductor; on CPU it generates C++), attention left eager.

As SGLang's graph runner does for decode, a decode batch of up to `--torch-compile-max-bs`
requests is padded to the next batch-size bucket, so a few static shapes cover every batch: one
graph per bucket and part, shared by all layers (the parts take the weights as inputs). Padded
rows are computed and dropped; they never reach the KV pool or the logits. Prefill runs eager.
Graphs are compiled at start-up (a progress bar), and inductor's cache lives in
the cache's inductor/ (cache_dirs.py), so a second start with the same model and buckets compiles little.
"""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from baby_sgl.cache_dirs import cache_root
from baby_sgl.models.llama import DenseFns, LlamaForCausalLM, attention_in, attention_out_mlp

_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def decode_buckets(max_bs: int) -> list[int]:
    return [b for b in _BUCKETS if b < max_bs] + [max_bs]


class CompiledDense:
    def __init__(self, model: LlamaForCausalLM, max_bs: int) -> None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
        self.model = model
        self.buckets = decode_buckets(max_bs)
        # One graph per bucket and part, all alive at once.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(self.buckets))
        # Inside a graph inductor chooses the matmul kernels, so the plain product is traced.
        self.fns = DenseFns(
            torch.compile(functools.partial(attention_in, lin=F.linear), dynamic=False),
            torch.compile(functools.partial(attention_out_mlp, lin=F.linear), dynamic=False),
        )
        self.warmup_s = self._warm_up()

    def bucket(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    @torch.inference_mode()
    def _warm_up(self) -> float:
        """Compiles every bucket's graphs now, not on the first requests."""
        t0 = time.perf_counter()
        layer, cfg = self.model.layers[0], self.model.config
        param = layer.input_layernorm.weight
        for b in tqdm(self.buckets, desc="torch.compile (decode batch sizes)", unit="bucket"):
            x = torch.zeros(b, cfg.hidden_size, dtype=param.dtype, device=param.device)
            cos_sin = self.model.rotary.cos_sin(torch.zeros(b, dtype=torch.long, device=param.device), x.dtype)
            q, _, _ = layer.dense_in(x, cos_sin, self.fns)
            layer.dense_out(q.contiguous(), x, self.fns)
        return time.perf_counter() - t0
