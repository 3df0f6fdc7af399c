"""Restores that fit (issue 16 item 4): evaluation, generation, export and the teacher read
parameters only, straight into the target mesh's shardings, and the Hugging Face export
streams one decoder layer at a time.

Measured, not assumed: every array Orbax deserializes is recorded (name and bytes), the
restored arrays' shardings are compared with the targets', the export reader's live
arrays are tracked with weak references, and tracemalloc gives the host peak."""

import contextlib
import json
import os
import re
import tracemalloc
import weakref

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jmegatron.parallel.mesh import create_mesh
from jmegatron.checkpoint import checkpointing, restore as checkpoint_restore
from jmegatron.training.run import build, checkpoint_meta, restore_run, restore_run_params

from test_checkpoint_resume import cfg_for  # noqa: E402


@contextlib.contextmanager
def orbax_reads():
    """Record (name, bytes) of every array Orbax deserializes (jax and numpy handlers)."""
    seen = []
    handlers = [ocp.type_handlers.ArrayHandler, ocp.type_handlers.NumpyHandler]
    originals = [h.deserialize for h in handlers]

    def wrap(original):
        async def deserialize(self, infos, args=None):
            out = await original(self, infos, args)
            seen.extend((info.name, int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize)
                        for info, a in zip(infos, out))
            return out
        return deserialize

    for h, o in zip(handlers, originals):
        h.deserialize = wrap(o)
    try:
        yield seen
    finally:
        for h, o in zip(handlers, originals):
            h.deserialize = o


def save_checkpoint(directory, iteration=2, **overrides):
    """A checkpoint of a freshly initialised run of ``cfg_for(directory, **overrides)`` on
    all 8 devices (no training step compiled: these tests are about reading it back)."""
    cfg = cfg_for(directory, **overrides)
    run = build(cfg, create_mesh(cfg))
    ckpt = checkpointing.Checkpointer(str(directory))
    ckpt.save(iteration, run.init_state(), checkpoint_meta(cfg, run, iteration, iteration * cfg.global_batch_size))
    ckpt.close()
    return str(directory)


def nbytes(tree):
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def bf16_tp2_ckpt(tmp_path_factory):
    # bf16 model params + float32 main params + Adam moments, tp2 x dp4 with ZeRO-1
    return save_checkpoint(tmp_path_factory.mktemp("bf16_tp2"), vocab_size=512, bf16=True,
                           tensor_model_parallel_size=2, use_distributed_optimizer=True)


def test_params_only_into_mesh_shardings(bf16_tp2_ckpt):
    cfg = restore_run(bf16_tp2_ckpt)[0].cfg  # the one-device full restore: the reference
    with orbax_reads() as full_reads:
        _, state, _ = restore_run(bf16_tp2_ckpt)
    mesh = create_mesh(cfg.replace(tensor_model_parallel_size=2))
    with orbax_reads() as reads:
        run, params, meta = restore_run_params(bf16_tp2_ckpt, mesh)
    assert meta["iteration"] == 2 and run.cfg.tensor_model_parallel_size == 2
    # only the model's params were read: no moment, main copy, step or rng
    names = {n for n, _ in reads}
    assert names and all(n.startswith("params.") for n in names), sorted(names)[:5]
    assert len(names) == len(jax.tree.leaves(params))
    read_bytes, full_bytes = sum(b for _, b in reads), sum(b for _, b in full_reads)
    assert read_bytes == nbytes(params)  # bf16: 2 bytes a parameter
    assert any(n.startswith("opt_state.") for n, _ in full_reads)
    assert full_bytes >= 6 * read_bytes  # + float32 main params and two float32 moments (14 vs 2 bytes)
    # each array in the target's NamedSharding (tensor-parallel kernels split, no gather)
    targets = run.state_shardings.params
    for (path, a), s in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(targets)):
        assert a.sharding == s, jax.tree_util.keystr(path)
    qkv = params["decoder_layers_0"]["self_attention"]["linear_qkv"]["kernel"]
    assert "tensor" in str(qkv.sharding.spec) and qkv.addressable_shards[0].data.shape != qkv.shape
    # the same values as the whole-state restore's model params
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_main_params_source(bf16_tp2_ckpt):
    _, state, _ = restore_run(bf16_tp2_ckpt)
    with orbax_reads() as reads:
        run, main, _ = restore_run_params(bf16_tp2_ckpt, source="main")
    assert not run.cfg.bf16  # a float32 model for the float32 main params
    assert reads and all(n.startswith("opt_state.main_params.") for n, _ in reads)
    for a, b in zip(jax.tree.leaves(main), jax.tree.leaves(state.opt_state.main_params)):
        assert a.dtype == np.float32 and np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="params source 'adam'"):
        restore_run_params(bf16_tp2_ckpt, source="adam")


def test_evaluate_cli_params_only(bf16_tp2_ckpt, capsys):
    from jmegatron.evaluate import main

    with orbax_reads() as reads:
        assert main(["--load", bf16_tp2_ckpt, "--split", "valid", "--eval-iters", "1", "--devices", "8", "--mock-data"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["params"] == "model" and np.isfinite(out["loss"])
    # the evaluation step's compilation is announced with its time, before the result
    assert lines[0] == "[jmegatron] compiling the evaluation step for tokens [4, 4, 32] ...", lines
    assert re.fullmatch(r"\[jmegatron\] compiled the evaluation step for tokens \[4, 4, 32\] in [0-9.]+ s", lines[1])
    assert all(n.startswith("params.") for n, _ in reads)
    assert main(["--load", bf16_tp2_ckpt, "--split", "valid", "--eval-iters", "1", "--params", "main", "--mock-data"]) == 0
    main_loss = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"]
    assert abs(main_loss - out["loss"]) < 0.05  # float32 main vs bf16 model: close, computed differently


def test_stacked_checkpoint_into_another_layout(tmp_path):
    # saved scanned (stacked decoder_layers), restored per-layer under tp2: converted, params only
    save_checkpoint(tmp_path, vocab_size=512, scan_layers=True)
    saved_run, state, _ = restore_run(str(tmp_path))
    cfg = saved_run.cfg.replace(scan_layers=False, tensor_model_parallel_size=2)
    run = build(cfg, create_mesh(cfg))
    ckpt = checkpointing.Checkpointer(str(tmp_path), create=False)
    with orbax_reads() as reads:
        params, _ = checkpoint_restore.restore_params(ckpt, run.abstract_with_shardings().params, cfg)
    ckpt.close()
    assert reads and all(n.startswith("params.") for n, _ in reads)
    assert "decoder_layers_1" in params
    for i in range(cfg.num_layers):
        got = params[f"decoder_layers_{i}"]
        want = jax.tree.map(lambda a, i=i: a[i], state.params["decoder_layers"])
        for (path, a), b, s in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                                   jax.tree.leaves(run.state_shardings.params[f"decoder_layers_{i}"])):
            assert a.sharding == s and np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)


def test_mismatched_checkpoint_named_before_reading(bf16_tp2_ckpt):
    cfg = restore_run(bf16_tp2_ckpt)[0].cfg.replace(hidden_size=64)
    run = build(cfg, create_mesh(cfg, jax.devices()[:1]))
    ckpt = checkpointing.Checkpointer(bf16_tp2_ckpt, create=False)
    with orbax_reads() as reads, pytest.raises(checkpointing.CheckpointError, match=r"params/.*has shape"):
        checkpoint_restore.restore_params(ckpt, run.abstract_with_shardings().params, cfg)
    ckpt.close()
    assert not reads


# ---------------------------------------------------------------------------- streaming export
@pytest.fixture(scope="module")
def deep_ckpt(tmp_path_factory):
    # 8 layers of 3 MiB, a small vocabulary: the decoder layers are most of the model, and
    # a layer is larger than the export's constant allocations (Orbax metadata, copy buffer)
    return save_checkpoint(tmp_path_factory.mktemp("deep"), vocab_size=128, num_layers=8, hidden_size=256,
                           num_attention_heads=4, global_batch_size=8, make_vocab_size_divisible_by=128)


def test_streaming_export_holds_one_layer(deep_ckpt, tmp_path, monkeypatch):
    from jmegatron.export import stream
    from jmegatron.export.common import load_checkpoint
    from jmegatron.conversion.hf import to_hf_state_dict

    src = load_checkpoint(deep_ckpt)
    layer_bytes = nbytes(src.params["decoder_layers_0"])
    common_bytes = nbytes({k: v for k, v in src.params.items() if not k.startswith("decoder_layers")})
    model_bytes = nbytes(src.params)
    assert model_bytes > 7 * layer_bytes

    live = {"now": 0, "peak": 0, "arrays": 0}
    real_read = checkpoint_restore.CheckpointParamsReader._read

    def counted_read(self, leaf, slot=None):
        a = real_read(self, leaf, slot)
        size = a.nbytes
        live["now"] += size
        live["arrays"] += 1
        live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(a, lambda: live.__setitem__("now", live["now"] - size))
        return a

    monkeypatch.setattr(checkpoint_restore.CheckpointParamsReader, "_read", counted_read)
    out = tmp_path / "hf"
    out.mkdir()
    del src
    # a first export loads every module the export touches (transformers' lazy imports):
    # module objects are not the export's memory
    (tmp_path / "warm").mkdir()
    stream.export_hf_streaming(deep_ckpt, str(tmp_path / "warm"))
    live.update(now=0, peak=0, arrays=0)
    tracemalloc.start()
    summary = stream.export_hf_streaming(deep_ckpt, str(out), max_shard_size=3 * layer_bytes)
    _, stream_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # the reader's arrays alive at once: the non-layer params + one decoder layer, never two
    assert live["arrays"] > 0 and live["now"] == 0
    assert live["peak"] <= common_bytes + layer_bytes, (live["peak"], common_bytes, layer_bytes)
    assert summary["bytes_read"] == model_bytes  # float32 checkpoint: each parameter once, nothing else
    # host allocations (numpy + Python) stay far below the model; the whole-model path exceeds it
    assert stream_peak < common_bytes + 3 * layer_bytes + (4 << 20), (stream_peak, layer_bytes, common_bytes)
    tracemalloc.start()
    whole = load_checkpoint(deep_ckpt)
    ref = to_hf_state_dict(whole.params, whole.cfg, whole.vocab_size)
    _, whole_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert whole_peak > model_bytes > 2 * stream_peak
    # several shards + index, the same tensors as the whole-model conversion
    files = summary["files"]
    assert len(files) > 2 and (out / "model.safetensors.index.json").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ref) and set(index["weight_map"].values()) == set(files)
    from safetensors.numpy import load_file

    got = {}
    for f in files:
        assert os.path.getsize(out / f) <= 3 * layer_bytes + 4096
        got.update(load_file(str(out / f)))
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert np.array_equal(got[k], v), k


def test_streamed_shards_load_in_transformers(deep_ckpt, tmp_path):
    import torch
    import transformers
    from jmegatron.export.convert import export_hf

    summary = export_hf(deep_ckpt, str(tmp_path / "hf"), max_shard_size="8MB")
    assert len(summary["files"]) > 2
    run, params, _ = restore_run_params(deep_ckpt)
    tokens = np.random.default_rng(0).integers(0, summary["vocab_size"], (2, 16)).astype(np.int32)
    ref = np.asarray(run.model.apply({"params": params}, tokens))[..., :summary["vocab_size"]]
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    assert np.abs(got - ref).max() <= 1e-4


def test_safetensors_writer_rejects_bad_input(tmp_path):
    from jmegatron.export.common import ExportError
    from jmegatron.export.stream import SafetensorsWriter, parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 << 20 and parse_size(123) == 123
    with pytest.raises(ExportError, match="--max-shard-size"):
        parse_size("lots")
    w = SafetensorsWriter(str(tmp_path))
    w.add("a", np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="added twice"):
        w.add("a", np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="complex64"):
        w.add("b", np.zeros(3, np.complex64))
    assert w.close() == ["model.safetensors"]
