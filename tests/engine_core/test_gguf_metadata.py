"""The one GGUF header reader (engine_core/gguf_metadata.py), checked against the `gguf` package's own
writer and reader on a small file with every value type, two alignments and quantized tensors."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest

from engine_core.text.gguf_metadata import read_gguf_header, read_gguf_metadata


def _write(path, alignment: int | None = None) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -3000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -123456)
    writer.add_uint64("t.u64", 2**40 + 3)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float32("t.f32", 0.5)
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo <|im_end|>")
    writer.add_array("t.ints", [3, 1, 4, 1, 5])
    writer.add_array("t.floats", [0.25, -1.5])
    writer.add_array("t.strs", ["a", "", "ünï"])
    writer.add_tensor("token_embd.weight", np.arange(6 * 32, dtype=np.float32).reshape(6, 32))
    q8 = gguf.quants.quantize(np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64),
                              gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_header_matches_the_gguf_package(tmp_path, alignment):
    path = tmp_path / "tiny.gguf"
    _write(path, alignment)
    header = read_gguf_header(path)
    reference = gguf.GGUFReader(str(path))

    for name, field in reference.fields.items():
        if name.startswith("GGUF."):  # the reader's pseudo-fields for the file header
            continue
        assert header.metadata[name] == pytest.approx(field.contents()), name
    assert header.metadata["t.str"] == "héllo <|im_end|>" and header.metadata["t.strs"] == ["a", "", "ünï"]
    assert read_gguf_metadata(path) == header.metadata

    assert [t.name for t in header.tensors] == [t.name for t in reference.tensors]
    assert header.data_start == reference.data_offset
    for info, tensor in zip(header.tensors, reference.tensors):
        assert info.qtype == tensor.tensor_type and list(info.dims) == tensor.shape.tolist()
        assert header.data_start + info.offset == tensor.data_offset


def test_not_a_gguf_file_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_metadata(path)
    path.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="version 9 is not supported"):
        read_gguf_header(path)


def test_the_reader_imports_no_torch():
    code = "import engine_core.text.gguf_metadata, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
