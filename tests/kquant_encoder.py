"""GGUF blocks from float weights: the `gguf` package's quantizers where it has them, and for the
K-quants and i-quants it only dequantizes, a plain encoder of our own written from the format's
definition (ggml-common.h; round-to-nearest scales, not llama.cpp's search for the best ones):
its blocks are valid blocks of the format, which is all a decoder test or a tiny model needs."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as G
from gguf.quants import quantize

IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def encode(x: np.ndarray, kind: G) -> np.ndarray:
    """x [..., k] float32 -> uint8 [..., k / block values * block bytes]."""
    encoder = _ENCODERS.get(kind)
    if encoder is None:
        return quantize(x, kind)
    blocks = x.astype(np.float32).reshape(-1, 32 if kind == G.IQ4_NL else 256)
    return encoder(blocks).reshape(*x.shape[:-1], -1)


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def _pack_k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block -> the 12 bytes get_scale_min_k4 reads."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    out[:, 4:8] = m[:, :4] | (m[:, 4:] >> 4) << 6
    out[:, 8:12] = (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4
    return out


def _k_quant(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K (16 levels) or Q5_K (32): the header (d, dmin, scales) and each value's q [n, 8, 32]."""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - low) / (levels - 1), -low
    d, dmin = _f16(scale.max(-1) / 63), _f16(mins.max(-1) / 63)
    sc = np.clip(np.rint(_ratio(scale, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_ratio(mins, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.rint(_ratio(sub + offset[..., None], np.broadcast_to(step[..., None], sub.shape))), 0, levels - 1)
    header = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), _pack_k4_scales(sc, m)], -1)
    return header, q.astype(np.uint8)


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """Sub-blocks [n, 8, 32] -> bytes 32 (j / 2).. holding sub-block j in their low (even j) or high half."""
    return (q[:, 0::2] | q[:, 1::2] << 4).reshape(q.shape[0], -1)


def _q4_k(x: np.ndarray) -> np.ndarray:
    header, q = _k_quant(x, 16)
    return np.concatenate([header, _nibble_pairs(q & 15)], -1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    header, q = _k_quant(x, 32)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(1, dtype=np.uint8)  # bit j of byte l
    return np.concatenate([header, qh, _nibble_pairs(q & 15)], -1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = _f16(scale.max(-1) / 127)
    sc = np.clip(np.rint(_ratio(scale, d.astype(np.float32)[:, None])), -128, 127).astype(np.int8)
    step = np.broadcast_to((d.astype(np.float32)[:, None] * sc)[..., None], sub.shape)
    q = (np.clip(np.rint(_ratio(sub, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [h, g, l]
    ql = (q[:, :, 0:2] & 15) | (q[:, :, 2:4] & 15) << 4  # byte 64 h + 32 (g % 2) + l, nibble g / 2
    qh = ((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(2, dtype=np.uint8)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d[:, None].view(np.uint8)], -1)


def _nearest_level(v: np.ndarray) -> np.ndarray:
    return np.abs(v[..., None] - IQ4_VALUES).argmin(-1).astype(np.uint8)


def _iq4_nibbles(q: np.ndarray) -> np.ndarray:
    """[..., 32] levels -> 16 bytes: value j low, value j + 16 high."""
    return q[..., :16] | q[..., 16:] << 4


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    d = _f16(np.abs(x).max(-1) / 127)
    q = _nearest_level(_ratio(x, np.broadcast_to(d.astype(np.float32)[:, None], x.shape)))
    return np.concatenate([d[:, None].view(np.uint8), _iq4_nibbles(q)], -1)


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 8, 32)
    scale = np.abs(sub).max(-1) / 127
    d = _f16(scale.max(-1) / 31)
    ls = (np.clip(np.rint(_ratio(scale, d.astype(np.float32)[:, None])), -32, 31) + 32).astype(np.uint16)
    step = d.astype(np.float32)[:, None] * (ls.astype(np.float32) - 32)
    q = _nearest_level(_ratio(sub, np.broadcast_to(step[..., None], sub.shape)))
    high = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(-1, dtype=np.uint16)
    low = ((ls[:, 0::2] & 15) | (ls[:, 1::2] & 15) << 4).astype(np.uint8)
    return np.concatenate([d[:, None].view(np.uint8), high[:, None].view(np.uint8), low,
                           _iq4_nibbles(q).reshape(-1, 128)], -1)


_ENCODERS = {G.Q4_K: _q4_k, G.Q5_K: _q5_k, G.Q6_K: _q6_k, G.IQ4_NL: _iq4_nl, G.IQ4_XS: _iq4_xs}
