"""model_loader/gguf_header.py against gguf's own GGUFReader: the same settings and their types (the
arrays of strings stepped over, or read when asked for), the same tensor table and bytes, on the
default model's file, a mixed K-quant file and a file of every value type and element tensor type;
and a clear error for what it cannot read."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from baby_sgl.model_loader.gguf_header import read_gguf_header
from baby_sgl.model_loader.loader import default_model_path
from gguf_writer import write_tiny_gguf


def _same_as_gguf_reader(path: str) -> None:
    ours, theirs = read_gguf_header(path), GGUFReader(path)
    fields = {name: field for name, field in theirs.fields.items() if not name.startswith("GGUF.")}
    expected = {name: field.contents() for name, field in fields.items()
                if field.types[:2] != [GGUFValueType.ARRAY, GGUFValueType.STRING]}
    assert ours.metadata == expected
    assert read_gguf_header(path, strings=True).metadata == {name: field.contents() for name, field in fields.items()}
    assert ours.types == {name: (field.types[0], field.types[1] if field.types[0] == GGUFValueType.ARRAY else None)
                          for name, field in fields.items()}
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


def _write(path, endian: GGUFEndian = GGUFEndian.LITTLE) -> None:
    w = GGUFWriter(str(path), "llama", endianess=endian)
    w.add_bool("t.bool", True)
    w.add_uint8("t.u8", 200)
    w.add_int16("t.i16", -300)
    w.add_uint64("t.u64", 2**40 + 3)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 0.1)
    w.add_float32("t.f32", 1e-5)
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.strings", ["a", "bc", ""])
    w.add_string("t.string", "héllo")
    for name, values in {"f16": np.arange(12, dtype=np.float16).reshape(3, 4), "f32": np.ones((2, 5), np.float32),
                         "i8": np.arange(-4, 4, dtype=np.int8), "i32": np.arange(6, dtype=np.int32).reshape(2, 3)}.items():
        w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_value_type_and_element_tensor_reads_as_gguf_reads_it(tmp_path):
    _write(tmp_path / "types.gguf")
    _same_as_gguf_reader(str(tmp_path / "types.gguf"))
    header = read_gguf_header(str(tmp_path / "types.gguf"))
    assert header.metadata["t.u64"] == 2**40 + 3 and header.metadata["t.string"] == "héllo"
    assert "t.strings" not in header.metadata  # stepped over
    assert read_gguf_header(str(tmp_path / "types.gguf"), strings=True).metadata["t.strings"] == ["a", "bc", ""]


def test_what_it_cannot_read_is_named(tmp_path):
    _write(tmp_path / "big.gguf", GGUFEndian.BIG)
    with pytest.raises(ValueError, match="big-endian GGUF file"):
        read_gguf_header(str(tmp_path / "big.gguf"))
    _write(tmp_path / "cut.gguf")
    data = (tmp_path / "cut.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-16])  # past the padding after the last tensor
    with pytest.raises(ValueError, match="tensor i32 runs past the end of the file"):
        read_gguf_header(str(tmp_path / "cut.gguf"))
    (tmp_path / "cut.gguf").write_bytes(data[:40])
    with pytest.raises(ValueError, match="the GGUF header ends early"):
        read_gguf_header(str(tmp_path / "cut.gguf"))
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_gguf_header(str(not_gguf))
    old = tmp_path / "v1.gguf"
    old.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(56))
    with pytest.raises(ValueError, match="GGUF version 1 is not supported"):
        read_gguf_header(str(old))
    key = b"t.empty"
    odd = tmp_path / "odd.gguf"  # an array of no items whose item type the format does not define
    odd.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
                    + len(key).to_bytes(8, "little") + key + (9).to_bytes(4, "little") + (99).to_bytes(4, "little")
                    + (0).to_bytes(8, "little"))
    with pytest.raises(ValueError, match=r"odd\.gguf: GGUF array item type 99 is not one the format defines"):
        read_gguf_header(str(odd))
