"""Transformer Engine behind an import check (jmegatron/models/te.py), the per-backend
resolution of the "auto" kernels (models/gpt.py resolve_impls) and the cuDNN attention
core's refusals off a GPU. The resolution logic is pure and runs everywhere; what needs TE
or an NVIDIA GPU is skipped with the reason (pytest -ra prints it)."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmegatron.config import ConfigError
from jmegatron.models import te
from jmegatron.kernels.xla.attention import xla_attention
from jmegatron.models.backend import cudnn_attention_supported, resolve_impls
from jmegatron.models.core_attention import CORE_ATTENTIONS, cudnn_attention, dot_product_attention
from jmegatron.parallel.rules import make_rules

from test_train_step import tiny_cfg

HAVE_TE, TE_REASON = te.te_available()
ON_GPU = jax.default_backend() == "gpu"


def test_te_available_gives_a_reason_when_it_does_not_import():
    ok, reason = te.te_available()
    try:
        import transformer_engine.jax  # noqa: F401
        imports = True
    except Exception:
        imports = False
    assert ok == imports
    assert (reason == "") == ok
    if not ok:
        assert reason.startswith("import transformer_engine.jax failed:")


@pytest.mark.parametrize("choice,backend,available,want", [
    ("local", "gpu", (True, ""), "local"),
    ("auto", "cpu", (True, ""), "local"),
    ("auto", "tpu", (True, ""), "local"),
    ("auto", "gpu", (True, ""), "transformer_engine"),
    ("auto", "gpu", (False, "no module"), "local"),
    ("transformer_engine", "cpu", (True, ""), "transformer_engine"),
    ("transformer_engine", "gpu", (False, "no module"), "local"),
])
def test_resolve_transformer_impl(choice, backend, available, want):
    assert te.resolve_transformer_impl(choice, backend, available) == want


def test_transformer_engine_unavailable_prints_one_line_and_uses_local(capsys):
    te._warned.clear()
    for _ in range(2):
        assert te.resolve_transformer_impl("transformer_engine", "gpu", (False, "ImportError: boom")) == "local"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ImportError: boom" in err[0] and "pure-JAX" in err[0]


@pytest.mark.parametrize("fp8,recipe,want_cls,want", [
    ("e4m3", "delayed", "DelayedScaling",
     dict(fp8_format="E4M3", margin=2, amax_history_len=16, amax_compute_algo="max")),
    ("hybrid", "tensorwise", "Float8CurrentScaling", dict(fp8_format="HYBRID")),
    ("e4m3", "mxfp8", "MXFP8BlockScaling", dict(fp8_format="E4M3")),
])
def test_recipe_spec_follows_megatron_fields(fp8, recipe, want_cls, want):
    cfg = tiny_cfg(fp8=fp8, fp8_recipe=recipe, fp8_margin=2, fp8_amax_history_len=16, fp8_amax_compute_algo="max")
    assert te.recipe_spec(cfg) == (want_cls, want)


def test_recipe_spec_needs_fp8():
    with pytest.raises(ConfigError, match="config.fp8"):
        te.recipe_spec(tiny_cfg())


class _Recipe:
    def __init__(self, **kw):
        self.kw = kw


def test_make_recipe_builds_from_a_recipe_module_and_names_the_te_version_when_a_recipe_is_missing():
    old_te = types.SimpleNamespace(Format=types.SimpleNamespace(E4M3="E4M3!", HYBRID="HYBRID!"),
                                   DelayedScaling=_Recipe)  # a TE 1.x recipe module: delayed scaling only
    r = te.make_recipe(tiny_cfg(fp8="hybrid", fp8_amax_history_len=4), old_te, version="1.4")
    assert isinstance(r, _Recipe) and r.kw == dict(fp8_format="HYBRID!", margin=0, amax_history_len=4,
                                                   amax_compute_algo="most_recent")
    with pytest.raises(ConfigError, match=r"Transformer Engine 1\.4 lacks.*MXFP8BlockScaling|MXFP8BlockScaling.*1\.4"):
        te.make_recipe(tiny_cfg(fp8="e4m3", fp8_recipe="mxfp8"), old_te, version="1.4")


def test_mesh_resource_kwargs_from_the_logical_axis_table():
    axes = ("pipeline", "data", "expert", "context", "tensor")
    plain = te.mesh_resource_kwargs(make_rules(tiny_cfg()), axes)
    assert plain == dict(dp_resource="data", tp_resource="tensor", tpsp_resource=None, fsdp_resource=None,
                         pp_resource=None, ep_resource="expert", cp_resource=None)
    cfg = tiny_cfg(tensor_model_parallel_size=2, sequence_parallel=True, use_megatron_fsdp=True,
                   pipeline_model_parallel_size=2, num_layers=4, context_parallel_size=2,
                   cp_comm_type="all_gather")
    full = te.mesh_resource_kwargs(make_rules(cfg), axes, cfg.context_parallel_size)
    assert full == dict(dp_resource="data", tp_resource="tensor", tpsp_resource="tensor", fsdp_resource="data",
                        pp_resource="pipeline", ep_resource="expert", cp_resource="context")
    # an axis the mesh lacks is not named
    assert te.mesh_resource_kwargs(make_rules(tiny_cfg()), ("data",))["tp_resource"] is None


@pytest.mark.parametrize("kw,backend,want", [
    (dict(), "cpu", None),  # the CPU kernels where they build (checked below)
    (dict(bf16=True), "cpu", ("xla", "xla", "xla")),
    (dict(bf16=True), "gpu", ("cudnn", "xla", "pallas")),
    (dict(fp16=True), "gpu", ("cudnn", "xla", "pallas")),
    (dict(), "gpu", ("pallas", "xla", "pallas")),  # float32: not cuDNN
    (dict(bf16=True, attention_dropout=0.1), "gpu", ("pallas", "xla", "pallas")),
    (dict(bf16=True, kv_channels=160), "gpu", ("pallas", "xla", "pallas")),
    (dict(bf16=True), "rocm", ("xla", "xla", "xla")),
    (dict(bf16=True), "tpu", ("xla", "xla", "xla")),
    (dict(bf16=True, attention_impl="xla", cross_entropy_impl="xla"), "gpu", ("xla", "xla", "xla")),
])
def test_resolve_impls_per_backend(kw, backend, want):
    got = resolve_impls(tiny_cfg(transformer_impl="local", **kw), backend=backend)
    assert got["transformer_impl"] == "local"
    triple = (got["attention_impl"], got["matmul_impl"], got["cross_entropy_impl"])
    if want is None:  # float32 on the CPU: the CPU kernels, or XLA where they do not build
        from jmegatron.kernels import cpu
        assert triple in ((("cpu", "hybrid", "xla"),) if cpu.available() else (("xla", "xla", "xla"),))
    else:
        assert triple == want


@pytest.mark.parametrize("available", [(True, ""), (False, "ModuleNotFoundError: transformer_engine")])
def test_resolve_impls_under_transformer_engine(monkeypatch, available):
    monkeypatch.setattr(te, "te_available", lambda: available)  # jmegatron's own check, injected
    got = resolve_impls(tiny_cfg(bf16=True), backend="gpu")
    if available[0]:  # Megatron's TE layers: TE's GEMMs and fused attention
        assert (got["transformer_impl"], got["attention_impl"], got["matmul_impl"]) == ("transformer_engine",) * 3
    else:
        assert (got["transformer_impl"], got["attention_impl"], got["matmul_impl"]) == ("local", "cudnn", "xla")
    # on the CPU "auto" never picks TE, even where it imports
    assert resolve_impls(tiny_cfg(bf16=True), backend="cpu")["transformer_impl"] == "local"


def test_te_dense_needs_the_fp8_fields_on_the_config_it_gets():
    from jmegatron.models.transformer_config import ModelConfig
    mc = ModelConfig.from_config(tiny_cfg(), 512)
    if not hasattr(mc, "fp8"):  # before the FP8 part of issue 15 adds them to ModelConfig
        mc = dataclasses.replace(mc, matmul_impl="transformer_engine")
        with pytest.raises(ConfigError, match="ModelConfig carries no fp8 fields"):
            mc.dense_dot_general()


def test_cudnn_support_reasons():
    assert cudnn_attention_supported(tiny_cfg(bf16=True)) == (True, "")
    ok, why = cudnn_attention_supported(tiny_cfg())
    assert not ok and "bfloat16" in why
    ok, why = cudnn_attention_supported(tiny_cfg(bf16=True, kv_channels=132))
    assert not ok and "kv_channels=132" in why
    ok, why = cudnn_attention_supported(tiny_cfg(bf16=True, reset_attention_mask=True, seq_length=33))
    assert not ok and "seq_length=33" in why
    # cuDNN's head-dim bound per architecture (JAX's check_is_flash_attention): 256 from Hopper, 128 before
    hd192 = tiny_cfg(bf16=True, kv_channels=192)
    assert cudnn_attention_supported(hd192, (9, 0)) == (True, "")
    ok, why = cudnn_attention_supported(hd192, (8, 0))
    assert not ok and "<= 128" in why


def _qkv(dtype=jnp.bfloat16, b=2, s=16, nq=4, nkv=2, d=16):
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    return (jax.random.normal(ks[0], (b, s, nq, d), dtype), jax.random.normal(ks[1], (b, s, nkv, d), dtype),
            jax.random.normal(ks[2], (b, s, nkv, d), dtype))


def test_cudnn_core_is_registered_and_refuses_dropout_and_non_gpu_backends():
    assert CORE_ATTENTIONS["cudnn"] is cudnn_attention
    q, k, v = _qkv()
    with pytest.raises(ConfigError, match="attention_impl='cudnn' has no attention dropout"):
        cudnn_attention(q, k, v, dropout_rate=0.1, deterministic=False, dropout_rng=jax.random.PRNGKey(1))
    if not ON_GPU:
        with pytest.raises(ConfigError, match=r"attention_impl='cudnn' needs an NVIDIA GPU.*attention_impl='auto'"):
            cudnn_attention(q, k, v)


def test_jax_nn_path_with_document_mask_matches_the_xla_core():
    """The mask cudnn_attention hands jax.nn (shared with "dot_product", XLA here)."""
    q, k, v = _qkv(jnp.float32)
    seg = jnp.array([[0] * 5 + [1] * 11, [0] * 16], jnp.int32)
    np.testing.assert_allclose(dot_product_attention(q, k, v, segment_ids=seg),
                               xla_attention(q, k, v, segment_ids=seg), atol=2e-5)


@pytest.mark.skipif(not ON_GPU, reason="cuDNN attention needs an NVIDIA GPU (jax.default_backend() != 'gpu')")
def test_cudnn_core_matches_xla_on_gpu():
    q, k, v = _qkv(jnp.bfloat16, s=128, d=64)
    seg = jnp.array([[0] * 50 + [1] * 78, [0] * 128], jnp.int32)
    for segment_ids in (None, seg):
        got = cudnn_attention(q, k, v, segment_ids=segment_ids).astype(jnp.float32)
        want = xla_attention(q, k, v, segment_ids=segment_ids).astype(jnp.float32)
        np.testing.assert_allclose(got, want, atol=2e-2)

    def loss(core, q, k, v):
        return jnp.sum(core(q, k, v).astype(jnp.float32) ** 2)
    g = jax.grad(loss, argnums=(1, 2, 3))(cudnn_attention, q, k, v)
    g_ref = jax.grad(loss, argnums=(1, 2, 3))(xla_attention, q, k, v)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a.astype(jnp.float32), b.astype(jnp.float32), atol=5e-2, rtol=5e-2)


te_only = pytest.mark.skipif(not HAVE_TE, reason=f"Transformer Engine unavailable: {TE_REASON}")


@te_only
def test_make_recipe_with_the_installed_te():
    from transformer_engine.common import recipe
    r = te.make_recipe(tiny_cfg(fp8="hybrid", fp8_margin=1, fp8_amax_history_len=8, fp8_amax_compute_algo="max"))
    assert isinstance(r, recipe.DelayedScaling) and r.margin == 1 and r.amax_history_len == 8
    assert r.fp8_format == recipe.Format.HYBRID


@te_only
def test_mesh_resource_with_the_installed_te():
    from jmegatron.parallel.mesh import create_mesh
    cfg = tiny_cfg()
    res = te.mesh_resource(cfg, create_mesh(cfg))
    assert res.dp_resource == "data" and res.tp_resource == "tensor"


@te_only
@pytest.mark.skipif(not ON_GPU, reason="Transformer Engine's kernels need an NVIDIA GPU")
def test_te_fused_attention_and_dense_match_xla_on_gpu():
    q, k, v = _qkv(jnp.bfloat16, s=128, d=64)
    np.testing.assert_allclose(te.te_fused_attention(q, k, v).astype(jnp.float32),
                               xla_attention(q, k, v).astype(jnp.float32), atol=2e-2)
    x = jax.random.normal(jax.random.PRNGKey(3), (4, 32, 64), jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(4), (64, 128), jnp.bfloat16) * 0.1
    dims = (((2,), (0,)), ((), ()))
    got = te.te_dot_general(tiny_cfg(bf16=True))(x, w, dims)
    np.testing.assert_allclose(got.astype(jnp.float32), jax.lax.dot_general(x, w, dims).astype(jnp.float32),
                               atol=5e-2, rtol=2e-2)
    fp8 = te.te_dot_general(tiny_cfg(bf16=True, fp8="hybrid", fp8_recipe="tensorwise"))(x, w, dims)
    ref = jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), dims)
    assert float(jnp.linalg.norm(fp8.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)) < 0.1


def test_te_dense_refuses_te_delayed_scaling():  # refused before TE is imported
    with pytest.raises(ConfigError, match="fp8_recipe='delayed' is not built"):
        te.te_dot_general(tiny_cfg(bf16=True, fp8="e4m3"))
