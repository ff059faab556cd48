"""Settings that torch's native libraries read once, when `import torch` loads them: set here,
before the package imports torch (baby_sgl/__init__.py imports this module first)."""

import os
import sys

# oneDNN (bfloat16 matmuls on CPU) keeps a compiled kernel, with its own reordered copy of the
# weights, for every input shape it meets, up to 1024 of them in each of two caches: a server
# seeing every prompt length grew by hundreds of MB that way. 64 holds every shape of a few
# steps.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
os.environ.setdefault("LRU_CACHE_CAPACITY", "64")

# libgomp's threads (torch's, and the one-call decode step's: cpu/csrc/step_team.h) spin 300,000
# rounds, milliseconds, after each parallel region before they sleep. A spinning thread holds a
# core that the scheduler's Python, or a neighbour process, needs: beside a one-core busy loop a
# batch-1 decode step took 36 ms with the default and 12 ms with 1,000 rounds (~10 us, as long
# as the step's own barriers spin), on a 2-core EPYC (Zen 4) where it takes 4.5 ms alone.
SPIN_SET_BEFORE_TORCH = "torch" not in sys.modules or "GOMP_SPINCOUNT" in os.environ
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
