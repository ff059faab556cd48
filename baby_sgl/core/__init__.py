"""The types every layer shares: a request (req), its sampling parameters, the request-slot and
KV pools, and one forward pass's batch. Core imports nothing above it, so the import arrows run
one way: core <- mem_cache, sampling, attention, models <- model_executor <- managers <- engine
<- entrypoints (tests/test_layering.py checks it)."""
