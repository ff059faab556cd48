"""The offline API, shaped like SGLang's `Engine`: tokenize, submit to the scheduler, collect."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import gc
import logging
import os
import queue
import resource
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import AutoTokenizer

from baby_sgl.managers.scheduler.view import SchedulerSnapshot, scheduler_view
from baby_sgl.core.finish_reason import FinishAbort
from baby_sgl.core.req import Req, ReqOutput
from baby_sgl.managers.scheduler.scheduler import Scheduler
from baby_sgl.managers.snapshots import Progress
from baby_sgl.managers.tokenizer_manager import LogprobCursor, TokenizerManager
from baby_sgl.core.kv_cache_dtype import resolve as resolve_kv_cache_dtype
from baby_sgl.core.memory_pool import KVPool
from baby_sgl.model_config import ModelConfig
from baby_sgl.cpu import decode_step
from baby_sgl.model_executor.model_runner import ModelRunner
from baby_sgl.cpu.ops import cpu_ops
from baby_sgl.cpu.toolchain import cpu_has_native_bf16
from baby_sgl.model_loader.loader import is_gguf, load_model, resolve_model_path
from baby_sgl.distributed import tp_plan, tp_worker
from baby_sgl.distributed.tp_group import GroupBroken, TensorParallel
from baby_sgl.errors import EngineDeadError
from baby_sgl.managers.io_struct import CloseSessionReqInput, OpenSessionReqInput, SessionParams
from baby_sgl.constrained.grammar import GrammarCache
from baby_sgl.core.sampling_params import SamplingParams, ServerGrammar
from baby_sgl.server_args import SERVER_ONLY, EngineArgs
from baby_sgl.threads import fit_threads_to_cores, run_in_own_thread
from baby_sgl.validation import validate
from baby_sgl.lora.adapter import LoRAAdapter, load_adapter
from baby_sgl.lora.registry import LoRARef, LoRARegistry, parse_lora_path

logger = logging.getLogger(__name__)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_MAX_TOTAL_TOKENS = 32768  # KV pool cap on CPU when max_total_tokens is not given
CPU_MIXED_CHUNK_SIZE = 64  # default prefill chunk on CPU with --enable-mixed-chunk (see Engine._chunk_size)
_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_OUTPUT_POLL_S = 0.5  # how often a caller waiting for outputs checks that the engine still runs
_LORA_UNLOAD_POLL_S = 0.02  # how often an unload looks whether the adapter's requests have finished
DEFAULT_MAX_LORA_RANK = 16  # the adapter slots' rank without --max-lora-rank or --lora-paths


class Engine:
    """`Engine(model_path=None, **kwargs)`: keyword names are the engine's CLI flags (EngineArgs);
    the HTTP server's own settings (ServerArgs) are refused by name."""

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        server_only = sorted(set(kwargs) & set(SERVER_ONLY))
        if server_only:
            raise TypeError(f"Engine() got {', '.join(server_only)}: settings of the HTTP server (ServerArgs, "
                            "`baby-sgl serve`), not of the engine")
        args = EngineArgs(model_path=model_path, **kwargs)
        self.device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
        # Each rank takes a GPU of its own (rank r on cuda:r); a missing one would leave the others
        # waiting for it until the collectives' timeout.
        if self.device.type == "cuda" and args.tp_size > (gpus := torch.cuda.device_count()):
            raise ValueError(f"--tp-size {args.tp_size} puts each rank on a GPU of its own, and torch sees {gpus}")
        # The settings as the engine runs them: the prefill chunk resolved (-1: unchunked).
        self.engine_args = dataclasses.replace(args, chunked_prefill_size=self._chunk_size(args))
        fit_threads_to_cores()
        # On a thread of its own, which ends before the engine serves (see threads.py).
        run_in_own_thread(self._build)

    def _build(self) -> None:
        args = self.engine_args
        # --mem-fraction-static is a share of what is free before the weights load (SGLang's).
        self._memory_at_start = (self._free_memory(), self._memory_in_use()) \
            if args.mem_fraction_static is not None else None
        loaded = load_model(args.model_path, quantized=self._serve_quantized())
        self.model_config = cfg = ModelConfig.from_hf(loaded.hf_config, args.context_length)
        self.dtype = self._pick_dtype(loaded.hf_config)
        self.kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        # A directory AutoTokenizer loads (for a .gguf, its vocabulary converted), or --tokenizer-path.
        self.tokenizer_path = resolve_model_path(args.tokenizer_path, "tokenizer") if args.tokenizer_path else loaded.tokenizer_path
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path, trust_remote_code=args.trust_remote_code)
        except ValueError as e:
            if "trust_remote_code" not in str(e):
                raise
            raise ValueError(f"the tokenizer at {self.tokenizer_path} runs code of its own (auto_map): pass "
                             "--trust-remote-code (Engine(trust_remote_code=True)) to let it") from None
        if args.chat_template is not None:
            self.tokenizer.chat_template = self._read_chat_template(args.chat_template)
        self.eos_token_ids = self._eos_ids(loaded.generation_config, cfg)
        self.sampling_defaults = SamplingParams.usable_defaults(
            {k: v for k, v in loaded.generation_config.items() if k in _SAMPLING_DEFAULT_KEYS})
        self.context_len = min(args.context_length or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.tp: TensorParallel | None = None
        if args.tp_size > 1:
            tp_plan.plan(cfg, args.tp_size)  # refuses a split the model does not allow, before any process starts
            self.tp = TensorParallel(tp_worker, args.tp_size, loaded.source, self.dtype, self.device, args.context_length)
        try:
            self._start(cfg, loaded)
        except BaseException:
            if self.tp is not None:  # no rank may outlive a failed start
                self.tp.stop()
            raise
        self.model_path = loaded.source
        # Everything built so far lives as long as the engine: leave it out of the garbage
        # collector's full passes, which walked the tokenizer's and the model's millions of
        # objects during decode steps (6-9% of the samples in a profile of batch-32 steps). Undone
        # at shutdown. The young generations are collected first; a full collection here found
        # nothing to free at a server's start (347k objects walked in 0.27 s) and took 0.65 s at
        # each engine start in a process holding others' objects (the test suite).
        gc.collect(1)
        gc.freeze()
        logger.info("engine ready: %s, %s, KV pool of %d tokens in %s", loaded.source, self.dtype,
                    self.max_total_tokens, self.kv_cache_dtype)

    # ---- set-up helpers ------------------------------------------------------------------
    def _start(self, cfg: ModelConfig, loaded) -> None:
        """The model (this rank's shard of it), the KV pools and the scheduler."""
        args = self.engine_args
        runner = ModelRunner(cfg, loaded.weights, self.dtype, self.device,
                             compile_max_bs=args.torch_compile_max_bs if args.enable_torch_compile else None,
                             tp=self.tp.group if self.tp else None,
                             int8_activations=decode_step.int8_activations(args.cpu_int8_activations, self.dtype),
                             deterministic=args.enable_deterministic_inference,
                             matrix_tiles=self.device.type == "cpu"
                             and decode_step.matrix_tiles(args.cpu_matrix_tiles, self.dtype))
        # The model holds its own copies now: free the checkpoint's tensors before the KV pool
        # is allocated, or both count towards the peak memory.
        loaded.weights = iter(())
        self.max_total_tokens = self._pool_size(cfg)
        # The longest prompt: its first output token must fit the context and the KV pool.
        self.max_input_len = min(self.context_len, self.max_total_tokens - args.page_size) - 1
        # Compiled constraints (regex, JSON schema, EBNF) over this tokenizer, by their text.
        self.grammars = GrammarCache(args.grammar_backend, self.tokenizer, cfg.vocab_size, self.eos_token_ids)
        self.tokenizer_manager = TokenizerManager(self.tokenizer, cfg.vocab_size, self.sampling_defaults, self.grammars,
                                                  self.context_len, self.max_total_tokens, self.max_input_len)
        self.runner = runner  # the engine's own: what it serves with (its step, compiled graphs, model)
        initial_loras = self._enable_lora(cfg) if args.enable_lora else []
        self.scheduler = Scheduler(args, runner, self.tokenizer, self.eos_token_ids, self.max_total_tokens,
                                   self.context_len, self.max_input_len)
        for ref, adapter in initial_loras:  # read already (their ranks size the slots)
            self._add_lora(ref, lambda: adapter)  # noqa: B023 - called within the iteration

    def _enable_lora(self, cfg: ModelConfig) -> list[tuple[LoRARef, LoRAAdapter]]:
        """The adapter slots and registry; the --lora-paths adapters read and checked (the slots'
        rank is the largest of theirs unless --max-lora-rank says)."""
        args = self.engine_args
        refs = [parse_lora_path(item) for item in args.lora_paths]
        targets = set(args.lora_target_modules)
        self.lora_targets = None if not targets or "all" in targets else frozenset(targets)
        loaded = [(ref, load_adapter(ref.lora_name, ref.lora_path, cfg, args.max_lora_rank or 1 << 16,
                                     self.lora_targets)) for ref in refs]
        self.max_lora_rank = args.max_lora_rank or max((a.rank for _, a in loaded), default=DEFAULT_MAX_LORA_RANK)
        self.lora_pool = self.runner.enable_lora(args.max_loras_per_batch, self.max_lora_rank, args.lora_eviction_policy)
        self.tokenizer_manager.lora_registry = LoRARegistry(args.max_loaded_loras)
        return loaded

    def _serve_quantized(self) -> bool:
        """Whether a GGUF's quantized matrices stay as they are (see layers/quantization.py)."""
        args = self.engine_args
        if args.quantization == "none" or args.tp_size > 1 or args.enable_torch_compile:
            return False
        if not is_gguf(resolve_model_path(args.model_path)):
            if args.quantization == "gguf":
                raise ValueError("--quantization gguf needs a .gguf model file")
            return False
        if self.device.type != "cpu" or cpu_ops() is None:
            logger.warning("quantized GGUF weights are dequantized at load: their kernel runs on a CPU with a C++ "
                           "compiler only")
            return False
        return True

    @staticmethod
    def _read_chat_template(path: str) -> str:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"chat_template: cannot read {path!r}: {e.strerror}") from None
        try:
            import jinja2

            jinja2.Environment().parse(text)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat_template {path!r} is not a valid Jinja template: {e.message} (line {e.lineno})") from None
        return text

    def _pick_dtype(self, hf_config: dict) -> torch.dtype:
        if self.engine_args.dtype != "auto":
            return _DTYPES[self.engine_args.dtype]
        if self.device.type == "cpu":
            # bfloat16 halves the bytes every step reads, but only CPUs with bf16 units compute
            # it fast; elsewhere float32 is both faster and exact.
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        return _DTYPES.get(str(hf_config.get("torch_dtype") or hf_config.get("dtype")), torch.bfloat16)

    def _chunk_size(self, args: EngineArgs) -> int:
        """Tokens per prefill pass (-1: unchunked). With --enable-mixed-chunk every chunk delays
        the running streams' next token, so on CPU it is small: 64 tokens kept their inter-token
        p99 within 4x the median with a 4000-token prompt arriving (96: 4.6x, 256: 12x; see
        docs/benchmarks.md). Otherwise 2048, as SGLang on a small GPU."""
        size = args.chunked_prefill_size
        if size is None:
            return CPU_MIXED_CHUNK_SIZE if self.device.type == "cpu" and args.enable_mixed_chunk else 2048
        return -1 if size <= 0 else size  # SGLang: -1 disables chunking

    def _eos_ids(self, gen: dict, cfg: ModelConfig) -> list[int]:
        """As SGLang: the ids the model's generation_config or config name, and the tokenizer's."""
        ids = set(cfg.eos_token_ids)
        for eos in (gen.get("eos_token_id"), self.tokenizer.eos_token_id):
            ids |= {eos} if isinstance(eos, int) else set(eos or [])
        return sorted(ids)

    def _pool_size(self, cfg: ModelConfig) -> int:
        """KV slots: --max-total-tokens, or what --mem-fraction-static leaves (the smaller of the
        two if both are given), else a share of the free memory; the last two at most the cap."""
        args = self.engine_args
        # Tensor parallelism: on CPU the ranks share the memory, so count every rank's KV heads;
        # on CUDA each rank has its own device, so count the largest share.
        kv_heads = tp_plan.kv_heads_per_token(cfg, args.tp_size) if self.device.type == "cpu" else \
            max(s.kv_heads[1] - s.kv_heads[0] for s in tp_plan.plan(cfg, args.tp_size))
        # The pool is sized in bytes: a smaller --kv-cache-dtype holds more tokens in the same
        # memory (the caps are tokens of the model's dtype, as bytes).
        full = KVPool.bytes_per_token(cfg.num_layers, kv_heads, cfg.head_dim, self.dtype)
        per_token = KVPool.bytes_per_token(cfg.num_layers, kv_heads, cfg.head_dim, self.kv_cache_dtype)
        if self.device.type == "cuda":
            # Slots past every running request at full context only cache prefixes: for a small
            # model, 80% of a large GPU would be hundreds of millions of them, each tracked by
            # the allocator and walked by the memory check.
            cap = args.max_running_requests * self.context_len * full
        else:
            cap = _CPU_MAX_TOTAL_TOKENS * full
        sizes = [args.max_total_tokens] if args.max_total_tokens else []
        if args.mem_fraction_static is not None:
            # SGLang's rule: the weights and the pool take this share of the memory free at start.
            # What this process took since is counted, not what the device lost: engines starting
            # together on one device (--dp-size workers) do not count each other's weights.
            assert self._memory_at_start is not None
            free_at_start, in_use_at_start = self._memory_at_start
            share, taken = int(free_at_start * args.mem_fraction_static), self._memory_in_use() - in_use_at_start
            budget = share - taken
            if budget < 2 * args.page_size * per_token:
                raise ValueError(
                    f"--mem-fraction-static {args.mem_fraction_static} leaves no room for the KV pool: "
                    f"{share / 2**30:.2f} GiB of the {free_at_start / 2**30:.2f} GiB free at start, and the "
                    f"weights took {taken / 2**30:.2f} GiB; raise it")
            sizes.append(min(budget, cap) // per_token)
        if not sizes:
            budget = int(self._free_memory() * (0.8 if self.device.type == "cuda" else 0.2))
            sizes.append(min(budget, cap) // per_token)
        size = min(sizes) // args.page_size * args.page_size
        if size < 2 * args.page_size:
            raise ValueError(f"max_total_tokens={args.max_total_tokens} is too small for page_size={args.page_size}")
        return size

    def _memory_in_use(self) -> int:
        """Bytes this process holds: torch's reserved GPU memory, or its resident set in RAM."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            return torch.cuda.memory_reserved(self.device)
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:  # no procfs: the peak resident set (kB on Linux) stands in
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def _free_memory(self) -> int:
        """Bytes the device can still give: a GPU's free memory (torch's cached blocks returned
        first), or RAM's MemAvailable (the page cache counted free, as SGLang counts it)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            return torch.cuda.mem_get_info(self.device)[0]
        try:
            with open("/proc/meminfo") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration):
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    # ---- requests ------------------------------------------------------------------------
    def submit(self, prompt: str | None = None, sampling_params: dict | None = None,
               input_ids: list[int] | None = None, rid: str | None = None, stream: bool = False,
               on_output: Callable[[dict], None] | None = None, session_params: dict | None = None,
               partial_logprobs: bool = True, server_grammar: ServerGrammar | None = None,
               lora_path: str | None = None, **logprob_options: Any) -> list[Req]:
        """Starts one request (n of them if sampling_params has n > 1) and returns at once.
        on_output(chunk) is called from the scheduler thread with each new piece (stream) or
        only the final result; chunk["finished"] tells which. Each piece's logprob lists hold only
        its own entries (the prompt's in the first piece that has them), so a stream costs what its
        output does; partial_logprobs=False leaves them out of every piece but the last, which then
        holds them all (for a consumer that only keeps the end). logprob_options: as `generate`.
        server_grammar: the constraint a server front end built for the request (chat tools).
        lora_path: the name of the LoRA adapter to run with. Raises ValueError on bad input."""
        self.tokenizer_manager.check_session_logprobs(session_params, logprob_options)
        made, _ = self.tokenizer_manager.make_reqs(prompt, input_ids, sampling_params, rid, server_grammar=server_grammar,
                                                   lora_path=lora_path, **logprob_options)
        reqs = [r for r in made if isinstance(r, Req)]
        if len(reqs) < len(made):
            raise next(e for e in made if isinstance(e, ValueError))
        for req in reqs:
            req.stream = stream
            req.on_output = None if on_output is None else self._piece_sender(on_output, partial_logprobs)
        self._enqueue(reqs, session_params)
        return reqs

    def _piece_sender(self, on_output: Callable[[dict], None], partial_logprobs: bool) -> Callable[[ReqOutput], None]:
        """One request's scheduler outputs, each as the piece `submit` promises."""
        since = LogprobCursor() if partial_logprobs else None

        def send(out: ReqOutput) -> None:
            on_output(self.tokenizer_manager.chunk(out, partial_logprobs or out.finished, since))

        return send

    def _enqueue(self, reqs: list[Req], session_params: dict | SessionParams | None) -> None:
        if session_params is None:
            for req in reqs:
                self.scheduler.submit(req)
            return
        params = validate(SessionParams, session_params, "session_params")
        if len(reqs) != 1:
            raise ValueError("a session turn is one request: give one prompt and n = 1")
        self.scheduler.submit_session_turn(reqs[0], params)

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, stream: bool = False,
                 rid: str | list[str] | None = None, return_logprob: bool = False,
                 top_logprobs_num: int = 0, session_params: dict | None = None, logprob_start_len: int = -1,
                 token_ids_logprob: list[int] | None = None,
                 return_text_in_logprobs: bool = False,
                 lora_path: str | list[str | None] | None = None) -> dict | list[dict] | Iterator[dict]:
        """One prompt -> a dict; several -> a list. A bad request raises ValueError when alone;
        inside a batch it gets an `error` result and the others still run. With session_params
        ({"id", "rid", "offset", "replace", "drop_previous_output"}) the prompt is a turn of an
        open session (see open_session). Logprobs as SGLang: return_logprob adds the output
        tokens' to meta_info, logprob_start_len >= 0 the prompt's from that position,
        top_logprobs_num the k best of each, token_ids_logprob those of the given ids. lora_path:
        the LoRA adapter (its name) of every prompt, or a list with each prompt's (None: the base
        model)."""
        options: dict[str, Any] = {"return_logprob": return_logprob, "top_logprobs_num": top_logprobs_num,
                                   "logprob_start_len": logprob_start_len, "token_ids_logprob": token_ids_logprob,
                                   "return_text_in_logprobs": return_text_in_logprobs}
        self.tokenizer_manager.check_session_logprobs(session_params, options)
        reqs, single = self.tokenizer_manager.make_reqs(prompt, input_ids, sampling_params, rid, lora_path=lora_path,
                                                        **options)
        if single and len(reqs) == 1 and isinstance(reqs[0], ValueError):
            raise reqs[0]
        outputs: queue.Queue[ReqOutput] = queue.Queue()
        live = [r for r in reqs if isinstance(r, Req)]
        for req in live:
            req.stream, req.on_output = stream, outputs.put
        self._enqueue(live, session_params)
        chunks = self._stream(reqs, live, outputs)
        if stream:
            return chunks
        for _ in chunks:
            pass
        results = [self.tokenizer_manager.error_result(r) if isinstance(r, ValueError) else self.tokenizer_manager.result(r) for r in reqs]
        return results[0] if single and len(results) == 1 else results

    def _stream(self, reqs: list, live: list[Req], outputs: queue.Queue[ReqOutput]) -> Iterator[dict]:
        index = {id(r): i for i, r in enumerate(reqs)}
        for i, r in enumerate(reqs):
            if isinstance(r, ValueError):
                yield {"index": i, **self.tokenizer_manager.error_result(r)}
        pending = len(live)
        try:
            while pending:
                try:
                    out = outputs.get(timeout=_OUTPUT_POLL_S)
                except queue.Empty:
                    if not self.scheduler.is_alive() and outputs.empty():
                        raise EngineDeadError("the engine stopped before these requests finished") from None
                    continue
                if out.finished and self.failure() is not None:
                    reason = out.finish_reason
                    raise EngineDeadError(reason.message if isinstance(reason, FinishAbort) else "the engine has stopped")
                pending -= out.finished
                yield {**self.tokenizer_manager.chunk(out), "index": index[id(out.req)]}
        finally:
            for req in live:  # a consumer that stops early must not leave requests running
                if not req.finished:
                    self.abort_request(req.rid)

    def chat(self, messages: list[dict], sampling_params: dict | None = None, stream: bool = False, **kw):
        return self.generate(input_ids=self.apply_chat_template(messages), sampling_params=sampling_params,
                             stream=stream, **kw)

    def apply_chat_template(self, messages: list[dict], template_kwargs: dict[str, Any] | None = None,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat template applied to messages (with template_kwargs as its variables, e.g.
        enable_thinking, and tools, OpenAI's function definitions) and tokenized, ending where
        the answer starts."""
        return self.tokenizer_manager.apply_chat_template(messages, template_kwargs, tools)

    def encode_prompt_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's text as ids, refused by its length before it is all tokenized when it cannot
        fit the prompt limit (TokenizerManager.encode)."""
        return self.tokenizer_manager.encode(text, add_special_tokens)

    def chat_template_knows_tools(self) -> bool:
        """The chat template renders `tools` and tool calls itself."""
        return self.tokenizer_manager.template_knows_tools()

    def token_text(self, token: int) -> str:
        """One token's text, special tokens included."""
        return self.tokenizer_manager.token_text(token)

    # ---- LoRA adapters ---------------------------------------------------------------------
    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
        """Reads, checks and serves a PEFT adapter under lora_name (LoRAError, a ValueError, naming
        the problem); pinned keeps it in its batch slot. Returns SGLang's answer plus the load time."""
        registry = self._lora_registry()
        t0 = time.perf_counter()
        adapter = self._add_lora(LoRARef(lora_name, lora_path, pinned), lambda: load_adapter(
            lora_name, lora_path, self.model_config, self.max_lora_rank, self.lora_targets))
        return {"success": True, "loaded_adapters": {r.lora_name: r.lora_path for r in registry.refs()},
                "load_time_s": time.perf_counter() - t0, "adapter_bytes": adapter.nbytes()}

    def _add_lora(self, ref: LoRARef, read: Callable[[], LoRAAdapter]) -> LoRAAdapter:
        """Serves the adapter read() gives under ref. Its name and a place under --max-loaded-loras
        are reserved first: a taken name or a full server costs no read of the file."""
        registry = self._lora_registry()
        ref = registry.begin_load(ref)
        ok = False
        try:
            adapter = read()
            self.scheduler.call(lambda: self.lora_pool.add(ref.lora_id, adapter, ref.pinned))
            ok = True
        finally:
            registry.finish_load(ref, ok)
        return adapter

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Stops serving the adapter: new requests naming it are refused at once, and it is
        unloaded when the requests running with it have finished (this call waits for them)."""
        registry = self._lora_registry()
        lora_id = registry.remove(lora_name).lora_id
        while self.scheduler.call(lambda: self.scheduler.uses_lora(lora_id)):
            time.sleep(_LORA_UNLOAD_POLL_S)
        self.scheduler.call(lambda: self.lora_pool.remove(lora_id))
        return {"success": True, "loaded_adapters": {r.lora_name: r.lora_path for r in registry.refs()}}

    def lora_adapters(self) -> list[LoRARef]:
        """The adapters served now."""
        return [] if self.tokenizer_manager.lora_registry is None else self.tokenizer_manager.lora_registry.refs()

    def _lora_registry(self) -> LoRARegistry:
        if self.tokenizer_manager.lora_registry is None:
            raise ValueError("LoRA adapters are not served: start the engine with enable_lora=True or lora_paths")
        return self.tokenizer_manager.lora_registry

    # ---- sessions ------------------------------------------------------------------------
    def open_session(self, capacity_of_str_len: int, session_id: str | None = None, streaming: bool = False,
                     timeout: float | None = None) -> str:
        """Opens a session and returns its id. Turns name it in `session_params["id"]`; a
        streaming session keeps its KV between turns (see managers/session_controller.py).
        An idle session closes by itself after `timeout` seconds, if given."""
        params = validate(OpenSessionReqInput, {"capacity_of_str_len": capacity_of_str_len, "session_id": session_id,
                                                "streaming": streaming, "timeout": timeout})
        return self.scheduler.open_session(params)

    def close_session(self, session_id: str) -> None:
        """Releases what the session holds, at once or when its running turn ends."""
        params = validate(CloseSessionReqInput, {"session_id": session_id})
        self.scheduler.close_session(params.session_id)

    # ---- control -------------------------------------------------------------------------
    def progress(self) -> Progress:
        """Running and waiting requests and the last forward pass's time, as of the scheduler
        loop's last turn: any thread may ask, and it never waits for the loop."""
        return self.scheduler.progress

    def num_queued(self) -> int:
        """Requests not yet admitted (waiting or still being handed over); any thread."""
        return self.scheduler.num_queued()

    def abort_request(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def check_memory(self) -> dict[str, int]:
        """Asserts invariant 4 inside the scheduler thread; returns the slot counts."""
        return self.scheduler.check_memory()

    def flush_cache(self) -> bool:
        if not self.scheduler.flush():
            return False
        self.grammars.clear()  # as SGLang: flushing forgets compiled grammars too
        return True

    def get_server_info(self) -> dict[str, Any]:
        """The engine's settings and the scheduler's counters, as fresh as this call (read from
        what the scheduler publishes every turn: no work in its thread)."""
        return self._server_info(self.scheduler.load())

    async def get_server_info_async(self) -> dict[str, Any]:
        """get_server_info, waiting on the running event loop."""
        return self._server_info(await self.scheduler.load_async())

    def _server_info(self, load: dict[str, Any]) -> dict[str, Any]:
        info = dataclasses.asdict(self.engine_args)
        info.update(max_total_tokens=self.max_total_tokens, context_len=self.context_len, dtype=str(self.dtype),
                    model_path=self.model_path)
        return info | load

    def scheduler_view(self, max_nodes: int = 200, full_rids: bool = True) -> dict[str, Any]:
        """The radix tree (at most max_nodes nodes: the hottest paths), the KV pool by owner, the
        running and waiting requests and recent activity, from a snapshot the scheduler takes at a
        bounded rate however many ask (see managers/snapshots.py), fresh for this call; request
        ids shortened unless full_rids. Ages and times are as of the snapshot, taken
        `snapshot_age_s` before (an idle scheduler's stands until something changes)."""
        snapshot = self.scheduler.view_snapshot()
        return self.describe_snapshot(snapshot, max_nodes, full_rids) | snapshot.age()

    async def scheduler_snapshot_async(self) -> SchedulerSnapshot:
        """The snapshot scheduler_view describes, waiting on the running event loop."""
        return await self.scheduler.view_snapshot_async()

    def describe_snapshot(self, snapshot: SchedulerSnapshot, max_nodes: int, full_rids: bool) -> dict[str, Any]:
        """scheduler_view of a snapshot: each node's and eviction's first tokens decoded as text."""
        view = scheduler_view(snapshot, max_nodes, full_rids)
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=False)
        stack = [view["tree"]["root"]] if view["tree"] else []
        while stack:
            node = stack.pop()
            node["text"] = decode(node.pop("head"))
            stack.extend(node["children"])
        for eviction in view["activity"]["evictions"]:
            eviction["texts"] = [decode(h) for h in eviction.pop("heads")]
        return view

    def is_alive(self) -> bool:
        """False once the scheduler has stopped (shut down, or failed beyond recovery)."""
        return self.scheduler.is_alive()

    def failure(self) -> BaseException | None:
        """What stopped the scheduler if it failed beyond recovery; None while it serves or after
        a shutdown."""
        return self.scheduler.failure()

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """Calls callback(error), from the scheduler thread, if the engine fails beyond recovery."""
        self.scheduler.on_death(callback)

    def shutdown(self) -> None:
        gc.unfreeze()
        ended = self.scheduler.shutdown()
        if self.tp is not None:
            self.tp.stop(in_step=ended and not isinstance(self.scheduler.failure(), GroupBroken))
        if ended:  # no pass runs over the KV pool any more: its memory goes back now
            self.runner.release_memory()
            _return_freed_memory()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _return_freed_memory() -> None:
    """Hands freed heap memory back to the system (glibc's malloc_trim; elsewhere nothing). glibc
    raises its mmap threshold to the size of each large block freed, up to 32 MB, so the KV
    pool's per-layer buffers come from its heap, which it keeps after they are freed: a stopped
    engine's pool stayed resident and the next engine's came on top (the default model's float32
    engines, one after another in one process: 2.0 GB, 3.6 GB; trimmed, 0.5 GB)."""
    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return
    if trim is not None:
        trim(0)
