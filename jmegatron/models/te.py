"""Transformer Engine (``transformer_engine.jax``) behind an import check.

The counterpart of Megatron-LM's megatron/core/extensions/transformer_engine.py: TE's FP8
recipes from Megatron's config fields, TE's GEMM as a ``dot_general`` for the dense
layers (QKV, attention projection, fc1, fc2: Megatron's TELinear / TELayerNormColumnParallelLinear
/ TERowParallelLinear), TE's fused attention (TEDotProductAttention) and TE's
``MeshResource`` built from jmegatron's one logical-axis table
(:func:`jmegatron.parallel.rules.make_rules`). Everything that does not need TE itself is a
pure function (resolution, recipe arguments, mesh resources), so it is tested on machines
without TE; the rest imports TE lazily and names the TE version in its errors.

TE APIs used (TE 2.x, transformer_engine/jax): ``transformer_engine.common.recipe``
(``Format``, ``DelayedScaling``, ``Float8CurrentScaling``, ``MXFP8BlockScaling``),
``transformer_engine.jax.autocast`` (``fp8_autocast`` before 2.8), ``MeshResource``,
``transformer_engine.jax.dense.dense`` with a quantizer set from
``transformer_engine.jax.quantize.QuantizerFactory``, and
``transformer_engine.jax.flax.DotProductAttention``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from typing import Any, Callable, Optional, Sequence

import jax

from jmegatron.config import ConfigError
from jmegatron.parallel.rules import CONTEXT_AXIS, DEFAULT_RULES, make_rules

# Megatron's --fp8-format -> TE's recipe.Format member
FP8_FORMAT_NAMES = {"e4m3": "E4M3", "hybrid": "HYBRID"}
# Megatron's --fp8-recipe -> TE's recipe class (megatron/core/fp8_utils.py get_fp8_recipe)
RECIPE_CLASSES = {"delayed": "DelayedScaling", "tensorwise": "Float8CurrentScaling", "mxfp8": "MXFP8BlockScaling"}
# recipes whose quantizers keep no state between steps (TE computes the scales from the
# current tensor): their GEMMs run inside jmegatron's train step as plain functions
STATELESS_RECIPES = ("tensorwise", "mxfp8")

_warned: set[str] = set()


@functools.lru_cache(maxsize=None)
def te_available() -> tuple[bool, str]:
    """``(True, "")`` when ``transformer_engine.jax`` imports, else ``(False, reason)`` with the
    import's error (the module missing, or its CUDA libraries failing to load)."""
    try:
        import transformer_engine.jax  # noqa: F401
    except Exception as e:  # ImportError, or OSError / RuntimeError from TE's library loader
        return False, f"import transformer_engine.jax failed: {type(e).__name__}: {e}"
    return True, ""


def te_version() -> str:
    """The installed Transformer Engine version ("unknown" if it has no ``__version__``)."""
    import transformer_engine
    return getattr(transformer_engine, "__version__", "unknown")


def _say_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(message, file=sys.stderr, flush=True)


def resolve_transformer_impl(choice: str, backend: str,
                             available: Optional[tuple[bool, str]] = None) -> str:
    """``config.transformer_impl`` resolved to ``"local"`` or ``"transformer_engine"``.

    ``"auto"``: Transformer Engine only on an NVIDIA GPU (``backend == "gpu"``) where it
    imports; ``"transformer_engine"`` where it does not import prints one line (what failed,
    that jmegatron's own layers are used) and resolves to ``"local"``; ``"local"`` stays.
    ``available`` (tests): :func:`te_available`'s answer, asked only when needed.
    """
    if choice == "local" or (choice == "auto" and backend != "gpu"):
        return "local"
    ok, reason = available if available is not None else te_available()
    if ok:
        return "transformer_engine"
    if choice == "transformer_engine":
        _say_once(f"jmegatron: transformer_impl='transformer_engine' unavailable ({reason}); "
                  "using the pure-JAX layers (transformer_impl='local')")
    return "local"


def recipe_spec(cfg) -> tuple[str, dict[str, Any]]:
    """TE's recipe for ``cfg`` as ``(class name, keyword arguments)``, the format given by its
    ``recipe.Format`` member name: ``fp8_recipe`` "delayed" -> ``DelayedScaling(margin,
    fp8_format, amax_history_len, amax_compute_algo)``, "tensorwise" ->
    ``Float8CurrentScaling(fp8_format)``, "mxfp8" -> ``MXFP8BlockScaling(fp8_format)``
    (Megatron's get_fp8_recipe). Raises ConfigError when ``cfg.fp8`` is None."""
    if cfg.fp8 is None:
        raise ConfigError("Transformer Engine's FP8 recipe needs config.fp8 ('e4m3' or 'hybrid').")
    kwargs: dict[str, Any] = {"fp8_format": FP8_FORMAT_NAMES[cfg.fp8]}
    if cfg.fp8_recipe == "delayed":
        kwargs.update(margin=cfg.fp8_margin, amax_history_len=cfg.fp8_amax_history_len,
                      amax_compute_algo=cfg.fp8_amax_compute_algo)
    return RECIPE_CLASSES[cfg.fp8_recipe], kwargs


def make_recipe(cfg, recipe_module: Any = None, version: Optional[str] = None):
    """TE's recipe object for ``cfg`` (:func:`recipe_spec`), from ``recipe_module``
    (default ``transformer_engine.common.recipe``). Raises ConfigError naming the TE version
    when that version lacks the recipe class (Float8CurrentScaling / MXFP8BlockScaling are
    TE 2.x)."""
    if recipe_module is None:
        from transformer_engine.common import recipe as recipe_module
    version = version or te_version()
    name, kwargs = recipe_spec(cfg)
    cls = getattr(recipe_module, name, None)
    if cls is None:
        raise ConfigError(f"config.fp8_recipe={cfg.fp8_recipe!r} needs transformer_engine's recipe.{name}, which "
                          f"Transformer Engine {version} lacks: upgrade Transformer Engine, or use "
                          f"fp8_recipe='delayed'.")
    kwargs["fp8_format"] = getattr(recipe_module.Format, kwargs["fp8_format"])
    return cls(**kwargs)


def mesh_resource_kwargs(rules: Sequence[tuple[str, Any]], mesh_axis_names: Sequence[str],
                         context_parallel_size: int = 1) -> dict[str, Optional[str]]:
    """TE's ``MeshResource`` fields from jmegatron's logical-axis table ``rules`` (name ->
    mesh axes, :func:`jmegatron.parallel.rules.make_rules`) on a mesh with ``mesh_axis_names``:
    ``dp_resource`` the batch's first axis, ``tp_resource`` the heads' axis, ``tpsp_resource``
    the residual stream's sequence axis (sequence parallelism), ``fsdp_resource`` the
    parameters' ``embed`` axis (FSDP; TE takes one axis: the first), ``pp_resource`` the
    stacked layers' axis, ``ep_resource`` the experts', ``cp_resource`` "context" when
    ``context_parallel_size > 1``. Axes of size-1 meshes are still named (sharding over
    them is the identity); names absent from the mesh are left None."""
    table = dict(rules)

    def first(logical: str) -> Optional[str]:
        axes = table.get(logical)
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        return axes[0] if axes and axes[0] in mesh_axis_names else None

    return {"dp_resource": first("batch"), "tp_resource": first("heads"),
            "tpsp_resource": first("activation_length"), "fsdp_resource": first("embed"),
            "pp_resource": first("layers"), "ep_resource": first("exp"),
            "cp_resource": CONTEXT_AXIS if context_parallel_size > 1 and CONTEXT_AXIS in mesh_axis_names else None}


def mesh_resource(cfg, mesh):
    """TE's ``MeshResource`` for ``cfg`` on ``mesh`` (:func:`mesh_resource_kwargs`; fields
    this TE version's MeshResource lacks, e.g. ``ep_resource`` before 2.x, are dropped)."""
    from transformer_engine.jax import MeshResource
    kwargs = mesh_resource_kwargs(make_rules(cfg), mesh.axis_names, cfg.context_parallel_size)
    fields = {f.name for f in dataclasses.fields(MeshResource)} if dataclasses.is_dataclass(MeshResource) else set(kwargs)
    return MeshResource(**{k: v for k, v in kwargs.items() if k in fields})


def autocast(cfg, mesh):
    """The context TE's layers trace under: ``transformer_engine.jax.autocast(enabled=fp8 is
    set, recipe, mesh_resource)`` (``fp8_autocast`` on TE versions before ``autocast``)."""
    import transformer_engine.jax as te
    recipe = make_recipe(cfg) if cfg.fp8 is not None else None
    resource = mesh_resource(cfg, mesh)
    if hasattr(te, "autocast"):
        return te.autocast(enabled=recipe is not None, recipe=recipe, mesh_resource=resource)
    return te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe, mesh_resource=resource)


def te_dot_general(cfg) -> Callable:
    """A ``dot_general(x, kernel, dims)`` for :class:`jmegatron.models.layers.Linear` running
    TE's GEMM (``transformer_engine.jax.dense.dense``), FP8-quantized by ``cfg``'s recipe
    (``cfg``: anything with Megatron's fp8 fields: a JMegatronConfig, or a ModelConfig that
    carries them; a config without an ``fp8`` field raises ConfigError rather than silently
    running unquantized).

    Only the stateless recipes ("tensorwise", "mxfp8") and no FP8 are built: TE's delayed
    scaling keeps its amax history in a Flax collection (``_overwrite_with_gradient``) that
    the train step would have to carry and overwrite; jmegatron's delayed scaling is the
    pure-JAX one (:mod:`jmegatron.models.fp8`). Raises ConfigError for ``fp8_recipe="delayed"``
    and for batch dimensions (the dense layers have none)."""
    if not hasattr(cfg, "fp8"):
        raise ConfigError(f"{type(cfg).__name__} carries no fp8 fields, so Transformer Engine's dense layers cannot "
                          "tell whether to quantize: add Megatron's fp8 fields to it (fp8, fp8_recipe, fp8_margin, "
                          "fp8_amax_history_len, fp8_amax_compute_algo).")
    if cfg.fp8 is not None and cfg.fp8_recipe not in STATELESS_RECIPES:
        raise ConfigError("transformer_impl='transformer_engine' with fp8_recipe='delayed' is not built (TE keeps "
                          "its amax history in a Flax collection jmegatron's train step does not carry): use "
                          "fp8_recipe='tensorwise' or 'mxfp8', or transformer_impl='local' (pure-JAX delayed scaling).")
    from transformer_engine.jax.dense import dense
    from transformer_engine.jax.quantize import QuantizerFactory, noop_quantizer_set
    recipe = make_recipe(cfg) if cfg.fp8 is not None else None

    def quantizer_set():  # stateless recipes: empty metadata (TE's get_quantize_flax_meta for them)
        from transformer_engine.jax.quantize import QuantizeMeta, QuantizeMetaSet
        meta = QuantizeMetaSet(x=QuantizeMeta(), kernel=QuantizeMeta(), grad=QuantizeMeta())
        return QuantizerFactory.create_set(fp8_recipe=recipe, quantize_meta_set=meta)

    def dot_general(x, kernel, dims, precision=None, preferred_element_type=None):
        (contracting, batch) = dims
        if batch != ((), ()):
            raise ConfigError("Transformer Engine's dense GEMM takes no batch dimensions.")
        quantizers = noop_quantizer_set if recipe is None else quantizer_set()
        with shard_guard():
            return dense(x, kernel, contracting_dims=contracting, quantizer_set=quantizers)

    return dot_general


def te_fused_attention(q, k, v, *, dropout_rate: float = 0.0, dropout_rng=None, deterministic: bool = True,
                       dropout_impl: str = "hash", sample_offset=0):
    """Causal attention through TE's fused attention (``transformer_engine.jax.flax.
    DotProductAttention``, cuDNN's kernels; Megatron's TEDotProductAttention): q ``[b, s, nq,
    d]``, k/v ``[b, s, nkv, d]`` (layout ``bshd_bshd_bshd``, GQA by ``num_gqa_groups``) ->
    ``[b, s, nq, d]``. Attention dropout is TE's own (its masks are not jmegatron's hash, so
    runs are not bit-comparable with the XLA path). ``segment_ids`` (document masking) go to
    layout masks padding, not several documents per row: none are taken here (the core
    attention :func:`jmegatron.models.core_attention.te_attention` sends them to cuDNN's)."""
    from transformer_engine.jax.flax import DotProductAttention
    b, s, nq, d = q.shape
    rate = 0.0 if deterministic else dropout_rate
    module = DotProductAttention(head_dim=d, num_attention_heads=nq, num_gqa_groups=k.shape[2],
                                 attn_mask_type="causal", attention_dropout=rate,
                                 qkv_layout="bshd_bshd_bshd", transpose_batch_sequence=False)
    rngs = {"dropout": dropout_rng} if rate > 0.0 else {}
    with shard_guard():
        return module.apply({}, q, k, v, deterministic=rate == 0.0, rngs=rngs)


def shard_guard():
    """TE's global ``MeshResource`` for the mesh being traced under, unless one is set
    already (an enclosing :func:`autocast`): TE's custom partitioning asks for it. Built
    from :data:`jmegatron.parallel.rules.DEFAULT_RULES` over the abstract mesh's axis names
    (no mesh: an empty MeshResource, one device)."""
    from transformer_engine.jax.sharding import MeshResource, global_mesh_resource, global_shard_guard
    try:
        if global_mesh_resource() is not None:
            return contextlib.nullcontext()
    except AssertionError:  # TE asserts when none is set
        pass
    mesh = jax.sharding.get_abstract_mesh()
    names = () if mesh is None or mesh.empty else tuple(mesh.axis_names)
    kwargs = mesh_resource_kwargs(DEFAULT_RULES, names)
    fields = {f.name for f in dataclasses.fields(MeshResource)} if dataclasses.is_dataclass(MeshResource) else set(kwargs)
    return global_shard_guard(MeshResource(**{k: v for k, v in kwargs.items() if k in fields}))


@contextlib.contextmanager
def maybe_autocast(cfg, mesh, transformer_impl: str):
    """:func:`autocast` when ``transformer_impl`` resolved to "transformer_engine", else nothing."""
    if transformer_impl != "transformer_engine":
        yield
        return
    with autocast(cfg, mesh):
        yield
