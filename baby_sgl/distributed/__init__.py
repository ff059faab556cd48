"""Tensor parallelism over torch.distributed: how a model is split (tp_plan), the processes and
their messages (tp_group); the follower ranks' loop is managers/tp_worker.py."""
