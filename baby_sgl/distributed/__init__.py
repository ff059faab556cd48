"""Tensor parallelism over torch.distributed: how a model is split (tp_plan), the processes and
their messages (tp_group), and the follower ranks' loop (tp_worker)."""
