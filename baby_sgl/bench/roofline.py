"""The machine's roofs, measured by the bench itself: matmul throughput at the model's shapes and
memory read bandwidth, turned into tokens/s and decode-step bounds for the loaded model."""

from __future__ import annotations

import os
import platform
import time

import torch

from baby_sgl.engine import Engine
from baby_sgl.layers.linear import Linear
from baby_sgl.layers.quantization import StoredWeight


def cpu_description() -> str:
    """The CPU's model and the instruction sets that decide which kernels can run: a figure is
    only meaningful next to these."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    shown = sorted(f for f in flags if f == "avx2" or f.startswith(("avx512", "amx", "avx_vnni")))
    return f"{model}, {os.cpu_count()} cores ({' '.join(shown) or 'no AVX2'})"


def _best_of(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_roofs(engine: Engine) -> dict[str, float]:
    cfg, dtype = engine.model_config, engine.dtype
    a = torch.randn(512, cfg.hidden_size, dtype=dtype)
    b = torch.randn(cfg.hidden_size, 2 * cfg.intermediate_size, dtype=dtype)
    gflops = 2 * a.shape[0] * a.shape[1] * b.shape[1] / _best_of(lambda: a @ b) / 1e9
    model = engine.scheduler.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    shapes = [m.weight.shape for m in linears]
    matmul_params = sum(n * k for n, k in shapes)
    # What a decode step must read: every projection once as stored (quantized blocks, or the
    # dtype's bytes), plus the norms (embedding rows are few).
    weight_bytes = sum(m.weight.nbytes if isinstance(m.weight, StoredWeight) else
                       m.weight.numel() * torch.finfo(dtype).bits // 8 for m in linears)
    flop_per_token = 2 * matmul_params
    # Read a buffer as large as the weights (within 64 MB .. 2 GB): a smaller one would be served
    # partly from a large last-level cache and overstate what a decode step can stream.
    buffer = torch.ones(min(max(weight_bytes, 64 << 20), 2 << 30) // 4, dtype=torch.float32)
    read_gb_s = buffer.numel() * 4 / _best_of(buffer.sum) / 1e9
    del buffer
    return {
        "gflops": gflops, "read_gb_s": read_gb_s, "gflop_per_token": flop_per_token / 1e9,
        "compute_roof_tok_s": gflops * 1e9 / flop_per_token,
        "weight_mb": weight_bytes / 1e6, "bandwidth_roof_step_s": weight_bytes / (read_gb_s * 1e9),
    }
