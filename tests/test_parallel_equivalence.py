"""Megatron's parallelisms on 8 simulated CPU devices give the same losses and gradients
as one device (float32, relative 1e-5, 3 steps), with dropout on (hidden and attention
0.1): masks are drawn from global sample numbers (jmegatron/models/dropout.py), never
from the rank. Layouts without tensor parallelism run the CPU kernels as the one-device
reference does ("auto"); tensor-parallel ones run XLA's attention and matmuls."""

import jax
import numpy as np
import pytest

from jmegatron.config import ConfigError
from jmegatron.kernels import cpu
from jmegatron.parallel.mesh import create_mesh
from jmegatron.training.run import build

from test_train_step import random_batches, tiny_cfg

DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)
LAYOUTS = {
    "dp8": dict(),
    "dp8_distopt": dict(use_distributed_optimizer=True),
    "tp2_dp4": dict(tensor_model_parallel_size=2),
    "tp4_sp_dp2": dict(tensor_model_parallel_size=4, sequence_parallel=True),
    "tp2_dp4_distopt": dict(tensor_model_parallel_size=2, use_distributed_optimizer=True),
    "fsdp8": dict(use_megatron_fsdp=True),
}
LLAMA = dict(family="llama", num_attention_heads=8, num_query_groups=4, ffn_hidden_size=96)


def trajectory(cfg, num_devices, steps=3):
    run = build(cfg, create_mesh(cfg, jax.devices()[:num_devices]))
    state = run.init_state()
    losses, grads = [], []
    for b in random_batches(steps, run.global_batch_size, cfg.seq_length, 500):
        b = run.put_batch({k: v.reshape(run.num_microbatches, -1, cfg.seq_length) for k, v in b.items()})
        g, _, _ = run.compute_grads(state, b)
        grads.append(jax.device_get(g))
        state, m = run.train_step(state, b)
        losses.append(float(m["lm_loss"]))
    return np.array(losses), grads, run


@pytest.fixture(scope="module")
def reference(request):
    arch = {} if request.param == "gpt" else LLAMA
    # One device, the same 2 micro-batches of 8 sequences as every layout below.
    ref = trajectory(tiny_cfg(micro_batch_size=8, **DROPOUT, **arch), 1)
    assert ref[2].model.cfg.attention_impl == "cpu" or not cpu.available()
    return arch, ref


# pure data parallelism does not depend on the architecture: llama runs the layouts that split
# its weights (tensor parallelism, ZeRO-1's tp2_dp4_distopt, FSDP), gpt every layout
@pytest.mark.parametrize("reference,layout", [(arch, layout) for arch in ("gpt", "llama") for layout in LAYOUTS
                                              if not (arch == "llama" and layout in ("dp8", "dp8_distopt"))],
                         indirect=["reference"])
def test_layout_matches_one_device(layout, reference):
    arch, (ref_losses, ref_grads, _) = reference
    kw = dict(LAYOUTS[layout], **arch)
    tp = kw.get("tensor_model_parallel_size", 1)
    # dp = 8 / tp ranks of micro_batch_size tp: 2 micro-batches of 8 sequences, as the reference.
    cfg = tiny_cfg(micro_batch_size=tp, **DROPOUT, **kw)
    losses, grads, run = trajectory(cfg, 8)
    assert run.model.cfg.attention_impl == ("xla" if tp > 1 or not cpu.available() else "cpu")
    assert run.num_microbatches == 2 and run.mesh.shape["tensor"] == tp
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        flat_g, flat_r = jax.tree.leaves(g), jax.tree.leaves(r)
        assert len(flat_g) == len(flat_r)
        for a, b in zip(flat_g, flat_r):
            scale = np.max(np.abs(b)) + 1e-12
            np.testing.assert_allclose(a / scale, b / scale, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw, match", [
    (dict(tensor_model_parallel_size=3), "8 devices are not divisible by tensor\\(3\\)"),
    (dict(tensor_model_parallel_size=8), "num_attention_heads=4 is not divisible by tensor_model_parallel_size=8"),
    (dict(tensor_model_parallel_size=4, num_query_groups=2), "num_query_groups=2 is not divisible"),
    (dict(tensor_model_parallel_size=2, ffn_hidden_size=99), "ffn_hidden_size=99 is not divisible"),
    (dict(use_megatron_fsdp=True, hidden_size=60, num_attention_heads=4), "hidden_size=60 is not divisible by the data-parallel size 8"),
    (dict(sequence_parallel=True), "sequence_parallel=True needs"),
])
def test_bad_parallel_sizes_fail_at_start_up(kw, match):
    with pytest.raises(ConfigError, match=match):
        cfg = tiny_cfg(**kw)
        build(cfg, create_mesh(cfg, jax.devices()[:8]))


@pytest.mark.parametrize("reference,kw", [
    ("gpt", dict(tensor_model_parallel_size=2)),
    ("llama", dict(tensor_model_parallel_size=2, sequence_parallel=True, use_distributed_optimizer=True)),
], indirect=["reference"])
def test_tensor_parallel_alone_matches_one_device(kw, reference):
    # tp 2 on 2 devices: one data-parallel rank, so the data collectives are skipped (XLA's
    # partitioner rejects an all-reduce over a size-1 manual axis beside an automatic one)
    arch, (ref_losses, ref_grads, _) = reference
    losses, grads, run = trajectory(tiny_cfg(micro_batch_size=8, **DROPOUT, **kw, **arch), 2)
    assert run.mesh.shape["data"] == 1 and run.num_microbatches == 2
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads[-1]), jax.tree.leaves(ref_grads[-1])):
        scale = np.max(np.abs(b)) + 1e-12
        np.testing.assert_allclose(a / scale, b / scale, rtol=1e-5, atol=1e-5)
