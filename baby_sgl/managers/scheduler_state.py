"""What the scheduler's three parts share, declared once: the loop (scheduler.py), batch formation
(scheduler_batches.py) and output processing (scheduler_output.py) are typed against this, and
Scheduler.__init__ sets every field. Only the scheduler thread touches it."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from baby_sgl.core.finish_reason import FinishReason
    from baby_sgl.core.memory_pool import ReqToTokenPool
    from baby_sgl.core.req import Req, TokenLogprobs
    from baby_sgl.managers.activity import Activity
    from baby_sgl.managers.schedule_batch import ScheduleBatch
    from baby_sgl.managers.session_controller import SessionController
    from baby_sgl.mem_cache.allocator import PagedTokenAllocator
    from baby_sgl.mem_cache.base_prefix_cache import BasePrefixCache
    from baby_sgl.model_executor.model_runner import ModelRunner
    from baby_sgl.sampling.sampler import Sampler
    from baby_sgl.speculative.ngram import NgramDrafter
    from baby_sgl.server_args import EngineArgs
    from baby_sgl.trace import Tracer


class SchedulerState:
    # Settings and collaborators.
    args: EngineArgs
    runner: ModelRunner
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: set[int]
    context_len: int
    tracer: Tracer | None
    activity: Activity  # recent batches, evictions and counters, for the dashboard
    sampler: Sampler
    drafter: NgramDrafter | None  # --speculative-algorithm NGRAM's
    # Memory: request rows, KV slots, the prefix cache, the sessions' held rows.
    req_to_token_pool: ReqToTokenPool
    allocator: PagedTokenAllocator
    tree_cache: BasePrefixCache[Any]
    sessions: SessionController
    # Requests: queued, decoding, the one whose prompt is mid-chunk, the batch of the pass in flight.
    waiting: list[Req]
    running: list[Req]
    chunked_req: Req | None
    cur_batch: ScheduleBatch | None
    # Admission.
    schedule_policy: str
    rng: random.Random  # the random policy's, seeded
    init_ratio: float
    min_ratio: float
    new_token_ratio: float
    chunk_size: int | None  # prefill tokens per pass; None: unchunked
    mixed_chunk: bool
    stats: dict[str, int]

    if TYPE_CHECKING:  # the parts call each other's, defined by the part that owns them
        def _finish(self, req: Req, reason: FinishReason) -> None: ...  # scheduler_output.py

        def _append_token(self, req: Req, token: int, logprobs: TokenLogprobs | None) -> None: ...  # scheduler_output.py

        def _sample_one(self, logits: torch.Tensor, req: Req) -> tuple[int, TokenLogprobs | None]: ...  # scheduler_output.py

        def _release(self, req: Req) -> None: ...  # scheduler_output.py

        def _emit(self, req: Req) -> None: ...  # scheduler_output.py

        def _guarded(self, req: Req, step: Callable[[], bool]) -> bool: ...  # scheduler_output.py

        def _fail_req(self, req: Req, message: str) -> None: ...  # scheduler.py

        def _plan_drafts(self, batch: ScheduleBatch) -> None: ...  # scheduler_spec.py
