"""Our CPU kernels and everything that builds and calls them: the C++ sources (csrc/), the
toolchain that builds them once per CPU into the cache (toolchain.py), the compiled ops the layers
use (ops.py), the one-call decode step (decode_step.py) and the decode-attention kernel
(decode_attention.py)."""
