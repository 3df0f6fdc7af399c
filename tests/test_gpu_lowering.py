"""The Pallas kernels lower for an NVIDIA GPU on this CPU machine: ``jax.jit(f).trace(...)
.lower(lowering_platforms=("cuda",))`` gives Triton custom calls (``__gpu$xla.gpu.triton``).

Without compiler parameters jax 0.10.2 lowers a ``pallas_call`` through Mosaic GPU
(``jax_pallas_use_mosaic_gpu`` defaults to True there), which rejects these kernels ("Failed
to infer the output layout of the iota"): the kernels pass Triton's
(:func:`jmegatron.kernels.pallas.common.triton_params`). Lowering only: Triton's own
compile to PTX happens on the GPU."""

import os

import jax
import jax.numpy as jnp
import pytest

from jmegatron.kernels import gpu_target
from jmegatron.kernels.pallas.common import triton_params
from jmegatron.kernels.pallas.cross_entropy import pallas_softmax_cross_entropy
from jmegatron.kernels.pallas.flash_attention import pallas_attention

TRITON = "__gpu$xla.gpu.triton"


def _triton_calls(fn, *shapes) -> int:
    with gpu_target.lowering_for():  # from jax 0.11 the Triton lowering reads the GPU's info
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
    """``gpu_check --lower-only`` for an H100: gpt_tiny, ByteMLPerf's GPT-3 345M and MoE
    (head_dim 192) and Llama-3-8B (head_dim 128, GQA) in bf16 and FP8 with Pallas attention
    (2 layers x forward, dQ, dK/dV + the cross-entropy's 2 Triton calls) and in bf16 with the
    backend's choice, cuDNN (head_dim 192 included: Hopper takes up to 256); Llama-3-8B under
    tp2 and cp2 (ring attention: Pallas block forms per ring step). FP8 rows' dots are on
    f8E4M3FN / f8E5M2 operands, the others' not."""
    from jmegatron.tools import gpu_check

    assert gpu_check.main(["--lower-only"]) == 0
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| configs/")]
    assert len(rows) == 16
    for config, precision, layout, head_dim, attention, status, triton, cudnn, fp8, _ in rows:
        assert status == "lowered", (config, precision, layout, status)
        assert (fp8 == "f8E4M3FN f8E5M2") == (precision == "fp8"), (config, precision, fp8)
        if attention == "cudnn":
            assert (cudnn, triton) == ("4", "2"), (config, cudnn, triton)  # fwd + bwd per layer; the loss's 2
        elif layout != "cp2":
            assert (attention, triton, cudnn) == ("pallas", "8", "0"), (config, layout, attention, triton)
        else:
            assert int(triton) > 8, (config, triton)  # the ring's steps each run the block kernels
    assert {r[3] for r in rows} == {"64", "192", "128"}
    assert {r[2] for r in rows} == {"1", "tp2", "tp2+sp", "cp2"}
    assert sum(r[4] == "cudnn" for r in rows) == 4


def test_cudnn_head_dim_limit_follows_the_named_gpu():
    """auto attention for head_dim 192 (ByteMLPerf's MoE) is cuDNN on Hopper (<= 256) and
    Pallas on an A100 (cuDNN <= 128 there), as JAX's cuDNN checks state the limits."""
    from jmegatron.models.backend import resolve_impls
    from jmegatron.tools import gpu_lower

    cfg = gpu_lower.lowering_config(gpu_lower.Case(gpu_lower.DEFAULT_CONFIGS[2], "bf16", "auto"))
    assert cfg.kv_channels == 192
    with gpu_target.lowering_for("NVIDIA H100 80GB HBM3"):
        assert resolve_impls(cfg)["attention_impl"] == "cudnn"
    with gpu_target.lowering_for("NVIDIA A100-SXM4-80GB"):
        assert resolve_impls(cfg)["attention_impl"] == "pallas"
    with pytest.raises(ValueError, match="compute capability unknown"):
        gpu_target.compute_capability_of("NVIDIA Imaginary X1")
    assert resolve_impls(cfg)["attention_impl"] == "xla"  # outside: this CPU


def test_a_row_that_does_not_lower_is_reported_and_the_table_goes_on(capsys, monkeypatch):
    """An injected lowering failure (a Triton-like error in the bf16 rows) and a config error:
    each row says ERROR with its reason, the rows after them still lower, the exit status is 1."""
    from jmegatron.tools import gpu_lower

    real = gpu_lower.lower_train_step

    def failing(cfg, *a, **kw):
        if not cfg.fp8:
            raise RuntimeError("INTERNAL: Triton lowering failed\ndetail")
        return real(cfg, *a, **kw)
    monkeypatch.setattr(gpu_lower, "lower_train_step", failing)
    tiny = gpu_lower.DEFAULT_CONFIGS[0]
    cases = [gpu_lower.Case(tiny, "bf16"), gpu_lower.Case(os.path.join(gpu_lower.REPO, "configs", "nope.py")),
             gpu_lower.Case(tiny, "fp8")]
    assert gpu_lower.report_lowering(cases) == 1
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| configs/")]
    assert "ERROR: RuntimeError: INTERNAL: Triton lowering failed |" in rows[0]
    assert "ERROR: FileNotFoundError" in rows[1]
    assert "| lowered | 8 |" in rows[2]  # after both failures


def test_a_sequence_that_is_not_a_power_of_two_lowers():
    q = jax.ShapeDtypeStruct((1, 100, 4, 64), jnp.bfloat16)  # padded to one 128-row tile
    assert _triton_calls(lambda q, k, v: pallas_attention(q, k, v, interpret=False, tensor_axis=None), q, q, q) == 1
