"""Random-weight checkpoints of real models' shapes (`bench offline --model-shape`), built once into
the cache's checkpoints/ (cache_dirs.py): a Q4_0 GGUF file for baby-sgl and llama.cpp, and a Hugging
Face directory (bfloat16 safetensors) for vLLM and transformers, holding the very same weights.

The weights are drawn as Q4_0 blocks whose scale has four significant bits, so every value a block
stands for (scale times an integer in -8..7) is exact in bfloat16: the two files differ in layout,
not in numbers. Drawn with a fixed seed per tensor, one layer at a time (never the whole model in
float32), so the files are the same on every build."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
from safetensors.torch import save_file
from tqdm import tqdm

from baby_sgl.bench.byte_bpe import ByteBpeVocab, add_to_gguf, byte_bpe_vocab, save_hf_tokenizer
from baby_sgl.bench.model_shapes import ModelShape
from baby_sgl.cache_dirs import cache_root, write_atomically
from baby_sgl.model_loader.gguf_header import read_gguf_header
from baby_sgl.model_loader.gguf_loader import convert_tokenizer
from baby_sgl.model_loader.gguf_writer import gguf_tensor_name, new_gguf_writer, permute_rows, permuted_for_llama_cpp
from baby_sgl.model_loader.loader import default_model_path

logger = logging.getLogger(__name__)

# Part of the cache key: bump it whenever the files built change.
_VERSION = 1
CPU = torch.device("cpu")  # the files are written from host memory, whatever the default device
Q4_0_BLOCK, Q4_0_BYTES = 32, 18  # values per block; a float16 scale and 16 bytes of 4-bit values
TensorGroup = list[tuple[str, tuple[int, ...]]]  # (Hugging Face name, shape), one safetensors shard

@dataclass(frozen=True)
class Checkpoint:
    gguf: str
    hf_dir: str


def ensure_checkpoint(shape: ModelShape, seed: int = 0) -> Checkpoint:
    """The shape's checkpoint in the cache, built first if it is not there yet."""
    key = hashlib.sha1(repr((shape, seed, _VERSION)).encode()).hexdigest()[:12]
    root = cache_root() / "checkpoints" / f"{shape.name}-{key}"
    found = Checkpoint(str(root / f"{shape.name}.Q4_0.gguf"), str(root / "hf"))
    if not root.is_dir():
        logger.warning("building a random-weight %s checkpoint into %s (once)", shape.name, root)
        write_atomically(str(root), lambda tmp: _build(shape, seed, tmp))
    return found


def _build(shape: ModelShape, seed: int, out: str) -> None:
    hf_dir = os.path.join(out, "hf")
    os.makedirs(hf_dir)
    vocab = byte_bpe_vocab(shape.tokenizer, list(shape.specials), shape.vocab_size) \
        if isinstance(shape.tokenizer, int) else None
    cfg = shape.hf_config(*_bos_eos(shape, vocab))
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    groups = _tensor_groups(shape)
    w = new_gguf_writer(os.path.join(out, f"{shape.name}.Q4_0.gguf"), cfg)
    w.add_name(f"{shape.name} (random weights)")
    w.add_file_type(LlamaFileType.MOSTLY_Q4_0)
    _add_tokenizer(shape, vocab, w, hf_dir)
    for name, dims in (t for group in groups for t in group):
        if len(dims) == 2:
            nbytes = dims[0] * dims[1] // Q4_0_BLOCK * Q4_0_BYTES
            w.add_tensor_info(gguf_tensor_name(name), (dims[0], nbytes // dims[0]), np.dtype(np.uint8), nbytes,
                              raw_dtype=GGMLQuantizationType.Q4_0)
        else:
            w.add_tensor_info(gguf_tensor_name(name), dims, np.dtype(np.float32), dims[0] * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    _write_weights(shape, cfg, groups, seed, w, hf_dir)
    w.close()


def _write_weights(shape: ModelShape, cfg: dict, groups: list[TensorGroup], seed: int,
                   w: GGUFWriter, hf_dir: str) -> None:
    """Each group drawn, written to the GGUF file and as one safetensors shard, then dropped."""
    total = sum(int(np.prod(dims)) for group in groups for _, dims in group)
    weight_map = {}
    with tqdm(total=total, unit=" weights", unit_scale=True, desc=f"building {shape.name}") as bar:
        for i, group in enumerate(groups):
            shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            tensors = {}
            for name, dims in group:
                tensors[name], gguf_value = _draw(shape, name, dims, seed)
                if permuted_for_llama_cpp(cfg, name):
                    heads = cfg["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
                    gguf_value = permute_rows(gguf_value, heads)
                w.write_tensor_data(gguf_value.contiguous().numpy())
                weight_map[name] = shard
                bar.update(int(np.prod(dims)))
            save_file(tensors, os.path.join(hf_dir, shard), metadata={"format": "pt"})
    with open(os.path.join(hf_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 2 * total}, "weight_map": weight_map}, f, indent=1)


def _tensor_groups(shape: ModelShape) -> list[TensorGroup]:
    """The Hugging Face tensors, one group (one safetensors shard) per layer after the embedding's."""
    h, inter = shape.hidden_size, shape.intermediate_size
    head_dim = h // shape.num_attention_heads
    kv = shape.num_key_value_heads * head_dim
    groups: list[TensorGroup] = [[("model.embed_tokens.weight", (shape.vocab_size, h)), ("model.norm.weight", (h,))]]
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}."
        attn: TensorGroup = [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                             (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h))]
        if shape.model_type == "qwen2":
            attn += [(p + "self_attn.q_proj.bias", (h,)), (p + "self_attn.k_proj.bias", (kv,)),
                     (p + "self_attn.v_proj.bias", (kv,))]
        groups.append([(p + "input_layernorm.weight", (h,)), *attn, (p + "post_attention_layernorm.weight", (h,)),
                       (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                       (p + "mlp.down_proj.weight", (h, inter))])
    return groups


def _draw(shape: ModelShape, name: str, dims: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor as (bfloat16 for the Hugging Face file, GGUF data: Q4_0 blocks or float32), the same values."""
    if name.endswith("norm.weight"):
        ones = torch.ones(dims, device=CPU)
        return ones.bfloat16(), ones
    gen = torch.Generator(device=CPU).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if len(dims) == 1:  # a bias
        bias = (torch.randn(dims, generator=gen, device=CPU) * shape.init_std).bfloat16()
        return bias, bias.float()
    values = torch.empty(dims, dtype=torch.bfloat16, device=CPU)
    blocks = torch.empty((dims[0], dims[1] // Q4_0_BLOCK * Q4_0_BYTES), dtype=torch.uint8, device=CPU)
    for rows in _row_chunks(dims):  # bounded float32 scratch, whatever the matrix
        drawn = torch.randn((rows.stop - rows.start, dims[1]), generator=gen, device=CPU) * shape.init_std
        blocks[rows], exact = quantize_q4_0_exact(drawn)
        values[rows] = exact.bfloat16()
    return values, blocks


def _row_chunks(dims: tuple[int, ...], max_elements: int = 1 << 24) -> Iterator[slice]:
    step = max(1, max_elements // dims[1])
    for start in range(0, dims[0], step):
        yield slice(start, min(start + step, dims[0]))


def quantize_q4_0_exact(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] as Q4_0 blocks [rows, k / 32 * 18] (llama.cpp's layout: a float16 scale, then the
    low nibbles hold values 0..15 of the block, the high nibbles 16..31) and the float32 values they
    stand for. The scale is llama.cpp's (the largest magnitude, signed, over -8) cut to four
    significant bits, so that every value is exact in bfloat16 as well."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // Q4_0_BLOCK, Q4_0_BLOCK)
    peak = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    mantissa, exponent = torch.frexp(peak / -8)
    scale = torch.ldexp(torch.round(mantissa * 16) / 16, exponent.float())
    scale = torch.where(scale == 0, 1.0, scale)  # an all-zero block: any scale gives zeros
    q = (torch.round(blocks / scale) + 8).clamp(0, 15).to(torch.uint8)
    values = (scale * (q.float() - 8)).reshape(rows, k)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    packed = torch.cat([scale.half().view(torch.uint8), nibbles], dim=-1)
    return packed.reshape(rows, -1), values


def _bos_eos(shape: ModelShape, vocab: ByteBpeVocab | None) -> tuple[int, int]:
    if vocab is not None:
        return vocab.special_id(shape.bos), vocab.special_id(shape.eos)
    settings = read_gguf_header(default_model_path()).metadata
    return settings["tokenizer.ggml.bos_token_id"], settings["tokenizer.ggml.eos_token_id"]


def _add_tokenizer(shape: ModelShape, vocab: ByteBpeVocab | None, w: GGUFWriter, hf_dir: str) -> None:
    """The same vocabulary into the GGUF file and the Hugging Face directory."""
    if vocab is not None:
        add_to_gguf(vocab, w, shape.bos, shape.eos)
        save_hf_tokenizer(vocab, hf_dir, shape.bos, shape.eos)
        return
    default = default_model_path()  # located, never imported
    header = read_gguf_header(default, strings=True)
    for key, value in header.metadata.items():  # its vocabulary, as it is stored
        if key.startswith("tokenizer."):
            kind, item = header.types[key]
            w.add_key_value(key, value, kind, sub_type=item)
    convert_tokenizer(default, hf_dir)
