"""LoRA adapters: read in PEFT's format (adapter.py), held in batch slots on the model's device
(memory_pool.py), named by clients (registry.py)."""
