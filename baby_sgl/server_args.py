"""Engine and server settings: one dataclass whose field names are the CLI flags."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass


@dataclass
class ServerArgs:
    model_path: str | None = None
    dtype: str = "auto"
    # A GGUF's quantized matrices: None (default) or gguf serves them as they are stored on a CPU
    # with the kernel; none dequantizes them to the dtype at load (layers/quantization.py).
    quantization: str | None = None
    device: str = "auto"
    page_size: int = 1
    disable_radix_cache: bool = False
    # Tokens prefilled per pass at most; None: the engine picks (see Engine), -1: no chunking.
    chunked_prefill_size: int | None = None
    # Prefill chunks share their pass with the running requests' decode step (needs chunking).
    enable_mixed_chunk: bool = False
    max_prefill_tokens: int = 8192
    max_total_tokens: int | None = None
    max_running_requests: int = 64
    schedule_policy: str = "fcfs"
    # The library that compiles regex / json_schema / ebnf constraints; none: constraints refused.
    grammar_backend: str = "llguidance"
    # Scales the KV room reserved for running requests' future tokens: lower admits more
    # requests at once and retracts more often (0 reserves nothing).
    schedule_conservativeness: float = 1.0
    context_length: int | None = None
    random_seed: int = 0
    trace_file: str | None = None
    debug_memory_check: bool = False
    # torch.compile of the layers' dense parts for decode batches up to torch_compile_max_bs.
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32
    # Open sessions at most (each holds bookkeeping and, when streaming, a request row).
    max_sessions: int = 1024
    # The server's limits (see the README's "Limits and security").
    host: str = "127.0.0.1"
    port: int = 30000
    log_level: str = "warning"
    api_key: str | None = None
    max_request_bytes: int = 16 * 2**20
    request_body_timeout: float = 30.0
    max_queued_requests: int | None = 1024
    # GET /dashboard: the radix tree, KV pool and batches, live (see entrypoints/dashboard.py).
    disable_dashboard: bool = False
    # --tp-size N: the model split over N processes (torch.distributed; see distributed/).
    tp_size: int = 1
    # --dp-size N: N engine processes behind SGLang's router (sglang-router) on the one port.
    dp_size: int = 1
    router_policy: str = "cache_aware"

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 1, got {self.page_size}")
        from baby_sgl.managers.schedule_policy import SCHEDULE_POLICIES

        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, "
                             f"got {self.schedule_policy!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        from baby_sgl.layers.quantization import QUANTIZATION_CHOICES

        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {self.quantization!r}")
        if self.quantization == "gguf" and (self.tp_size > 1 or self.enable_torch_compile):
            raise ValueError("--quantization gguf runs on the CPU kernel, which --tp-size > 1 and "
                             "--enable-torch-compile do not use; pass --quantization none with them")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        for name in ("max_sessions", "max_request_bytes", "torch_compile_max_bs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not self.request_body_timeout > 0:
            raise ValueError("request_body_timeout must be > 0 seconds")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.tp_size > 1 and self.enable_torch_compile:
            raise ValueError("--enable-torch-compile does not work with --tp-size > 1 yet (the compiled layer "
                             "parts have no all-reduce inside); leave one of them out")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        from baby_sgl.entrypoints.data_parallel import ROUTER_POLICIES

        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {', '.join(ROUTER_POLICIES)}, got {self.router_policy!r}")
        if self.max_queued_requests is not None and self.max_queued_requests <= 0:
            self.max_queued_requests = None  # as SGLang: no limit

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Adds one --flag per field (underscores become dashes), as in SGLang."""
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            if f.type == "bool":
                parser.add_argument(flag, action="store_true", default=f.default)
            else:
                kind = int if "int" in f.type else float if "float" in f.type else str
                parser.add_argument(flag, type=kind, default=f.default)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})


def engine_kwargs(args: ServerArgs | argparse.Namespace) -> dict:
    """The Engine's keyword arguments: every setting but the server's own."""
    sa = args if isinstance(args, ServerArgs) else ServerArgs.from_cli_args(args)
    return {k: v for k, v in vars(sa).items() if k not in SERVER_ONLY}


# Settings of the HTTP server alone; api_key is never reported back.
SERVER_ONLY = ("host", "port", "log_level", "api_key", "max_request_bytes", "request_body_timeout", "dp_size",
               "router_policy", "disable_dashboard")
