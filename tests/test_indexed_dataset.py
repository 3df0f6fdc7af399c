"""MMIDIDX .bin/.idx format against megatron-core's own IndexedDataset / IndexedDatasetBuilder
(byte-identical files, each reads the other's), builder, reader, error messages."""

import os
import pickle
import struct

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import (
    DType as MegatronDType,
    IndexedDataset as MegatronIndexedDataset,
    IndexedDatasetBuilder as MegatronIndexedDatasetBuilder,
)

from jmegatron.data.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    exists,
)

# Three documents; the second has two sequences ("sentences").
DOCS = [
    [[5, 6, 7]],
    [[1, 2], [3, 4, 9, 10]],
    [[65000, 0, 42, 11, 8]],
]


def _reference_files(prefix, dtype, code):
    """Write P.bin / P.idx with megatron-core's own IndexedDatasetBuilder; return the
    sequences and what megatron-core's IndexedDataset reads back (lengths, byte pointers,
    document indices)."""
    builder = MegatronIndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in DOCS:
        for s in doc:
            builder.add_item(torch.tensor(s))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    ref = MegatronIndexedDataset(prefix)
    assert ref.index.dtype is dtype and MegatronDType.code_from_dtype(dtype) == code
    seqs = [s for doc in DOCS for s in doc]
    return seqs, ref.sequence_lengths.tolist(), ref.index.sequence_pointers.tolist(), ref.document_indices.tolist()


def _build(prefix, dtype, how="items"):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in DOCS:
        if how == "items":
            for s in doc:
                b.add_item(np.array(s))
            b.end_document()
        else:
            b.add_document(np.concatenate([np.array(s) for s in doc]), [len(s) for s in doc])
    b.finalize(prefix + ".idx")


def _bytes(path):
    with open(path, "rb") as f:
        return f.read()


def test_dtype_codes_match_megatron():
    expected = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5,
                np.float64: 6, np.float32: 7, np.uint16: 8}
    for dt, code in expected.items():
        assert DType.code_from_dtype(dt) == code == MegatronDType.code_from_dtype(dt)
        assert DType.dtype_from_code(code) is dt
    assert DType.optimal_dtype(50000) is np.uint16
    assert DType.optimal_dtype(65499) is np.uint16
    assert DType.optimal_dtype(65500) is np.int32
    assert DType.optimal_dtype(None) is np.int32


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4), (np.int64, 5)])
@pytest.mark.parametrize("how", ["items", "documents"])
def test_builder_is_byte_identical_to_spec(tmp_path, dtype, code, how):
    ref, out = str(tmp_path / "ref"), str(tmp_path / "out")
    _reference_files(ref, dtype, code)
    _build(out, dtype, how)
    assert _bytes(out + ".idx") == _bytes(ref + ".idx")
    assert _bytes(out + ".bin") == _bytes(ref + ".bin")
    theirs = MegatronIndexedDataset(out)  # and megatron-core reads jmegatron's files
    for i, seq in enumerate(s for doc in DOCS for s in doc):
        np.testing.assert_array_equal(theirs[i], seq)


def test_reader_round_trip(tmp_path):
    prefix = str(tmp_path / "ref")
    seqs, lengths, pointers, doc_idx = _reference_files(prefix, np.uint16, 8)
    ds = IndexedDataset(prefix)
    assert exists(prefix) and IndexedDataset.exists(prefix)
    assert len(ds) == len(seqs) == 4
    assert ds.num_documents == 3
    assert ds.dtype is np.uint16
    assert ds.sequence_lengths.dtype == np.int32
    np.testing.assert_array_equal(ds.sequence_lengths, lengths)
    np.testing.assert_array_equal(ds.sequence_pointers, pointers)
    np.testing.assert_array_equal(ds.document_indices, doc_idx)
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], s)
        assert ds[i].dtype == np.uint16
    np.testing.assert_array_equal(ds[-1], seqs[-1])
    np.testing.assert_array_equal(ds.get(2, offset=1, length=2), [4, 9])
    np.testing.assert_array_equal(ds.get(2, offset=2), [9, 10])
    for got, want in zip(ds[1:4], seqs[1:4]):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(IndexError):
        ds[4]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=5)
    clone = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(clone[3], seqs[3])


def test_add_index_merges(tmp_path):
    a, b, merged = (str(tmp_path / n) for n in ("a", "b", "merged"))
    for prefix, docs in ((a, [[1, 2, 3], [4]]), (b, [[5, 6], [], [7, 8, 9]])):
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for d in docs:
            builder.add_document(d, [len(d)] if d else [])
        builder.finalize(prefix + ".idx")
    builder = IndexedDatasetBuilder(merged + ".bin", dtype=np.uint16)
    builder.add_index(a)
    builder.add_index(b)
    builder.finalize(merged + ".idx")
    direct = str(tmp_path / "direct")
    builder = IndexedDatasetBuilder(direct + ".bin", dtype=np.uint16)
    for d in [[1, 2, 3], [4], [5, 6], [], [7, 8, 9]]:
        builder.add_document(d, [len(d)] if d else [])
    builder.finalize(direct + ".idx")
    assert _bytes(merged + ".bin") == _bytes(direct + ".bin")
    assert _bytes(merged + ".idx") == _bytes(direct + ".idx")
    ds = IndexedDataset(merged)
    np.testing.assert_array_equal(ds.document_indices, [0, 1, 2, 3, 3, 4])
    np.testing.assert_array_equal(ds[3], [7, 8, 9])
    wrong = IndexedDatasetBuilder(str(tmp_path / "w.bin"), dtype=np.int32)
    with pytest.raises(ValueError, match="uint16"):
        wrong.add_index(a)


def test_empty_dataset(tmp_path):
    prefix = str(tmp_path / "empty")
    IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16).finalize(prefix + ".idx")
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.num_documents == 0


def test_builder_rejects_bad_input(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="do not fit"):
        b.add_item(np.array([70000]))
    with pytest.raises(ValueError, match="partition"):
        b.add_document([1, 2, 3], [2])
    with pytest.raises(ValueError, match="cannot be stored"):
        IndexedDatasetBuilder(str(tmp_path / "y.bin"), dtype=np.uint32)


def test_missing_files(tmp_path):
    prefix = str(tmp_path / "ref")
    with pytest.raises(FileNotFoundError, match="missing .*ref.idx"):
        IndexedDataset(prefix)
    _reference_files(prefix, np.uint16, 8)
    with pytest.raises(FileNotFoundError, match="without the suffix"):
        IndexedDataset(prefix + ".bin")
    os.remove(prefix + ".bin")
    assert not exists(prefix)
    with pytest.raises(FileNotFoundError, match=r"ref\.bin"):
        IndexedDataset(prefix)


def _corrupt(prefix, offset, data):
    with open(prefix + ".idx", "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_corrupt_index_errors(tmp_path):
    prefix = str(tmp_path / "ref")
    _reference_files(prefix, np.uint16, 8)
    good = _bytes(prefix + ".idx")

    _corrupt(prefix, 0, b"NOTMMIDX\x00")
    with pytest.raises(ValueError, match="bad magic"):
        IndexedDataset(prefix)

    _corrupt(prefix, 0, good[:9])
    _corrupt(prefix, 9, struct.pack("<Q", 2))
    with pytest.raises(ValueError, match="version 2"):
        IndexedDataset(prefix)

    _corrupt(prefix, 9, struct.pack("<Q", 1))
    _corrupt(prefix, 17, struct.pack("<B", 99))
    with pytest.raises(ValueError, match="dtype code 99"):
        IndexedDataset(prefix)

    with open(prefix + ".idx", "wb") as f:
        f.write(good[:-8])
    with pytest.raises(ValueError, match="truncated index"):
        IndexedDataset(prefix)

    with open(prefix + ".idx", "wb") as f:
        f.write(good[:5])
    with pytest.raises(ValueError, match="truncated index"):
        IndexedDataset(prefix)


def test_truncated_bin(tmp_path):
    prefix = str(tmp_path / "ref")
    _reference_files(prefix, np.uint16, 8)
    data = _bytes(prefix + ".bin")
    with open(prefix + ".bin", "wb") as f:
        f.write(data[:-3])
    with pytest.raises(ValueError, match=r"truncated data file.*ref\.bin|ref\.bin: truncated"):
        IndexedDataset(prefix)
    with open(prefix + ".bin", "wb") as f:
        f.write(data + b"\x00\x00")
    with pytest.raises(ValueError, match="more bytes"):
        IndexedDataset(prefix)
