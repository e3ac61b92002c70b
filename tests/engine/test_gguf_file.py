"""engine/gguf_file.py against gguf-py's own GGUFReader: the same metadata and the same tensor views,
on the real SmolLM2 file and on small files written with gguf-py's GGUFWriter (every value type,
quantized and plain tensors, a custom alignment, the other byte order); clear errors on files that
are not GGUF or are cut short."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from prism_serve.engine.gguf_file import read_gguf
from prism_serve.engine.sources import default_gguf_path, gguf_header
from prism_serve.errors import CorruptWeightsError


def _reference(path: Path) -> tuple[dict, list]:
    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return meta, reader.tensors


def _same(path: Path) -> None:
    meta, tensors = read_gguf(path)
    ref_meta, ref_tensors = _reference(path)
    assert meta == ref_meta and list(meta) == list(ref_meta)
    assert [t.name for t in tensors] == [t.name for t in ref_tensors]
    for t, r in zip(tensors, ref_tensors, strict=True):
        assert t.tensor_type == r.tensor_type and t.shape == tuple(int(d) for d in r.shape), t.name
        assert t.data.dtype == r.data.dtype and t.data.shape == r.data.shape, t.name
        assert np.array_equal(t.data, r.data), t.name
        deq, ref = quants.dequantize(t.data, t.tensor_type), quants.dequantize(r.data, r.tensor_type)
        assert np.array_equal(deq, ref), t.name


def test_the_real_model_file_reads_as_gguf_py_reads_it() -> None:
    _same(default_gguf_path())
    meta, names = gguf_header(default_gguf_path())
    assert len(meta["tokenizer.ggml.tokens"]) == 49152 and "token_embd.weight" in names


def _write(path: Path, endianess=gguf.GGUFEndian.LITTLE, alignment: int | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁wörld")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.strs", ["a", "", "ü" * 40])
    w.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 8)).astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(7).astype(np.float32))
    q = quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_type_and_tensor_kind_reads_as_gguf_py_reads_it(tmp_path: Path) -> None:
    path = _write(tmp_path / "all.gguf")
    _same(path)
    meta, tensors = read_gguf(path)
    assert meta["t.u64"] == 2**63 + 5 and meta["t.bool"] is True and meta["t.str"] == "héllo ▁wörld"
    assert meta["t.strs"] == ["a", "", "ü" * 40]
    by = {t.name: t for t in tensors}
    assert by["q8"].shape == (64, 2) and by["q8"].data.dtype == np.uint8
    assert quants.dequantize(by["q8"].data, by["q8"].tensor_type).shape == (2, 64)


def test_a_custom_alignment_and_the_other_byte_order(tmp_path: Path) -> None:
    _same(_write(tmp_path / "aligned.gguf", alignment=64))
    big = _write(tmp_path / "big.gguf", endianess=gguf.GGUFEndian.BIG)
    meta, tensors = read_gguf(big)  # handed to gguf-py's reader, which swaps
    little, _ = read_gguf(_write(tmp_path / "little.gguf"))
    assert meta == little and [t.name for t in tensors] == ["f32", "f16", "vec", "q8"]


def test_files_that_are_not_gguf_or_are_cut_short_are_refused(tmp_path: Path) -> None:
    whole = _write(tmp_path / "all.gguf").read_bytes()
    cases = {
        "garbage": b"not a gguf file" * 10,
        "empty": b"",
        "version": whole[:4] + (7).to_bytes(4, "little") + whole[8:],
        "header": whole[:100],  # inside the metadata
        "data": whole[:-40],  # the last tensor's bytes missing
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(CorruptWeightsError, match="not a readable GGUF"):
            gguf_header(path)
    # a string length far past the end of the file
    huge = bytearray(whole)
    key_len_at = 24  # magic, version, tensor count, kv count; then the first key's length
    huge[key_len_at : key_len_at + 8] = (2**40).to_bytes(8, "little")
    (tmp_path / "huge.gguf").write_bytes(bytes(huge))
    with pytest.raises(CorruptWeightsError):
        gguf_header(tmp_path / "huge.gguf")
