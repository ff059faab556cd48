"""The processes of tensor parallelism and what they say to each other.

Rank 0 is the engine's own process: its scheduler decides every batch, and its ModelRunner sends
each one to the other ranks before running its own part (one broadcast over torch.distributed:
gloo on CPU, NCCL on CUDA), as mini-sglang and nano-vllm do. The other ranks (`tp_worker`, one
process each, started here) hold their shard of the weights and of the KV pool and run every
pass in step with rank 0; the all-reduces inside the model are the only other traffic.

Which KV slots a request's tokens live in is decided on rank 0 (allocator, radix cache); each
batch carries the writes rank 0 made to its request-to-slot table since the last one, so every
rank's table stays identical and each rank's attention reads its own heads from the same slots.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist

from baby_sgl.core.forward_batch import ModelWorkerBatch
from baby_sgl.distributed.processes import child_setup, free_port, reap, split_cores

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 30.0
# gloo's timeout covers every wait, including a rank's wait for rank 0's next batch, which lasts
# as long as the server is idle: so no practical limit. A rank that dies closes its connections
# and the others fail at once; a rank 0 that dies takes the others with it (tp_worker).
COLLECTIVE_TIMEOUT = datetime.timedelta(days=3650)


class GroupBroken(BaseException):
    """A pass failed on some rank: the ranks are no longer in step (one may wait in a collective
    the others never reach), so no pass can run any more. A BaseException, so that the
    scheduler's per-batch error handling, which keeps serving, lets it through: the engine stops."""


# ---- messages from rank 0 -------------------------------------------------------------------
@dataclass
class InitPool:
    max_total_tokens: int
    max_running_requests: int
    context_len: int
    kv_cache_dtype: str


@dataclass
class Forward:
    batch: ModelWorkerBatch
    row_writes: list[tuple[int, int, list[int]]]  # (request slot, start, KV slot indices) written on rank 0 since the last pass


@dataclass
class CheckMemory:
    row_writes: list[tuple[int, int, list[int]]]  # rank 0's table writes not yet sent: applied first, so the tables can agree


@dataclass
class Stop:
    pass


class TPGroup:
    """This process's place in the tensor-parallel group and the collectives the engine uses."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums the ranks' partial results in place (after o_proj and down_proj)."""
        dist.all_reduce(x)
        return x

    def send(self, msg: object) -> None:
        dist.broadcast_object_list([msg], src=0)

    def recv(self) -> object:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: object) -> list | None:
        """Every rank's obj, on rank 0 (None elsewhere)."""
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class TensorParallel:
    """Rank 0's handle on the group: starts the other ranks, joins the process group with them,
    and stops them. One per process at a time (torch.distributed has one default group). The
    other ranks run `worker` (tp_worker, given by the engine: it drives a model runner, which
    uses this module)."""

    def __init__(self, worker: ModuleType, tp_size: int, model_path: str, dtype: torch.dtype, device: torch.device,
                 context_length: int | None = None) -> None:
        if dist.is_initialized():
            raise RuntimeError("this process already runs a tensor-parallel engine or another "
                               "torch.distributed group; shut it down first")
        self.group = TPGroup(0, tp_size)
        self.procs: list[subprocess.Popen] = []
        self._threads = torch.get_num_threads()
        cores = split_cores(tp_size)
        address = f"tcp://127.0.0.1:{free_port()}"
        try:
            for rank in range(1, tp_size):
                argv = [sys.executable, "-m", worker.__name__, "--rank", str(rank), "--tp-size",
                        str(tp_size), "--init-address", address, "--model-path", model_path,
                        "--dtype", str(dtype).removeprefix("torch."), "--device", str(device),
                        "--threads", str(len(cores[rank])), "--parent-pid", str(os.getpid())]
                if context_length is not None:  # settles the model's rope (longrope) as on rank 0
                    argv += ["--context-length", str(context_length)]
                env = dict(os.environ, OMP_NUM_THREADS=str(len(cores[rank])))
                self.procs.append(subprocess.Popen(argv, env=env, preexec_fn=child_setup(cores[rank])))
            # Rank 0 keeps running in the caller's process (not pinned: its server and scheduler
            # threads may use any core), with its share of threads for the model.
            torch.set_num_threads(len(cores[0]))
            dist.init_process_group(backend_for(device), init_method=address, rank=0, world_size=tp_size,
                                    timeout=COLLECTIVE_TIMEOUT)
        except BaseException:
            self._kill()
            torch.set_num_threads(self._threads)
            raise
        logger.info("tensor parallel: %d ranks over %s, followers %s", tp_size, backend_for(device),
                    [p.pid for p in self.procs])

    def stop(self, in_step: bool = True) -> None:
        """Tells the other ranks to stop and waits for them; kills any that do not exit. in_step:
        the ranks are between passes (rank 0's scheduler has stopped cleanly); otherwise a Stop
        could meet a rank inside a collective, so they are killed."""
        if not dist.is_initialized():
            return
        if not in_step:
            self._kill()
        elif all(p.poll() is None for p in self.procs):
            try:
                self.group.send(Stop())
            except Exception as e:  # noqa: BLE001 - a rank already gone: kill the rest below
                logger.warning("tensor parallel: could not tell the ranks to stop: %r", e)
        reap(self.procs, _STOP_TIMEOUT_S)
        self._destroy()
        torch.set_num_threads(self._threads)

    def _kill(self) -> None:
        reap(self.procs, 0)

    def _destroy(self) -> None:
        # destroy_process_group may wait on ranks that died; do not let it hold up shutdown.
        done = threading.Event()

        def destroy() -> None:
            try:
                dist.destroy_process_group()
            finally:
                done.set()

        threading.Thread(target=destroy, daemon=True).start()
        if not done.wait(10):
            logger.warning("tensor parallel: the process group did not close in time")
