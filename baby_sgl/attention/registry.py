from __future__ import annotations

from baby_sgl.attention.torch_native import TorchNativeAttnBackend

ATTENTION_BACKENDS = {"torch_native": TorchNativeAttnBackend}


def create_attention_backend(name: str, device, queries_per_kv_head: int, sliding_window: int | None = None,
                             every_layer_windowed: bool = False):
    try:
        cls = ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(ATTENTION_BACKENDS)}") from None
    return cls(device, queries_per_kv_head, sliding_window, every_layer_windowed)
