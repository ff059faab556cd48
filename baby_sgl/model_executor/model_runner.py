"""Loads the model, owns the KV pools and the attention backend, and runs one forward pass."""

from __future__ import annotations

import functools
import hashlib
import logging
from typing import Any

import torch
import torch.nn.functional as F

from baby_sgl.attention.registry import create_attention_backend
from baby_sgl.cpu.ops import cpu_ops
from baby_sgl.distributed import tp_plan
from baby_sgl.distributed.tp_group import CheckMemory, Forward, GroupBroken, InitPool, TPGroup
from baby_sgl.core.kv_cache_dtype import resolve as resolve_kv_cache_dtype
from baby_sgl.core.memory_pool import KVPool, ReqToTokenPool
from baby_sgl.model_config import ModelConfig
from baby_sgl.core.forward_batch import ForwardBatch, ForwardMode, ModelWorkerBatch
from baby_sgl.layers import quantization
from baby_sgl.layers.linear import Linear, can_prepack
from baby_sgl.layers.moe import SparseMoE
from baby_sgl.model_executor.compile import CompiledDense
from baby_sgl.cpu import decode_step
from baby_sgl.lora.memory_pool import LoRABatch, LoRAMemoryPool
from baby_sgl.models.llama import (EAGER, DenseFns, LlamaForCausalLM, attention_in, attention_out_mlp,
                                   attention_out_moe, attention_out_sandwich)
from baby_sgl.models.registry import get_model_class
from baby_sgl.cpu.toolchain import cxx_compiler

logger = logging.getLogger(__name__)

# Rows of an extend pass per call of the one-call step, which keeps float32 working rows for its
# largest call (~156 KB a row on a 1.7B model): a 2048-token chunk in one call would hold 320 MB.
# A 1000-token prefill of the 1.7B shape took 6.65 s in calls of 256 rows, 6.63 s of 512, 6.86 s whole.
STEP_ROWS = 512


def _rows_within(rows: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
    """Those of rows (ascending) in [c0, c1), counted from c0."""
    return rows[(rows >= c0) & (rows < c1)] - c0


class ModelRunner:
    """With tp (tensor parallelism), this rank's shard of the model and of the KV pool; rank 0
    sends each batch to the other ranks before running its part (distributed/tp_group.py)."""

    def __init__(self, cfg: ModelConfig, weights, dtype: torch.dtype, device: torch.device,
                 attention_backend: str = "torch_native", compile_max_bs: int | None = None,
                 tp: TPGroup | None = None, int8_activations: bool = False, deterministic: bool = False,
                 matrix_tiles: bool = False) -> None:
        self.tp = tp
        self.int8_activations = int8_activations  # the decode step's (decode_step.int8_activations)
        self.matrix_tiles = matrix_tiles  # bfloat16 batches on the matrix tiles (decode_step.matrix_tiles)
        # --enable-deterministic-inference: each product's kernel in the one-call step is chosen by
        # the weight's format alone, never by the row count (each row's arithmetic is then its own),
        # so a request's bits do not depend on its batch, its prompt's chunks or where its prefix's
        # KV came from.
        self.deterministic = deterministic
        self.dense = EAGER
        if tp is not None:
            shard = tp_plan.plan(cfg, tp.size)[tp.rank]
            weights = tp_plan.shard_weights(weights, cfg, shard)
            cfg = tp_plan.local_config(cfg, shard)
            self.dense = DenseFns(attention_in, functools.partial(attention_out_mlp, reduce=tp.all_reduce),
                                  functools.partial(attention_out_moe, reduce=tp.all_reduce),
                                  functools.partial(attention_out_sandwich, reduce=tp.all_reduce))
        self.cfg, self.dtype, self.device = cfg, dtype, device
        with torch.device("meta"):
            model: LlamaForCausalLM = get_model_class(cfg)(cfg)
        # Built on the meta device so no time goes into random initialisation.
        model = model.to_empty(device=device)
        model.tie_weights()
        model.load_weights(weights)
        self.model = model.to(dtype).eval()
        if int8_activations:
            quantization.round_activations_to_int8(self.model)
            ops = cpu_ops() if device.type == "cpu" else None
            if ops is not None and ops.has_int8_gemm:
                quantization.group_for_int8_products(self.model)
        if matrix_tiles:
            quantization.use_matrix_tiles(self.model)
        self.attn_backend = create_attention_backend(attention_backend, device, cfg.num_heads // cfg.num_kv_heads,
                                                     cfg.sliding_window, len(cfg.sliding_layers) == cfg.num_layers)
        self._req_to_token_pool: ReqToTokenPool | None = None  # built by init_memory_pool
        self._kv_pool: KVPool | None = None
        self.compiled: CompiledDense | None = None
        self.step: decode_step.CpuDecodeStep | None = None
        self.lora_pool: LoRAMemoryPool | None = None  # set by enable_lora
        if compile_max_bs:
            self._enable_compile(compile_max_bs)
        # The one-call decode step reads plain or quantized weights; without it (or with compiled
        # graphs) the dense layers run op by op, where oneDNN's prepacked weights are faster.
        self.step_ops = cpu_ops() if (device.type == "cpu" and tp is None and self.compiled is None and
                                      decode_step.can_run(self.model, dtype)) else None
        if deterministic and self.step_ops is None:
            raise ValueError("--enable-deterministic-inference needs the CPU's one-call step, which this model does not "
                             f"run on: device {device.type}, dtype {dtype}, C++ ops "
                             f"{'built' if cpu_ops() is not None else 'unavailable (no compiler)'}")
        if self.compiled is None and self.step_ops is None:
            self._prepack_linear_weights()

    def _prepack_linear_weights(self) -> None:
        linears = [m for m in self.model.modules() if isinstance(m, Linear) and can_prepack(m.weight)]
        for m in linears:
            m.prepack()
        for moe in [m for m in self.model.modules() if isinstance(m, SparseMoE) and m.prepack_pays()]:
            moe.prepack()

    def _enable_compile(self, max_bs: int) -> None:
        # Inductor builds its CPU kernels with the C++ compiler, and Triton its GPU launchers with the
        # C compiler that comes beside it: without one, the first compiled call would fail.
        if cxx_compiler() is None:
            logger.warning("--enable-torch-compile: no C++ compiler found (g++, c++ or clang++); running eager")
            return
        self.compiled = CompiledDense(self.model, max_bs)
        logger.info("torch.compile warm-up: %.1f s for decode batch sizes %s", self.compiled.warmup_s,
                    self.compiled.buckets)

    def enable_lora(self, max_loras_per_batch: int, max_lora_rank: int, eviction_policy: str) -> LoRAMemoryPool:
        """Serves LoRA adapters (before init_memory_pool, whose decode step reads their slots)."""
        if self.tp is not None:
            raise ValueError("--enable-lora does not support tensor parallelism (--tp-size > 1)")
        self.lora_pool = LoRAMemoryPool(self.cfg, max_loras_per_batch, max_lora_rank, self.device, eviction_policy,
                                        self.dtype)
        return self.lora_pool

    @property
    def req_to_token_pool(self) -> ReqToTokenPool:
        assert self._req_to_token_pool is not None, "init_memory_pool first"
        return self._req_to_token_pool

    @property
    def kv_pool(self) -> KVPool:
        assert self._kv_pool is not None, "init_memory_pool first"
        return self._kv_pool

    @property
    def is_leader(self) -> bool:
        """Rank 0 (or no tensor parallelism): the rank that schedules, samples and computes logits."""
        return self.tp is None or self.tp.rank == 0

    def init_memory_pool(self, max_total_tokens: int, max_running_requests: int, context_len: int,
                         kv_cache_dtype: str = "auto") -> ReqToTokenPool:
        """Builds the request-slot and KV pools (on every rank); returns the request-slot pool.
        kv_cache_dtype: --kv-cache-dtype, the pool's element type."""
        cfg = self.cfg
        if self.tp is not None and self.is_leader:
            self.tp.send(InitPool(max_total_tokens, max_running_requests, context_len, kv_cache_dtype))
        self._req_to_token_pool = ReqToTokenPool(max_running_requests, context_len, self.device,
                                                 journal=self.tp is not None and self.is_leader)
        self._kv_pool = KVPool(max_total_tokens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device,
                               resolve_kv_cache_dtype(kv_cache_dtype, self.dtype))
        if self.step_ops is not None:
            self.step = decode_step.CpuDecodeStep(self.step_ops, self.model, self.kv_pool, self.req_to_token_pool,
                                               self.int8_activations, self.deterministic,
                                               self.lora_pool, self.matrix_tiles)
        return self.req_to_token_pool

    def release_memory(self) -> None:
        """Lets go of the KV pool, the decode step that reads it and the op-by-op path's gathers
        of it, once no pass runs (the engine stopped): their memory goes back then, not when the
        engine itself is collected."""
        self.step = None
        self.attn_backend.workspace.release()
        if self._kv_pool is not None:
            self._kv_pool.release()

    def forward(self, b: ModelWorkerBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits, one row per request, and the hidden states of input_logprob_rows
        (turned into logits by compute_logits, a slice at a time); (None, None) on ranks but 0."""
        if self.tp is None:
            return self._forward(b)
        try:
            if self.is_leader:
                self.tp.send(Forward(b, self.req_to_token_pool.take_journal()))
            return self._forward(b)
        except Exception as e:
            raise GroupBroken(f"tensor-parallel rank {self.tp.rank}: a pass failed: {e!r}") from e

    def _forward(self, b: ModelWorkerBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        lora_slots = None if self.lora_pool is None or not any(b.lora_ids) else self.lora_pool.prepare(b.lora_ids)
        if self.step is not None and b.mode == ForwardMode.DECODE:
            logits, _ = self.step.run(b.input_ids, b.positions, b.out_cache_loc, b.req_pool_indices, b.seq_lens,
                                      lora_slots)
            return logits, None
        if self.step is not None:
            return self._extend_in_step(b, lora_slots)
        dev = self.device
        input_ids, positions, dense = b.input_ids, b.positions, self.dense
        # The compiled graphs take no adapters: a pass with some runs eager.
        compiled = self.compiled if b.mode == ForwardMode.DECODE and lora_slots is None else None
        bucket = compiled.bucket(len(input_ids)) if compiled is not None else None
        if compiled is not None and bucket is not None:
            # Padded to the bucket's static shape; the padding never leaves the model.
            pad = bucket - len(input_ids)
            input_ids, positions = input_ids + [0] * pad, F.pad(positions, (0, pad))
            dense = compiled.fns
        fb = ForwardBatch(
            mode=b.mode,
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=positions.to(dev),
            out_cache_loc=b.out_cache_loc.to(dev),
            req_pool_indices=torch.tensor(b.req_pool_indices, dtype=torch.long, device=dev),
            seq_lens=torch.tensor(b.seq_lens, dtype=torch.long, device=dev),
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            seq_lens_cpu=b.seq_lens,
            extend_prefix_lens_cpu=b.extend_prefix_lens,
            extend_seq_lens_cpu=b.extend_seq_lens,
            num_decode_reqs=b.num_decode_reqs,
            input_logprob_rows=None if b.input_logprob_rows is None else
            torch.tensor(b.input_logprob_rows, dtype=torch.long, device=dev),
            lora=None if lora_slots is None else self._lora_batch(lora_slots, b.extend_seq_lens),
        )
        self.attn_backend.init_forward_metadata(fb)
        return self.model(fb, dense, logits=self.is_leader)

    def _extend_in_step(self, b: ModelWorkerBatch,
                        lora_slots: list[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An extend (or mixed) pass in the one-call step: a row per new token, row i of a request
        whose prefix holds a tokens seeing its first a + i + 1 slots (with the request's adapter),
        STEP_ROWS rows per call (a later call's rows read the KV an earlier one wrote)."""
        assert self.step is not None

        def host(values: list[int]) -> torch.Tensor:  # the step's row lists live on the host
            return torch.tensor(values, dtype=torch.long, device="cpu")

        ext = host(b.extend_seq_lens)
        total = int(ext.sum())
        first = torch.cumsum(ext, 0) - ext  # each request's first row
        rows = host(b.req_pool_indices).repeat_interleave(ext)
        lens = (host(b.extend_prefix_lens) - first + 1).repeat_interleave(ext) + torch.arange(total, device="cpu")
        slots = None if lora_slots is None else host(lora_slots).repeat_interleave(ext)
        last = first + ext - 1
        wanted = None if not b.input_logprob_rows else host(b.input_logprob_rows)
        logits, hidden = [], []
        for c0 in range(0, total, STEP_ROWS):
            c1 = min(c0 + STEP_ROWS, total)
            out = self.step.run(b.input_ids[c0:c1], b.positions[c0:c1], b.out_cache_loc[c0:c1], rows[c0:c1],
                                lens[c0:c1], None if slots is None else slots[c0:c1], _rows_within(last, c0, c1),
                                None if wanted is None else _rows_within(wanted, c0, c1))
            logits.append(out[0])
            hidden.append(out[1])
        return torch.cat(logits), None if wanted is None else torch.cat(hidden)

    def _lora_batch(self, slots: list[int], extend_seq_lens: list[int]) -> LoRABatch | None:
        """The pass's adapters, each request's token rows with its slot."""
        assert self.lora_pool is not None
        return self.lora_pool.batch(slots, extend_seq_lens)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.step is not None:
            return self.step.logits(hidden)
        return self.model.compute_logits(hidden)

    def check_ranks(self) -> None:
        """Tensor parallelism: every rank's request-to-slot table must equal rank 0's and their
        KV pools have its size (run in the scheduler thread, between passes); GroupBroken if not."""
        if self.tp is None:
            return
        self.tp.send(CheckMemory(self.req_to_token_pool.take_journal()))
        digests = self.tp.gather(self.memory_digest())
        assert digests is not None, "rank 0 gathers"
        for rank, d in enumerate(digests[1:], start=1):
            if d["table"] != digests[0]["table"] or d["kv_slots"] != digests[0]["kv_slots"]:
                # Not a leak to report and serve on: every pass from now on would be wrong.
                raise GroupBroken(f"tensor-parallel rank {rank} is out of step with rank 0: {d} vs {digests[0]}")

    def memory_digest(self) -> dict[str, Any]:
        """What must agree across ranks: the request-to-slot table (byte for byte) and the KV
        pool's size; plus this rank's own KV heads."""
        table = self.req_to_token_pool.req_to_token.cpu().numpy().tobytes()
        return {"table": hashlib.sha1(table).hexdigest(), "kv_slots": self.kv_pool.size,
                "kv_heads": self.cfg.num_kv_heads}
