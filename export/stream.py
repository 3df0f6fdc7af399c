"""Layer-by-layer export: read one decoder layer from the checkpoint, convert, write, forget.

A whole-model export (:func:`jmegatron.export.common.load_checkpoint`) holds every
parameter in float32 host memory (28 GB for a 7B model). The streaming path holds the
parameters outside the decoder layers (embeddings, final norm, output layer) plus **one
decoder layer** at a time:

* :class:`jmegatron.checkpoint.restore.CheckpointParamsReader` opens the checkpoint's ``state`` item and reads single
  arrays of its ``params`` subtree through TensorStore (the store Orbax writes): a
  per-layer checkpoint's ``decoder_layers_{i}`` arrays whole, a stacked one's
  (``scan_layers``, pipeline stage order) slot of layer ``i`` only (``array[slot]``:
  TensorStore reads the chunks that hold it; Orbax writes one chunk per saved shard, so
  the transient read buffer of a stack whose layers axis was not sharded spans all its
  layers for that shard: a pipeline-parallel checkpoint's spans one stage's).
  No optimizer moment, main parameter copy, step or rng is read; ``bytes_read`` counts
  what was.
* :class:`SafetensorsWriter` writes Hugging Face's sharded safetensors
  (``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``, or one
  ``model.safetensors``) incrementally: each tensor's bytes go to the shard's data file
  as soon as it is converted, the header is written when the shard closes (the
  safetensors format puts the header first: it is prepended by copying the data file
  in 1 MiB blocks). Files of at most ``max_shard_size`` bytes, whole tensors each.
* :func:`export_hf_streaming` joins them with :func:`jmegatron.conversion.hf.iter_hf_tensors`
  (the same conversion as ``to_hf_state_dict``, tensor by tensor).

The safetensors layout (https://github.com/huggingface/safetensors, "Format"): an 8-byte
little-endian header size ``N``, ``N`` bytes of JSON ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}`` (offsets relative to the data
start), then the little-endian tensor bytes. Shards and index follow transformers'
``save_pretrained`` (``weight_map``: tensor name -> file).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

import numpy as np

from jmegatron.checkpoint.checkpointing import CheckpointError
from jmegatron.checkpoint.restore import CheckpointParamsReader
from jmegatron.conversion.hf import hf_architecture, hf_config_dict, iter_hf_tensors
from jmegatron.data.tokenizer import load_tokenizer
from jmegatron.export.common import ExportError, export_source, open_checkpoint
from jmegatron.export.hf_model import hf_config_class

__all__ = ["SafetensorsWriter", "export_hf_streaming", "hf_source", "parse_size"]

# numpy dtype name -> safetensors dtype tag
_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
              "int32": "I32", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
              "float8_e5m2": "F8_E5M2"}
_COPY_BLOCK = 1 << 20


def parse_size(size) -> int:
    """Bytes of ``size``: an int, or a string such as ``"5GB"``, ``"500MB"``, ``"2GiB"``
    (transformers' ``max_shard_size`` spelling). Raises ExportError naming ``--max-shard-size``."""
    if isinstance(size, (int, np.integer)):
        value = int(size)
    else:
        text = str(size).strip().upper()
        units = (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10**9), ("MB", 10**6),
                 ("KB", 10**3), ("B", 1))
        for unit, mult in units:
            if text.endswith(unit):
                try:
                    value = int(float(text[:-len(unit)]) * mult)
                except ValueError:
                    value = 0
                break
        else:
            value = int(text) if text.isdigit() else 0
    if value <= 0:
        raise ExportError(f"--max-shard-size {size!r}: give a positive size such as 5GB, 500MB or 2GiB")
    return value


# --------------------------------------------------------------------------- writing
class SafetensorsWriter:
    """Hugging Face safetensors shards written tensor by tensor into folder ``out``.

    ``add(name, array)`` appends the array's bytes to the current shard's data file (the
    caller may drop the array at once); a shard closes when the next tensor would take it
    past ``max_shard_size`` bytes (a bigger tensor gets a shard of its own).
    ``close()`` returns the files written: one shard is ``model.safetensors``; several are
    ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``
    (``metadata.total_size``, ``weight_map``), as transformers' ``save_pretrained``.
    ``bytes_written`` counts tensor bytes. Raises ValueError for a repeated name or a
    dtype safetensors has no tag for.
    """

    def __init__(self, out: str, max_shard_size: int = 5 * 10**9, metadata: Optional[dict] = None):
        self.out = out
        self.max_shard_size = int(max_shard_size)
        self.metadata = {"format": "pt", **(metadata or {})}
        self.bytes_written = 0
        self._shards: list[tuple[str, dict]] = []  # (temporary header-less file, header)
        self._names: dict[str, int] = {}
        self._data = None
        self._header: dict = {}
        self._offset = 0
        os.makedirs(out, exist_ok=True)

    def add(self, name: str, array: np.ndarray) -> None:
        """Write tensor ``name`` (any numpy array; stored C-contiguous, little-endian)."""
        if name in self._names:
            raise ValueError(f"tensor {name!r} added twice")
        array = np.ascontiguousarray(array)
        tag = _ST_DTYPES.get(array.dtype.name)
        if tag is None:
            raise ValueError(f"tensor {name!r} has dtype {array.dtype}, which safetensors cannot store")
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        size = array.nbytes
        if self._data is not None and self._offset and self._offset + size > self.max_shard_size:
            self._close_shard()
        if self._data is None:
            path = os.path.join(self.out, f".shard-{len(self._shards):05d}.data")
            self._data, self._header, self._offset = open(path, "wb"), {}, 0
        self._data.write(memoryview(array.reshape(-1).view(np.uint8)))  # no copy of the bytes
        self._header[name] = {"dtype": tag, "shape": list(array.shape), "data_offsets": [self._offset,
                                                                                       self._offset + size]}
        self._offset += size
        self._names[name] = len(self._shards)
        self.bytes_written += size

    def _close_shard(self) -> None:
        self._data.close()
        self._shards.append((self._data.name, self._header))
        self._data = None

    def close(self) -> list[str]:
        """Finish every shard (header + data) and the index; returns the file names."""
        if self._data is not None:
            self._close_shard()
        n = len(self._shards)
        if n == 0:
            raise ValueError("no tensor was added")
        names = (["model.safetensors"] if n == 1 else
                 [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)])
        for (data_path, header), name in zip(self._shards, names):
            body = json.dumps({"__metadata__": self.metadata, **header}, separators=(",", ":")).encode()
            body += b" " * (-len(body) % 8)  # the data starts 8-byte aligned, as safetensors writes it
            with open(os.path.join(self.out, name), "wb") as f, open(data_path, "rb") as data:
                f.write(len(body).to_bytes(8, "little"))
                f.write(body)
                shutil.copyfileobj(data, f, _COPY_BLOCK)
            os.remove(data_path)
        if n > 1:
            index = {"metadata": {"total_size": self.bytes_written},
                     "weight_map": {t: names[k] for t, k in sorted(self._names.items())}}
            with open(os.path.join(self.out, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        return names


# --------------------------------------------------------------------------- export
_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


def _cast(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        import ml_dtypes

        return array.astype(ml_dtypes.bfloat16)  # round to nearest even, as torch's .to(bfloat16)
    return array.astype(_NUMPY_DTYPES[dtype], copy=False)


def hf_source(load_dir: str) -> str:
    """The ``hf_source/`` folder (``import-hf``'s copy of the source ``config.json`` and
    ``generation_config.json``) that the checkpoint at ``load_dir`` descends from: its own, or
    that of the run it was loaded from (``load`` in its ``config.json``: a fine-tuned import),
    followed back through the runs. Returns the path (which need not exist)."""
    seen = set()
    here = os.path.abspath(load_dir)
    while here not in seen:
        seen.add(here)
        if os.path.isdir(os.path.join(here, "hf_source")):
            return os.path.join(here, "hf_source")
        try:
            with open(os.path.join(here, "config.json")) as f:
                parent = json.load(f).get("load")
        except (OSError, ValueError):
            break
        if not parent:
            break
        here = os.path.abspath(parent)
    return os.path.join(os.path.abspath(load_dir), "hf_source")


def export_hf_streaming(load: str, out: str, dtype: str = "float32", iteration: Optional[int] = None,
                        max_shard_size: Any = "5GB") -> dict[str, Any]:
    """Write the Hugging Face weights and ``config.json`` / ``generation_config.json`` of
    checkpoint ``load`` into folder ``out`` (which must exist), one decoder layer at a time.

    Reads with :class:`jmegatron.checkpoint.restore.CheckpointParamsReader`, converts with
    :func:`jmegatron.conversion.hf.iter_hf_tensors` (the tensors of ``to_hf_state_dict``:
    Megatron's vocabulary padding dropped), casts each to ``dtype`` (float32, bfloat16:
    round to nearest even, float16) and writes it with :class:`SafetensorsWriter` at once.
    Peak host memory: the non-layer parameters (float32) + one decoder layer (float32, and
    its converted tensors) + one tensor's cast; never the whole model. MoE layers' experts
    are written in the Hub's per-expert names (transformers fuses them when loading).

    Returns ``{"architecture", "vocab_size", "padded_vocab_size", "iteration", "source",
    "tokenizer", "files", "bytes_read", "bytes_written", "cfg"}``. Raises ExportError for a
    missing checkpoint or an architecture with no HF target (fields named).
    """
    import transformers

    saved = open_checkpoint(load, iteration)
    try:
        reader = CheckpointParamsReader(saved)
    except CheckpointError as e:
        raise ExportError(f"--load {load}: {e}") from e
    src = export_source(load, saved)
    cfg, vocab_size, tokenizer = src.cfg, src.vocab_size, src.tokenizer_path
    try:
        arch = hf_architecture(cfg)
    except ValueError as e:
        raise ExportError(f"--load {load}: {e}") from e
    bos = eos = None
    if tokenizer:
        tok = load_tokenizer(tokenizer)
        bos, eos = (tok.eod if tok.bos is None else tok.bos), tok.eod
    source = hf_source(src.load_dir)
    if os.path.isfile(os.path.join(source, "config.json")):
        with open(os.path.join(source, "config.json")) as f:
            read = json.load(f)
        bos, eos = read.get("bos_token_id", bos), read.get("eos_token_id", eos)
    conf = hf_config_dict(cfg, vocab_size, bos_token_id=bos, eos_token_id=eos)
    config = hf_config_class(arch).from_dict(conf)
    config.dtype = dtype
    writer = SafetensorsWriter(out, parse_size(max_shard_size))
    try:
        for name, tensor in iter_hf_tensors(reader.read_common(), reader.read_layer, cfg, vocab_size):
            writer.add(name, _cast(tensor, dtype))
            del tensor
    except ExportError:
        raise
    except (CheckpointError, ValueError) as e:
        raise ExportError(f"--load {load}: {e}") from e
    files = writer.close()
    config.save_pretrained(out)
    if os.path.isfile(os.path.join(source, "generation_config.json")):
        shutil.copyfile(os.path.join(source, "generation_config.json"), os.path.join(out, "generation_config.json"))
    else:
        transformers.GenerationConfig.from_model_config(config).save_pretrained(out)
    return {"architecture": arch, "vocab_size": vocab_size, "padded_vocab_size": src.padded_vocab_size,
            "iteration": src.iteration, "source": src.load_dir, "tokenizer": tokenizer,
            "files": files, "bytes_read": reader.bytes_read, "bytes_written": writer.bytes_written, "cfg": cfg}
