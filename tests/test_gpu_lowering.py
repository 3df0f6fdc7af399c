"""The Pallas kernels lower for an NVIDIA GPU on this CPU machine: ``jax.jit(f).trace(...)
.lower(lowering_platforms=("cuda",))`` gives Triton custom calls (``__gpu$xla.gpu.triton``).

Without compiler parameters jax 0.10.2 lowers a ``pallas_call`` through Mosaic GPU
(``jax_pallas_use_mosaic_gpu`` defaults to True there), which rejects these kernels ("Failed
to infer the output layout of the iota"): the kernels pass Triton's
(:func:`jmegatron.kernels.pallas.common.triton_params`). Lowering only: Triton's own
compile to PTX happens on the GPU."""

import jax
import jax.numpy as jnp
import pytest

from jmegatron.kernels.pallas.common import triton_params
from jmegatron.kernels.pallas.cross_entropy import pallas_softmax_cross_entropy
from jmegatron.kernels.pallas.flash_attention import pallas_attention

TRITON = "__gpu$xla.gpu.triton"


def _triton_calls(fn, *shapes) -> int:
    return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text().count(TRITON)


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", [
    (jnp.bfloat16, 8, 2, 128),  # Llama-style GQA at head_dim 128
    (jnp.float32, 4, 4, 64),
])
def test_flash_attention_forward_and_backward_lower_to_triton(dtype, heads, kv_heads, head_dim):
    q = jax.ShapeDtypeStruct((2, 256, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((2, 256, kv_heads, head_dim), dtype)

    def attention(q, k, v):
        return pallas_attention(q, k, v, interpret=False, tensor_axis=None)

    def grads(q, k, v):
        return jax.grad(lambda *a: attention(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

    assert _triton_calls(attention, q, kv, kv) == 1
    assert _triton_calls(grads, q, kv, kv) == 3  # the forward, dQ, dK/dV


def test_cross_entropy_lowers_to_triton():
    logits = jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((64,), jnp.int32)

    def loss(z, y):
        return pallas_softmax_cross_entropy(z, y, interpret=False).sum()

    assert _triton_calls(loss, logits, labels) == 1
    assert _triton_calls(jax.grad(loss), logits, labels) == 2


def test_warps_follow_the_tile_width():
    assert (triton_params(64).num_warps, triton_params(128).num_warps, triton_params(128).num_stages) == (4, 8, 2)


@pytest.mark.parametrize("head_dim", [96, 192])  # configs/bytemlperf/moe.py's 192: padded to 256
def test_head_dims_that_are_not_powers_of_two_lower(head_dim):
    q = jax.ShapeDtypeStruct((1, 128, 4, head_dim), jnp.bfloat16)
    assert _triton_calls(lambda q, k, v: pallas_attention(q, k, v, interpret=False, tensor_axis=None), q, q, q) == 1


def test_gpu_check_lower_only_lowers_every_shipped_shape(capsys):
    """``gpu_check --lower-only``: gpt_tiny, ByteMLPerf's GPT-3 345M and MoE (head_dim 192) and
    Llama-3-8B (head_dim 128, GQA), bf16 and FP8, each train step lowered for cuda with the
    Pallas kernels as Triton calls (2 layers x forward, dQ, dK/dV + the cross-entropy's 2) and
    the FP8 rows' dots on f8E4M3FN / f8E5M2 operands."""
    from jmegatron.tools import gpu_check

    assert gpu_check.main(["--lower-only"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| configs/")]
    assert len(rows) == 8
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3] == "lowered" and cells[4] == "8", row
        assert (cells[5] == "f8E4M3FN f8E5M2") == (cells[1] == "fp8"), row
    assert {c.split("|")[3].strip() for c in rows} == {"64", "192", "128"}


def test_a_row_that_does_not_lower_is_reported_and_the_table_goes_on(capsys):
    from jmegatron.tools import gpu_lower

    # 100 tokens: one 100-row tile, which Triton cannot lower (its tiles are powers of two)
    bad = gpu_lower.lowering_row(gpu_lower.DEFAULT_CONFIGS[0], "bf16", {"seq_length": 100})
    assert bad.status.startswith("ERROR: ValueError: The Pallas Triton lowering currently requires"), bad.status
    assert gpu_lower.main([gpu_lower.DEFAULT_CONFIGS[0]], {"seq_length": 100}) == 1
    assert capsys.readouterr().out.count("ERROR: ValueError") == 2  # both precisions, both printed
