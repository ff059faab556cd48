"""The scheduler (scheduler.py: the loop, its inbox and what other threads may call) and its
parts, each owning its state: the request queues, the KV memory, admission (prefill.py, in the
order of policy.py), the decode batch, the output processor and speculative decoding."""
