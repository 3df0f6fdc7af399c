"""Megatron-compatible memory-mapped indexed dataset (the ``MMIDIDX`` .bin/.idx pair).

Follows ``megatron/core/datasets/indexed_dataset.py`` of NVIDIA Megatron-LM: the files written
here are byte-for-byte what Megatron's ``IndexedDatasetBuilder`` writes, and files written by
Megatron's ``tools/preprocess_data.py`` can be read here.

File format (all integers little-endian)::

    P.bin  the token ids of every sequence, concatenated, in the index dtype, nothing else.

    P.idx  offset  size                     content
           0       9                        magic  b"MMIDIDX\\x00\\x00"
           9       8   <Q                   version, always 1
           17      1   <B                   dtype code (see ``DType``)
           18      8   <Q                   S = number of sequences
           26      8   <Q                   D = number of entries in document_indices
                                                (number of documents + 1)
           34      4*S int32                sequence_lengths  (tokens per sequence)
           ...     8*S int64                sequence_pointers (byte offset of each sequence
                                                                in P.bin)
           ...     8*D int64                document_indices  (sequence index where each document
                                                starts, first 0, last S)
           ...     1*S int8   (optional)    sequence_modes    (multimodal files only)

A "sequence" is one ``add_item`` call (Megatron's sentence); a document is a run of sequences
closed by ``end_document``. ``tools/preprocess_data.py`` without sentence splitting writes one
sequence per document.
"""

from __future__ import annotations

import os
import shutil
import struct
from array import array
from enum import Enum
from typing import Optional, Sequence, Union

import numpy as np

__all__ = [
    "INDEX_HEADER",
    "DType",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "get_bin_path",
    "get_idx_path",
    "normalize_index",
]

INDEX_HEADER = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1
# magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8)
_HEADER_NBYTES = 34


def normalize_index(idx, n: int, message: str) -> int:
    """``idx`` as an int in ``[0, n)``, a negative one counting from the end (Python's
    indexing). Raises IndexError with ``message`` formatted with ``idx`` and ``n`` when it is
    out of range."""
    i = int(idx)
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(message.format(idx=idx, n=n))
    return i


class DType(Enum):
    """Numeric codes of the token dtype stored in byte 17 of a .idx file.

    Same codes as ``DType`` in Megatron-LM ``megatron/core/datasets/indexed_dataset.py``.
    """

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, dtype) -> int:
        """Return the code of a numpy dtype (``np.uint16``, ``np.dtype("int32")``, ...).

        Raises:
            ValueError: the dtype has no MMIDIDX code.
        """
        name = np.dtype(dtype).name
        try:
            return cls[name].value
        except KeyError:
            raise ValueError(
                f"dtype {name!r} cannot be stored in an MMIDIDX index; use one of "
                f"{[m.name for m in cls]}"
            ) from None

    @classmethod
    def dtype_from_code(cls, code: int) -> type:
        """Return the numpy scalar type (e.g. ``np.uint16``) of a code.

        Raises:
            ValueError: unknown code.
        """
        try:
            return getattr(np, cls(int(code)).name)
        except ValueError:
            raise ValueError(
                f"unknown MMIDIDX dtype code {code}; valid codes are "
                f"{ {m.value: m.name for m in cls} }"
            ) from None

    @staticmethod
    def size(key) -> int:
        """Bytes per element of a dtype or of a dtype code."""
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            return np.dtype(DType.dtype_from_code(int(key))).itemsize
        return np.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> type:
        """Token dtype for a vocabulary of ``cardinality`` ids, as Megatron picks it.

        Returns ``np.uint16`` if ``cardinality < 65500`` else ``np.int32`` (also for None).
        """
        if cardinality is not None and cardinality < 65500:
            return np.uint16
        return np.int32


def get_idx_path(path_prefix: str) -> str:
    """``path_prefix + ".idx"``."""
    return str(path_prefix) + ".idx"


def get_bin_path(path_prefix: str) -> str:
    """``path_prefix + ".bin"``."""
    return str(path_prefix) + ".bin"


def _rebuild_hint(path: str) -> str:
    """The fix named by every corrupt-file error: write the pair again, both files at once."""
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    return (f"; rebuild {prefix}.bin/.idx together with `python -m jmegatron.tools.preprocess_data` "
            "(or copy both files again from where they were made)")


def _write_index(
    idx_path: str,
    dtype,
    sequence_lengths: np.ndarray,
    document_indices: np.ndarray,
    sequence_modes: Optional[np.ndarray] = None,
) -> None:
    """Write a .idx file (format in the module docstring)."""
    sequence_lengths = np.asarray(sequence_lengths, dtype=np.int32)
    document_indices = np.asarray(document_indices, dtype=np.int64)
    itemsize = DType.size(dtype)
    pointers = np.zeros(len(sequence_lengths), dtype=np.int64)
    if len(sequence_lengths) > 1:
        np.cumsum(sequence_lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    with open(idx_path, "wb") as f:
        f.write(INDEX_HEADER)
        f.write(struct.pack("<Q", _INDEX_VERSION))
        f.write(struct.pack("<B", DType.code_from_dtype(dtype)))
        f.write(struct.pack("<Q", len(sequence_lengths)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(sequence_lengths.astype("<i4").tobytes(order="C"))
        f.write(pointers.astype("<i8").tobytes(order="C"))
        f.write(document_indices.astype("<i8").tobytes(order="C"))
        if sequence_modes is not None:
            f.write(np.asarray(sequence_modes, dtype=np.int8).tobytes(order="C"))


class _Index:
    """Parsed, memory-mapped .idx file. Raises ValueError / FileNotFoundError on bad input."""

    def __init__(self, idx_path: str, multimodal: bool = False) -> None:
        self.path = idx_path
        if not os.path.isfile(idx_path):
            raise FileNotFoundError(f"index file not found: {idx_path}")
        file_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            head = f.read(_HEADER_NBYTES)
        if len(head) < 9 and INDEX_HEADER.startswith(head):
            raise ValueError(f"{idx_path}: truncated index ({file_size} bytes, header needs "
                             f"{_HEADER_NBYTES})" + _rebuild_hint(idx_path))
        if head[:9] != INDEX_HEADER:
            raise ValueError(
                f"{idx_path}: bad magic header {head[:9]!r}, expected {INDEX_HEADER!r}; this is "
                "not a Megatron MMIDIDX index (old 'lazy'/'cached' formats are not supported)"
                + _rebuild_hint(idx_path)
            )
        if len(head) < _HEADER_NBYTES:
            raise ValueError(
                f"{idx_path}: truncated index header ({len(head)} bytes, need {_HEADER_NBYTES})"
                + _rebuild_hint(idx_path)
            )
        (version,) = struct.unpack("<Q", head[9:17])
        if version != _INDEX_VERSION:
            raise ValueError(
                f"{idx_path}: unsupported MMIDIDX version {version}, only version "
                f"{_INDEX_VERSION} exists" + _rebuild_hint(idx_path)
            )
        (code,) = struct.unpack("<B", head[17:18])
        try:
            self.dtype = DType.dtype_from_code(code)
        except ValueError as err:
            raise ValueError(f"{idx_path}: {err}" + _rebuild_hint(idx_path)) from None
        self.dtype_size = DType.size(self.dtype)
        (self.sequence_count,) = struct.unpack("<Q", head[18:26])
        (self.document_count,) = struct.unpack("<Q", head[26:34])
        s, d = self.sequence_count, self.document_count
        expected = _HEADER_NBYTES + 4 * s + 8 * s + 8 * d + (s if multimodal else 0)
        if file_size < expected:
            raise ValueError(
                f"{idx_path}: truncated index: header announces {s} sequences and {d} document "
                f"indices, which need {expected} bytes, but the file has {file_size}"
                + _rebuild_hint(idx_path)
            )
        if file_size > expected and not (file_size == expected + s and not multimodal):
            # (a multimodal file read as text-only has exactly S trailing mode bytes)
            raise ValueError(
                f"{idx_path}: index has {file_size - expected} unexpected trailing bytes "
                f"(header announces {s} sequences and {d} document indices)" + _rebuild_hint(idx_path)
            )
        if file_size > _HEADER_NBYTES:
            mm = np.memmap(idx_path, dtype=np.uint8, mode="r")
        else:
            mm = np.zeros(_HEADER_NBYTES, dtype=np.uint8)
        off = _HEADER_NBYTES
        self.sequence_lengths = np.frombuffer(mm, dtype="<i4", count=s, offset=off)
        off += 4 * s
        self.sequence_pointers = np.frombuffer(mm, dtype="<i8", count=s, offset=off)
        off += 8 * s
        self.document_indices = np.frombuffer(mm, dtype="<i8", count=d, offset=off)
        off += 8 * d
        self.sequence_modes = (
            np.frombuffer(mm, dtype=np.int8, count=s, offset=off) if multimodal else None
        )
        if d == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != s:
            raise ValueError(
                f"{idx_path}: corrupt document_indices (must start at 0 and end at the sequence "
                f"count {s}; got {d} entries"
                + (f", first {self.document_indices[0]}, last {self.document_indices[-1]})"
                   if d else ")") + _rebuild_hint(idx_path)
            )


class IndexedDataset:
    """Read-only, memory-mapped view of a Megatron ``P.bin``/``P.idx`` pair.

    Follows ``IndexedDataset`` in Megatron-LM ``megatron/core/datasets/indexed_dataset.py``
    (mmap mode, local files).

    Args:
        path_prefix: the path without the ``.bin``/``.idx`` suffix.
        multimodal: whether the index carries per-sequence int8 modes.

    Attributes / properties:
        sequence_lengths:  int32 [num_sequences]   tokens per sequence.
        sequence_pointers: int64 [num_sequences]   byte offset of each sequence in ``P.bin``.
        document_indices:  int64 [num_documents+1] first sequence of each document, then S.
        sequence_modes:    int8 [num_sequences] (multimodal only).
        dtype:             numpy scalar type of the tokens.

    Raises:
        FileNotFoundError: ``P.idx`` or ``P.bin`` is missing (message names the paths).
        ValueError: bad magic, version, dtype code, truncated/oversized ``.idx`` or ``.bin``.
    """

    def __init__(self, path_prefix: Union[str, os.PathLike], multimodal: bool = False) -> None:
        self._initialize(os.fspath(path_prefix), multimodal)

    def _initialize(self, path_prefix: str, multimodal: bool) -> None:
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        missing = [p for p in (idx_path, bin_path) if not os.path.isfile(p)]
        if missing:
            hint = ""
            if path_prefix.endswith((".bin", ".idx")):
                hint = f"; pass the prefix without the suffix, e.g. {path_prefix[:-4]!r}"
            elif IndexedDataset.exists(path_prefix + "_text_document"):
                hint = f"; did you mean {path_prefix + '_text_document'!r}?"
            raise FileNotFoundError(
                f"indexed dataset {path_prefix!r}: missing {', '.join(missing)}{hint} "
                "(build it with `python -m jmegatron.tools.preprocess_data`)"
            )
        self.index = _Index(idx_path, multimodal)
        expected = 0
        if self.index.sequence_count:
            expected = int(self.index.sequence_pointers[-1]) + int(
                self.index.sequence_lengths[-1]
            ) * self.index.dtype_size
        actual = os.path.getsize(bin_path)
        if actual < expected:
            raise ValueError(
                f"{bin_path}: truncated data file: {idx_path} describes {expected} bytes of "
                f"{np.dtype(self.index.dtype).name} tokens but the .bin has {actual} (a copy cut "
                f"short, or an index whose dtype code does not match the tokens)" + _rebuild_hint(bin_path)
            )
        if actual > expected:
            raise ValueError(
                f"{bin_path}: data file has {actual - expected} more bytes than {idx_path} "
                f"describes ({expected} bytes of {np.dtype(self.index.dtype).name} tokens); the .bin "
                f"and .idx do not belong together" + _rebuild_hint(bin_path)
            )
        if actual > 0:
            self._bin = np.memmap(bin_path, dtype=np.uint8, mode="r")
        else:
            self._bin = np.zeros(0, dtype=np.uint8)

    # pickling (e.g. for multiprocess data loaders): reopen the maps in the child.
    def __getstate__(self):
        return (self.path_prefix, self.multimodal)

    def __setstate__(self, state) -> None:
        self._initialize(*state)

    @property
    def dtype(self) -> type:
        """numpy scalar type of the stored tokens."""
        return self.index.dtype

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the .bin file: a read-only memory-mapped 1-D array of ``self.dtype``."""
        return np.frombuffer(self._bin, dtype=self.index.dtype)

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 [num_sequences]: tokens in each sequence."""
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64 [num_sequences]: byte offset of each sequence in the .bin file."""
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64 [num_documents + 1]: sequence index at which each document starts, then S."""
        return self.index.document_indices

    @property
    def sequence_modes(self) -> np.ndarray:
        """int8 [num_sequences] (multimodal files only; ValueError otherwise)."""
        if self.index.sequence_modes is None:
            raise ValueError(f"{self.path_prefix}: not opened as multimodal; no sequence modes")
        return self.index.sequence_modes

    @property
    def num_documents(self) -> int:
        """Number of documents (``len(document_indices) - 1``)."""
        return len(self.index.document_indices) - 1

    def __len__(self) -> int:
        """Number of sequences."""
        return self.index.sequence_count

    def _check_idx(self, idx) -> int:
        return normalize_index(idx, len(self), "sequence index {idx} out of range for {n} sequences")

    def _read(self, pointer: int, count: int) -> np.ndarray:
        return np.frombuffer(self._bin, dtype=self.index.dtype, count=count, offset=pointer)

    def __getitem__(self, idx):
        """Sequence ``idx`` as a read-only 1-D array of ``self.dtype`` (shape [length]).

        A contiguous slice returns a list of such arrays.

        Raises:
            IndexError: index out of range.  ValueError: slice with step != 1.
            TypeError: other index types.
        """
        if isinstance(idx, (int, np.integer)):
            i = self._check_idx(idx)
            return self._read(
                int(self.index.sequence_pointers[i]), int(self.index.sequence_lengths[i])
            )
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices into an IndexedDataset must be contiguous (step 1)")
            if stop <= start:
                return []
            lengths = self.index.sequence_lengths[start:stop]
            flat = self._read(int(self.index.sequence_pointers[start]), int(lengths.sum()))
            return np.split(flat, np.cumsum(lengths)[:-1])
        raise TypeError(f"unexpected index type {type(idx).__name__} for IndexedDataset")

    def get(self, idx, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end if length is None).

        Returns a read-only 1-D array of ``self.dtype``, shape [length].

        Raises:
            IndexError: ``idx`` out of range, or the span leaves the sequence.
        """
        i = self._check_idx(idx)
        seq_len = int(self.index.sequence_lengths[i])
        offset = int(offset)
        if length is None:
            length = seq_len - offset
        length = int(length)
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(
                f"span [{offset}, {offset + length}) outside sequence {i} of length {seq_len}"
            )
        pointer = int(self.index.sequence_pointers[i]) + offset * self.index.dtype_size
        return self._read(pointer, length)

    @staticmethod
    def exists(path_prefix: Union[str, os.PathLike]) -> bool:
        """Whether both ``path_prefix.idx`` and ``path_prefix.bin`` exist."""
        p = os.fspath(path_prefix)
        return os.path.isfile(get_idx_path(p)) and os.path.isfile(get_bin_path(p))


def exists(path_prefix: Union[str, os.PathLike]) -> bool:
    """Module-level alias of ``IndexedDataset.exists``."""
    return IndexedDataset.exists(path_prefix)


class IndexedDatasetBuilder:
    """Incremental writer of a ``P.bin``/``P.idx`` pair, byte-compatible with Megatron.

    Follows ``IndexedDatasetBuilder`` in Megatron-LM ``megatron/core/datasets/indexed_dataset.py``.
    Tokens are streamed to ``bin_path`` as they are added; ``finalize`` writes the index.

    Args:
        bin_path: path of the .bin file to create (truncated if present).
        dtype: token dtype, one of the ``DType`` names (``DType.optimal_dtype(vocab_size)``
            gives Megatron's choice: uint16 if vocab_size < 65500 else int32).
        multimodal: also record an int8 mode per sequence.

    Raises:
        ValueError: unsupported dtype; tokens that do not fit the dtype; lengths that do not
            add up; merging an index of another dtype.
    """

    def __init__(self, bin_path: Union[str, os.PathLike], dtype=np.int32,
                 multimodal: bool = False) -> None:
        DType.code_from_dtype(dtype)  # validate
        self.dtype = np.dtype(dtype).type
        self.bin_path = os.fspath(bin_path)
        self.multimodal = multimodal
        self._data_file = open(self.bin_path, "wb")
        self._lengths = array("q")
        self._doc_indices = array("q", [0])
        self._modes = array("b") if multimodal else None
        info = np.iinfo(self.dtype) if np.issubdtype(self.dtype, np.integer) else None
        self._bounds = (int(info.min), int(info.max)) if info is not None else None

    def _to_array(self, tokens) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if self._bounds is not None and arr.size and arr.dtype != self.dtype:
            if np.issubdtype(arr.dtype, np.floating):
                raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._bounds[0] or hi > self._bounds[1]:
                raise ValueError(
                    f"token ids in [{lo}, {hi}] do not fit dtype {np.dtype(self.dtype).name} "
                    f"[{self._bounds[0]}, {self._bounds[1]}]; build with a wider dtype "
                    "(int32 for vocabularies of 65500 or more)"
                )
        return np.ascontiguousarray(arr, dtype=self.dtype)

    def add_item(self, tokens: Union[Sequence[int], np.ndarray], mode: int = 0) -> None:
        """Append one sequence (1-D integer token ids, any int dtype). Close documents with
        ``end_document``. Raises ValueError if an id does not fit the builder's dtype."""
        arr = self._to_array(tokens)
        self._data_file.write(arr.tobytes(order="C"))
        self._lengths.append(arr.size)
        if self._modes is not None:
            self._modes.append(int(mode))

    def end_document(self) -> None:
        """Close the current document (the sequences added since the last one)."""
        self._doc_indices.append(len(self._lengths))

    def add_document(self, tokens: Union[Sequence[int], np.ndarray], lengths: Sequence[int],
                     modes: Optional[Sequence[int]] = None) -> None:
        """Append a whole document: ``tokens`` (1-D) split into sequences of ``lengths``.

        ``sum(lengths)`` must equal ``len(tokens)``; ``lengths == []`` adds an empty document.
        """
        arr = self._to_array(tokens)
        lengths = [int(x) for x in lengths]
        if sum(lengths) != arr.size or any(x < 0 for x in lengths):
            raise ValueError(
                f"add_document: lengths {lengths[:8]}{'...' if len(lengths) > 8 else ''} "
                f"(sum {sum(lengths)}) do not partition the {arr.size} tokens"
            )
        self._data_file.write(arr.tobytes(order="C"))
        self._lengths.extend(lengths)
        self._doc_indices.append(len(self._lengths))
        if self._modes is not None:
            self._modes.extend(modes if modes is not None else [0] * len(lengths))

    def add_index(self, path_prefix: Union[str, os.PathLike]) -> None:
        """Append every document of the existing dataset at ``path_prefix`` (merge).

        Raises:
            FileNotFoundError / ValueError: as ``IndexedDataset``; ValueError on dtype mismatch.
        """
        other = IndexedDataset(path_prefix, multimodal=self.multimodal)
        if other.dtype != self.dtype:
            raise ValueError(
                f"add_index: {os.fspath(path_prefix)} stores {np.dtype(other.dtype).name} tokens "
                f"but this builder writes {np.dtype(self.dtype).name}"
            )
        offset = len(self._lengths)
        self._lengths.frombytes(other.sequence_lengths.astype(np.int64).tobytes())
        self._doc_indices.frombytes((other.document_indices[1:] + offset).astype(np.int64)
                                    .tobytes())
        if self._modes is not None:
            self._modes.frombytes(other.sequence_modes.astype(np.int8).tobytes())
        del other
        with open(get_bin_path(os.fspath(path_prefix)), "rb") as f:
            shutil.copyfileobj(f, self._data_file, 16 * 1024 * 1024)

    @property
    def num_sequences(self) -> int:
        """Sequences added so far."""
        return len(self._lengths)

    def finalize(self, idx_path: Union[str, os.PathLike]) -> None:
        """Close the .bin file and write the index to ``idx_path``."""
        self._data_file.close()
        lengths = np.array(self._lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError("a sequence longer than 2**31-1 tokens cannot be indexed")
        modes = None
        if self._modes is not None:
            modes = np.array(self._modes, dtype=np.int8)
        _write_index(os.fspath(idx_path), self.dtype, lengths,
                     np.array(self._doc_indices, dtype=np.int64), modes)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, *exc) -> None:
        if not self._data_file.closed:
            self._data_file.close()
