"""model_loader/gguf_header.py against gguf's own GGUFReader: the same settings (every key but the
arrays of strings, which it steps over), the same tensor table and bytes, on the default model's
file and on a mixed K-quant file; and a clear error for what it cannot read."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf import GGUFReader, GGUFValueType

from baby_sgl.model_loader.gguf_header import read_gguf_header
from baby_sgl.model_loader.loader import default_model_path
from gguf_writer import write_tiny_gguf


def _same_as_gguf_reader(path: str) -> None:
    ours, theirs = read_gguf_header(path), GGUFReader(path)
    expected = {name: field.contents() for name, field in theirs.fields.items()
                if not name.startswith("GGUF.") and not (field.types[:2] == [GGUFValueType.ARRAY, GGUFValueType.STRING])}
    assert ours.metadata == expected
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)


def test_the_default_models_file_reads_as_gguf_reads_it():
    _same_as_gguf_reader(default_model_path())


def test_a_mixed_k_quant_file_reads_as_gguf_reads_it(wide_llama, tmp_path):
    path = str(tmp_path / "mixed.gguf")
    write_tiny_gguf(wide_llama, path, G.Q4_K, type_of=lambda name: G.Q6_K if "down_proj" in name else G.Q4_K)
    _same_as_gguf_reader(path)


def test_what_it_cannot_read_is_named(tmp_path):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_gguf_header(str(not_gguf))
    old = tmp_path / "v1.gguf"
    old.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(56))
    with pytest.raises(ValueError, match="GGUF version 1 is not supported"):
        read_gguf_header(str(old))
