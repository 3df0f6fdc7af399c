"""Layer-by-layer export: read one decoder layer from the checkpoint, convert, write, forget.

A whole-model export (:func:`jmegatron.export.common.load_checkpoint`) holds every
parameter in float32 host memory (28 GB for a 7B model). The streaming path holds the
parameters outside the decoder layers (embeddings, final norm, output layer) plus **one
decoder layer** at a time:

* :class:`CheckpointParamsReader` opens the checkpoint's ``state`` item and reads single
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
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from jmegatron.conversion.hf import hf_architecture, hf_config_dict, iter_hf_tensors
from jmegatron.data.tokenizer import load_tokenizer
from jmegatron.export.common import ExportError, export_config, source_vocab_size, tokenizer_path
from jmegatron.export.hf_model import hf_config_class
from jmegatron.training import checkpoint_layout, checkpointing
from jmegatron.training.checkpoint_layout import STACKED_KEY, _LAYER_RE

__all__ = ["CheckpointParamsReader", "SafetensorsWriter", "export_hf_streaming", "parse_size"]

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


# --------------------------------------------------------------------------- reading
class CheckpointParamsReader:
    """The parameters of a checkpoint read piece by piece, as float32 NumPy.

    ``read_common()``: everything under ``params`` except the decoder layers and
    auxiliary modules (a distillation run's ``kd_projection``); ``read_layer(i)``: model
    layer ``i``'s per-layer subtree (the names of ``decoder_layers_{i}``, whatever layout
    the checkpoint stores). Both read only those arrays (see the module doc).

    Attributes: ``cfg`` (the export config: one device, per-layer layout), ``meta``,
    ``step``, ``padded_vocab_size``, ``vocab_size``, ``tokenizer_path``, ``load_dir``,
    ``bytes_read`` (array bytes read so far, in the stored dtype).

    Raises ExportError for a missing or unreadable checkpoint, or a stored layer tree that
    does not match the saved config (names the path).
    """

    def __init__(self, load_dir: str, iteration: Optional[int] = None):
        import tensorstore as ts

        if not load_dir:
            raise ExportError("--load is required: a jmegatron checkpoint directory (a training run's `save`)")
        if not checkpointing.has_checkpoint(load_dir):
            raise ExportError(f"--load {load_dir}: no checkpoint found in {os.path.abspath(load_dir)}")
        try:
            ckpt = checkpointing.Checkpointer(load_dir, create=False)
            try:
                self.meta = ckpt.read_meta(iteration)
                self.state_dir, self.step = checkpoint_layout.state_item_dir(ckpt, iteration)
            finally:
                ckpt.close()
            saved = checkpoint_layout.saved_state_metadata(self.state_dir)
        except checkpointing.CheckpointError as e:
            raise ExportError(f"--load {load_dir}: {e}") from e
        self.load_dir = os.path.abspath(load_dir)
        self.cfg = export_config(load_dir, self.step)
        self.padded_vocab_size = int(self.meta["padded_vocab_size"])
        self.vocab_size = source_vocab_size(self.cfg, self.padded_vocab_size)
        self.tokenizer_path = tokenizer_path(self.cfg)
        self.iteration = int(self.meta["iteration"])
        self.bytes_read = 0
        params = saved.get("params")
        if not isinstance(params, Mapping):
            raise ExportError(f"--load {load_dir}: the checkpoint's state holds no params subtree")
        aux = set(self.meta.get("aux_params") or {})
        self._params = {k: v for k, v in params.items() if k not in aux}
        self._num_layers = int(self.meta["config"]["num_layers"])
        layout = checkpoint_layout.LayerLayout.of_config(self.meta["config"])
        self._slot = None
        if layout.stacked:
            order = layout.order(self._num_layers)
            self._slot = {int(layer): slot for slot, layer in enumerate(order) if layer >= 0}
            if checkpoint_layout.STACKED_KEY not in self._params:
                raise ExportError(f"--load {load_dir}: the saved config stores the layers {layout.describe()} but "
                                  f"params hold no 'decoder_layers'")
        else:
            missing = [i for i in range(self._num_layers) if f"decoder_layers_{i}" not in self._params]
            if missing:
                raise ExportError(f"--load {load_dir}: params lack decoder_layers_{missing[0]} "
                                  f"(num_layers={self._num_layers})")
        flags = _storage_flags(self.state_dir)
        self._use_ocdbt, self._use_zarr3 = flags
        # one context: the OCDBT manifest and B-tree nodes are opened once; no data cache
        self._context = ts.Context({"cache_pool": {"total_bytes_limit": 0},
                                    "cache_pool#ocdbt": {"total_bytes_limit": 0}})

    # the stored array of one metadata leaf, all of it or one slot of its leading axis
    def _read(self, leaf, slot: Optional[int] = None) -> np.ndarray:
        import orbax.checkpoint as ocp
        import tensorstore as ts
        from etils import epath

        info = ocp.type_handlers.ParamInfo(name=leaf.name, parent_dir=epath.Path(self.state_dir),
                                           is_ocdbt_checkpoint=self._use_ocdbt, use_zarr3=self._use_zarr3,
                                           ts_context=self._context)
        spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self._use_ocdbt)
        try:
            store = ts.open(spec, context=self._context, open=True, read=True).result()
            data = (store if slot is None else store[slot]).read().result()
        except Exception as e:  # tensorstore raises ValueError / RuntimeError variants
            raise ExportError(f"--load {self.load_dir}: cannot read {leaf.name} of step {self.step}: "
                              f"{type(e).__name__}: {e}") from e
        self.bytes_read += int(data.nbytes)
        return data if data.dtype == np.float32 else data.astype(np.float32)

    def read_common(self) -> dict:
        """Float32 numpy tree of the parameters outside the decoder layers."""
        rest = {k: v for k, v in self._params.items() if k != STACKED_KEY and not _LAYER_RE.match(str(k))}
        return _map(self._read, rest)

    def read_layer(self, i: int) -> dict:
        """Float32 numpy tree of model decoder layer ``i`` (the per-layer names). Raises
        ExportError for ``i`` outside ``[0, num_layers)``."""
        if not 0 <= i < self._num_layers:
            raise ExportError(f"decoder layer {i} is outside [0, {self._num_layers}) (num_layers)")
        if self._slot is None:
            return _map(self._read, self._params[f"decoder_layers_{i}"])
        slot = self._slot[i]
        return _map(lambda leaf: self._read(leaf, slot), self._params["decoder_layers"])


def _storage_flags(state_dir: str) -> tuple[bool, bool]:
    """(use_ocdbt, use_zarr3) of an Orbax PyTree item, from its ``_METADATA`` (Orbax's
    defaults, OCDBT and zarr v2, when the file does not say)."""
    try:
        with open(os.path.join(state_dir, "_METADATA")) as f:
            md = json.load(f)
    except (OSError, ValueError):
        return True, False
    return bool(md.get("use_ocdbt", True)), bool(md.get("use_zarr3", False))


def _map(fn, tree):
    if isinstance(tree, Mapping):
        return {k: _map(fn, v) for k, v in tree.items()}
    return fn(tree)


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

    Reads with :class:`CheckpointParamsReader`, converts with
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

    reader = CheckpointParamsReader(load, iteration)
    cfg = reader.cfg
    try:
        arch = hf_architecture(cfg)
    except ValueError as e:
        raise ExportError(f"--load {load}: {e}") from e
    bos = eos = None
    if reader.tokenizer_path:
        tok = load_tokenizer(reader.tokenizer_path)
        bos, eos = (tok.eod if tok.bos is None else tok.bos), tok.eod
    source = hf_source(reader.load_dir)
    if os.path.isfile(os.path.join(source, "config.json")):
        with open(os.path.join(source, "config.json")) as f:
            read = json.load(f)
        bos, eos = read.get("bos_token_id", bos), read.get("eos_token_id", eos)
    conf = hf_config_dict(cfg, reader.vocab_size, bos_token_id=bos, eos_token_id=eos)
    config = hf_config_class(arch).from_dict(conf)
    config.dtype = dtype
    writer = SafetensorsWriter(out, parse_size(max_shard_size))
    try:
        for name, tensor in iter_hf_tensors(reader.read_common(), reader.read_layer, cfg, reader.vocab_size):
            writer.add(name, _cast(tensor, dtype))
            del tensor
    except ExportError:
        raise
    except ValueError as e:
        raise ExportError(f"--load {load}: {e}") from e
    files = writer.close()
    config.save_pretrained(out)
    if os.path.isfile(os.path.join(source, "generation_config.json")):
        shutil.copyfile(os.path.join(source, "generation_config.json"), os.path.join(out, "generation_config.json"))
    else:
        transformers.GenerationConfig.from_model_config(config).save_pretrained(out)
    return {"architecture": arch, "vocab_size": reader.vocab_size, "padded_vocab_size": reader.padded_vocab_size,
            "iteration": reader.iteration, "source": reader.load_dir, "tokenizer": reader.tokenizer_path,
            "files": files, "bytes_read": reader.bytes_read, "bytes_written": writer.bytes_written, "cfg": cfg}
