"""A tensor-parallel rank other than 0 (`python -m baby_sgl.distributed.tp_worker`, started by
TensorParallel): loads its shard of the model, then runs whatever rank 0 sends until told to
stop. It exits if rank 0's process goes away, so no rank outlives the engine."""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time

import torch
import torch.distributed as dist

from baby_sgl.core.memory_pool import ReqToTokenPool
from baby_sgl.distributed.processes import end_without_collecting
from baby_sgl.distributed.tp_group import COLLECTIVE_TIMEOUT, CheckMemory, Forward, InitPool, Stop, TPGroup, backend_for
from baby_sgl.model_config import ModelConfig
from baby_sgl.model_executor.model_runner import ModelRunner
from baby_sgl.model_loader.loader import load_model

logger = logging.getLogger(__name__)


def serve(group: TPGroup, runner: ModelRunner) -> None:
    pool: ReqToTokenPool | None = None  # rank 0 sends InitPool before any pass
    while True:
        msg = group.recv()
        if isinstance(msg, InitPool):
            pool = runner.init_memory_pool(msg.max_total_tokens, msg.max_running_requests, msg.context_len,
                                           msg.kv_cache_dtype)
        elif isinstance(msg, Forward | CheckMemory):
            if pool is None:
                raise RuntimeError(f"rank 0 sent {type(msg).__name__} before InitPool")
            pool.apply_writes(msg.row_writes)
            if isinstance(msg, Forward):
                runner.forward(msg.batch)
            else:
                group.gather(runner.memory_digest())
        elif isinstance(msg, Stop):
            return
        else:
            raise TypeError(f"unknown message from rank 0: {msg!r}")


def _exit_with_parent(parent: int) -> None:
    """Rank 0 killed outright cannot say stop: leave when it is gone."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    end_without_collecting()
    p = argparse.ArgumentParser(prog="python -m baby_sgl.distributed.tp_worker",
                                description="one follower rank of --tp-size (rank 0 starts it; not for direct use)")
    for flag, help_ in (("--rank", "this rank (1 .. tp-size - 1)"), ("--tp-size", "ranks in the group"),
                        ("--threads", "torch threads of this rank"), ("--parent-pid", "exit when this process does")):
        p.add_argument(flag, type=int, required=True, help=help_)
    for flag, help_ in (("--init-address", "tcp://host:port of the group's rendezvous"),
                        ("--model-path", "the checkpoint rank 0 serves"), ("--dtype", "rank 0's resolved dtype"),
                        ("--device", "this rank's device")):
        p.add_argument(flag, required=True, help=help_)
    p.add_argument("--context-length", type=int, default=None, help="rank 0's --context-length")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s tp{args.rank} %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(args.parent_pid,), daemon=True).start()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", args.rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method=args.init_address, rank=args.rank,
                            world_size=args.tp_size, timeout=COLLECTIVE_TIMEOUT)
    group = TPGroup(args.rank, args.tp_size)
    loaded = load_model(args.model_path)
    runner = ModelRunner(ModelConfig.from_hf(loaded.hf_config, args.context_length), loaded.weights, getattr(torch, args.dtype), device,
                         tp=group)
    loaded.weights = iter(())  # the runner holds its own copies: free the checkpoint's
    try:
        serve(group, runner)
    except RuntimeError as e:  # the transport failed: rank 0 (or another rank) is gone
        logger.error("lost the other ranks, exiting: %s", str(e).splitlines()[0])
        return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
