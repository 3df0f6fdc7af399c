"""The decoder-only transformer: GPT (learned positions, LayerNorm, GELU, biases) and
Llama (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied output) from one module.

Follows megatron/core/models/gpt/gpt_model.py (GPTModel),
megatron/core/transformer/transformer_block.py, with its layers from
:mod:`jmegatron.models.transformer_layer`. Parameter names follow
Megatron-Core's module names so the distillation YAML and the export mapping can
name them (see docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import flax.linen as nn
from flax.core import lift as flax_lift
from flax.core.scope import LazyRng
import jax
import jax.numpy as jnp

from jmegatron.kernels.xla.dense import dense_dot_general_fn
from jmegatron.kernels.xla.dropout import dropout
from jmegatron.models.layers import Embed, Linear, make_norm
from jmegatron.models.moe.moe_layer import MOE_COLLECTIONS
from jmegatron.models.multi_token_prediction import MTP_COLLECTION, MultiTokenPredictionLayer, roll_left
from jmegatron.models.transformer_config import ModelConfig
from jmegatron.models.transformer_layer import TransformerLayer
from jmegatron.parallel.schedules import as_varying

Array = jax.Array


# ------------------------------------------------------------------ per-layer keys
# Every layout (per-layer ``decoder_layers_{i}``, the stacked ``nn.scan`` of ``decoder_layers``,
# and the pipeline stages' slices of it) gives decoder layer ``i`` (its global layer number)
# the same two keys, so a fresh run starts from the same weights and draws the same dropout
# masks in every layout:
#   params:  fold_in(make_rng("params") at GPTModel's scope, i)   (init only)
#   dropout: fold_in(the "dropout" key given to apply, i);  the embedding dropout: fold_in(., num_layers)
# Inside the layer, Flax derives its submodules' keys from these by their relative paths
# (self_attention, mlp, ...), as it does for a layer applied on its own
# (``TransformerLayer.apply(..., rngs={"dropout": key})``), which is what the pipeline does.

def layer_dropout_rng(rng: Any, layer_number: Any) -> Any:
    """The dropout key of decoder layer ``layer_number`` (int, may be traced) under the
    step's dropout key ``rng``: ``fold_in(rng, layer_number)``."""
    return jax.random.fold_in(rng, layer_number)


def embedding_dropout_rng(rng: Any, num_layers: int) -> Any:
    """The embedding dropout's key under the step's dropout key ``rng``:
    ``fold_in(rng, num_layers)`` (the layer numbers are ``0 .. num_layers - 1``)."""
    return jax.random.fold_in(rng, num_layers)


def _install_rngs(fn: Callable) -> Callable:
    """Flax core lift: ``fn(scope, x, *args)`` called as ``(scope, x, rngs, valid, *args)``
    with the scope's RNG streams named in ``rngs`` (a dict name -> key) replaced by those
    keys (streams it does not name are kept) and its RNG counters fresh, so the layer draws
    what ``TransformerLayer.apply(..., rngs=rngs)`` draws. ``valid`` (traced bool, or None:
    always): False skips the layer (``lax.cond``: not computed), ``x`` passes through and
    its sown values are zeros (a pipeline chunk's padding slot)."""

    def inner(scope_fn, repack_fn, variable_groups, rng_groups, x, rngs, valid, *args, **kwargs):
        if rngs:
            rng_groups = tuple(tuple({n: (LazyRng.create(rngs[n]) if n in rngs else r) for n, r in d.items()}
                                     for d in group) for group in rng_groups)

        def run(variable_groups, x):
            scope = scope_fn(variable_groups, rng_groups)
            if rngs:  # fresh counters, as a layer applied on its own: a re-traced body (nn.scan) draws the same keys
                for s in jax.tree_util.tree_leaves(scope):
                    s.rng_counters = {n: 0 for n in s.rngs}
            y = fn(scope, x, *args, **kwargs)
            return y, repack_fn(scope)

        if valid is None:
            return run(variable_groups, x)

        def skip(variable_groups, x):
            (y, new_vars) = jax.eval_shape(run, variable_groups, x)

            def like(spec, a=None):  # ``a`` (default zeros) typed as the layer's output ``spec``
                a = jnp.zeros(spec.shape, spec.dtype) if a is None else a
                # inside a shard_map: varying over the manual axes the layer's output varies over
                return as_varying(a, frozenset(getattr(spec.manual_axis_type, "varying", None) or ()))

            def keep(out, given):  # collections given unchanged (the parameters) pass through
                if isinstance(out, (tuple, list)):
                    return type(out)(keep(o, g) for o, g in zip(out, given))

                def same(a, b):
                    return [x.shape for x in jax.tree.leaves(a)] == [x.shape for x in jax.tree.leaves(b)]
                return {col: (jax.tree.map(like, tree, jax.tree.unflatten(jax.tree.structure(tree),
                                                                          jax.tree.leaves(given[col])))
                              if col in given and same(given[col], tree) else jax.tree.map(like, tree))
                        for col, tree in out.items()}

            return (like(y[0], x), jax.tree.map(like, y[1])), keep(new_vars, variable_groups)

        return jax.lax.cond(valid, run, skip, variable_groups, x)

    return flax_lift.pack(inner, (True,), (True,), (True,), name="layer_rngs", enable_kwargs=True)


def keyed_layer(layer_cls: Any) -> Any:
    """``layer_cls`` (a :class:`TransformerLayer` class, possibly remat-wrapped) called as
    ``layer(x, rngs, valid, *args)``: ``rngs`` (dict stream name -> key, e.g. ``{"params": k,
    "dropout": k}``) replaces those RNG streams of the layer's scope; ``valid`` False (a
    traced bool; None: always run) skips the layer, ``x`` passing through."""
    return nn.transforms.lift_transform(_install_rngs, layer_cls)


class GPTModel(nn.Module):
    """Decoder-only language model: int32 ``tokens [b, s]`` -> float32 ``logits [b, s, vocab]``.

    Megatron-Core's GPTModel (megatron/core/models/gpt/gpt_model.py) in three pieces that
    both the unpipelined forward (``__call__``) and the pipeline stages (:func:`embed_tokens`,
    :func:`apply_layers`, :func:`output_logits`) use: :meth:`embed` (``pre_process``: word
    + learned position embeddings, embedding dropout), :meth:`decoder` (the decoder layers,
    Megatron's TransformerBlock) and :meth:`head` (``post_process``: final norm, output
    layer).

    ``position_ids [b, s]`` default to ``0..s-1``. ``deterministic=False`` turns dropout
    on and needs a ``dropout`` RNG; ``sample_offset`` (int or integer scalar) is the global
    sample number of ``tokens[0]`` in the step's batch, so that a data-parallel rank's rows
    draw the masks they would draw in a single-device run (:mod:`jmegatron.models.dropout`).
    Parameters (all float32 master weights): ``word_embeddings/embedding`` ``[vocab, h]``,
    ``position_embeddings/embedding`` ``[max_pos, h]`` (learned_absolute only),
    ``decoder_layers_{i}/...`` (or one
    ``decoder_layers/...`` stacked ``[num_layers, ...]`` with ``scan_layers``),
    ``final_layernorm``, and ``output_layer/kernel [h, vocab]`` when untied (layout in
    jmegatron/export/hf.py); with ``mtp_num_layers`` D, ``mtp_layers_{0..D-1}/...``
    (:class:`jmegatron.models.multi_token_prediction.MultiTokenPredictionLayer`), run only
    when the ``mtp`` collection is mutable (:meth:`multi_token_prediction`).

    Keys: decoder layer ``i`` is initialised from ``fold_in(make_rng("params"), i)`` and
    draws its dropout masks from :func:`layer_dropout_rng` ``(rng, i)`` (``rng``: the
    ``dropout`` key given to ``apply``), the embedding dropout from
    :func:`embedding_dropout_rng`, whether the layers are stored per layer, stacked
    (``scan_layers``) or sliced over pipeline stages: a fresh run starts from the same
    weights and draws the same masks in every layout.

    Decoding: with ``kv_cache`` (from :func:`init_kv_cache`) the call writes the tokens'
    keys/values into the cache at their positions (consecutive per row) and returns
    ``(logits, updated kv_cache)``; prefill and single-token decode steps are both this
    call (jmegatron/inference/generate.py drives it).

    Document masking (Megatron's ``reset_attention_mask``): ``segment_ids`` int32 ``[b, s]``
    (the number of EODs before each token, :func:`jmegatron.data.gpt_dataset.get_ltor_masks_and_position_ids`)
    restricts attention to keys of the query's own segment, so a packed sequence's documents
    give the logits each would give alone (with ``reset_position_ids`` position ids). Raises
    ValueError with ``kv_cache``.

    Context parallelism: ``positions`` int32 ``[b, s]``, each slot's index in the original
    sequence (the batch's ``positions``, Megatron's ``get_batch_on_this_cp_rank``
    load-balanced order), is the attention's causal order; needed when the ``context``
    mesh axis is manual (ValueError otherwise), else not read.
    """

    cfg: ModelConfig
    dot_general: Callable = dense_dot_general_fn

    def setup(self):
        c = self.cfg
        embed_init = nn.initializers.normal(c.init_method_std)
        self.word_embeddings = Embed(c.vocab_size, c.hidden_size, ("vocab", "embed"), dtype=c.dtype,
                                     embedding_init=embed_init, name="word_embeddings")
        if c.position_embedding_type == "learned_absolute":
            self.position_embeddings = Embed(c.max_position_embeddings, c.hidden_size, (None, "embed"),
                                             dtype=c.dtype, embedding_init=embed_init, name="position_embeddings")
        self.final_layernorm = make_norm(c.normalization, c.norm_epsilon, c.dtype, "final_layernorm",
                                         c.apply_layernorm_1p)
        if c.untie_embeddings_and_output_weights:
            self.output_layer = Linear((c.vocab_size,), ("embed", "vocab"), dtype=c.dtype, tp_mode="column",
                                       tp_dim=1, dot_general=self.resolved_dot_general(), kernel_init=embed_init,
                                       name="output_layer")
        if c.mtp_num_layers:
            moe_last = bool(c.moe_layers()[-1])
            self.mtp_layers = [MultiTokenPredictionLayer(c, self.resolved_dot_general(), moe_last, name=f"mtp_layers_{k}")
                               for k in range(c.mtp_num_layers)]

    def resolved_dot_general(self) -> Callable:
        """The dense layers' ``dot_general``: the module's own, else ``cfg.dense_dot_general()``."""
        return self.cfg.dense_dot_general() if self.dot_general is dense_dot_general_fn else self.dot_general

    def embed(self, tokens: Array, position_ids: Array, deterministic: bool = True,
              dropout_rng: Any = None, sample_offset: Any = 0, positions: Optional[Array] = None) -> Array:
        """Megatron's ``pre_process``: word (+ learned position) embeddings and the
        embedding dropout, int32 ``tokens`` / ``position_ids`` ``[b, s]`` -> ``[b, s, h]``
        in the compute dtype; ``scale_embeddings`` multiplies the word embeddings by
        ``sqrt(hidden_size)`` in the compute dtype (Gemma's normalizer), then
        ``embedding_multiplier`` multiplies them (Granite's). ``dropout_rng``: the dropout's key
        (:func:`embedding_dropout_rng`), needed unless ``deterministic`` or
        ``hidden_dropout`` is 0. ``positions`` (int ``[b, s]``, optional): each slot's
        sequence position, from which the dropout masks are drawn
        (:class:`jmegatron.models.dropout.Dropout`); None: ``0..s-1``."""
        c = self.cfg
        x = self.word_embeddings(tokens)
        if c.scale_embeddings:  # sqrt(h) rounded to the compute dtype first, as Gemma
            x = x * jnp.asarray(math.sqrt(c.hidden_size), c.dtype)
        if c.embedding_multiplier != 1.0:  # Granite: a float in the compute dtype
            x = x * jnp.asarray(c.embedding_multiplier, c.dtype)
        if c.position_embedding_type == "learned_absolute":
            x = x + self.position_embeddings(position_ids)
        if not deterministic and c.hidden_dropout > 0.0:
            if dropout_rng is None:
                raise ValueError("GPTModel.embed: deterministic=False with hidden_dropout > 0 needs dropout_rng")
            x = dropout(x, c.hidden_dropout, dropout_rng, c.dropout_impl, jnp.asarray(sample_offset, jnp.uint32),
                        positions)
        return nn.with_logical_constraint(x, ("batch", "activation_length", "activation_embed"))

    def _stream_key(self, name: str) -> Any:
        # the key of RNG stream ``name`` as given to init / apply (no counter consumed)
        return self.scope.rngs[name].as_jax_rng() if self.has_rng(name) else None

    def _layer_rngs(self, deterministic: bool) -> Callable[[Any], dict]:
        """``layers -> {stream: key}``: the init and dropout keys of the decoder layers
        numbered ``layers`` (an int: keys; an int array ``[n]``: keys ``[n]``). The bases
        are drawn once per call, so every layer's keys depend only on its number."""
        bases = {}
        if self.is_initializing() and self.has_rng("params"):
            bases["params"] = self.make_rng("params")
        if not deterministic and self.has_rng("dropout"):
            bases["dropout"] = self._stream_key("dropout")  # layer i: layer_dropout_rng(base, i)

        def keys(layers):
            fold = jax.random.fold_in if isinstance(layers, int) else jax.vmap(jax.random.fold_in, in_axes=(None, 0))
            return {name: fold(base, layers) for name, base in bases.items()}

        return keys

    @nn.compact
    def decoder(self, x: Array, position_ids: Array, deterministic: bool = True, sample_offset: Any = 0,
                kv_cache: Any = None, segment_ids: Optional[Array] = None, layers: Optional[Array] = None,
                valid: Optional[Array] = None, positions: Optional[Array] = None) -> tuple[Array, Any]:
        """The decoder layers (Megatron's TransformerBlock without its final norm), ``[b, s, h]``
        -> ``([b, s, h], kv_cache)``: ``decoder_layers_{i}`` in a Python loop, or with
        ``scan_layers`` one ``nn.scan`` over the stacked ``decoder_layers``; layer ``i``'s
        init and dropout keys as the class docstring says. ``kv_cache``: as ``__call__``'s
        (None: returned None). ``layers`` (int ``[n]``, may be traced; None: all, in order):
        the model layer numbers of the stacked ``decoder_layers`` given, scanned whatever
        ``scan_layers`` says (a pipeline chunk's slice, :func:`apply_layers`); ``valid`` (bool
        ``[n]``; None: all): False marks padding slots, skipped. ``positions`` (int ``[b, s]``):
        each slot's original sequence position, as ``__call__``'s."""
        c = self.cfg
        sample_offset = jnp.asarray(sample_offset, jnp.uint32)
        dot_general = self.resolved_dot_general()
        scan = c.scan_layers or layers is not None
        layer_cls = TransformerLayer
        if c.recompute_granularity == "full":
            layer_cls = nn.remat(layer_cls, prevent_cse=not scan, policy=jax.checkpoint_policies.nothing_saveable)
        layer_cls = keyed_layer(layer_cls)
        if scan:
            # With a cache, the stacked (k, v) [num_layers, ...] is scanned along with the
            # stacked params and comes back as the scan's per-layer outputs.
            # (an absent cache, validity or segment ids: None, broadcast); the layer numbers are scanned
            numbers = jnp.arange(c.num_layers) if layers is None else layers
            stack = nn.scan(layer_cls, variable_axes={"params": 0, "intermediates": 0, "moe_losses": 0,
                                                      "moe_stats": 0},
                            split_rngs={"params": False, "dropout": False},  # keyed per layer instead
                            in_axes=(0, nn.broadcast if valid is None else 0, nn.broadcast, nn.broadcast,
                                     nn.broadcast if kv_cache is None else 0, nn.broadcast, 0, nn.broadcast),
                            length=numbers.shape[0], metadata_params={nn.PARTITION_NAME: "layers"})
            rngs = self._layer_rngs(deterministic)(numbers)
            return stack(c, deterministic, dot_general, name="decoder_layers")(
                x, rngs, valid, position_ids, sample_offset, kv_cache, segment_ids, numbers, positions)
        new_cache = []
        moe_layers = c.moe_layers()
        layer_rngs = self._layer_rngs(deterministic)
        for i in range(c.num_layers):
            layer = layer_cls(c, deterministic, dot_general, bool(moe_layers[i]), name=f"decoder_layers_{i}")
            rngs = layer_rngs(i)
            if kv_cache is None:
                x, _ = layer(x, rngs, None, position_ids, sample_offset, None, segment_ids, i, positions)
            else:
                x, kv = layer(x, rngs, None, position_ids, sample_offset, kv_cache[i], None, i)
                new_cache.append(kv)
        return x, None if kv_cache is None else tuple(new_cache)

    def head(self, x: Array, normed: bool = False) -> Array:
        """Megatron's ``post_process``: the final norm (unless ``normed``; its output sown as
        ``final_layernorm_output`` into ``intermediates`` when that is mutable) and the output
        layer (tied: the word embeddings' ``attend``), ``[b, s, h]`` -> float32 ``[b, s, vocab]``,
        divided by ``logits_scaling`` (Granite's, in float32), then capped at
        ``c * tanh(logits / c)`` with ``final_logit_softcapping`` c (Gemma-2/3). The multi-token
        prediction depths and the pipeline's last stage take their logits from here too."""
        if not normed:
            x = self.final_layernorm(x)
            self.sow("intermediates", "final_layernorm_output", x)
        if self.cfg.untie_embeddings_and_output_weights:
            logits = self.output_layer(x)
        else:
            logits = self.word_embeddings.attend(x, self.resolved_dot_general())
        logits = nn.with_logical_constraint(logits, ("batch", "length", "activation_vocab"))
        logits = logits.astype(jnp.float32)
        if self.cfg.logits_scaling != 1.0:  # Granite: divided in float32, before any soft-cap
            logits = logits / jnp.float32(self.cfg.logits_scaling)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def __call__(self, tokens: Array, position_ids: Optional[Array] = None,
                 deterministic: bool = True, kv_cache: Any = None, sample_offset: Any = 0,
                 segment_ids: Optional[Array] = None, positions: Optional[Array] = None):
        c = self.cfg
        if segment_ids is not None and kv_cache is not None:
            raise ValueError("GPTModel: segment_ids (document masking) is for training and evaluation; decoding "
                             "with a kv_cache takes none")
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        base = None if deterministic else self._stream_key("dropout")
        x = self.embed(tokens, position_ids, deterministic,
                       None if base is None else embedding_dropout_rng(base, c.num_layers), sample_offset, positions)
        x, kv_cache = self.decoder(x, position_ids, deterministic, sample_offset, kv_cache, segment_ids,
                                   positions=positions)
        if kv_cache is not None:
            return self.head(x), kv_cache
        return self.post_process(x, tokens, position_ids, deterministic, sample_offset, segment_ids, positions)

    def post_process(self, x: Array, tokens: Array, position_ids: Array, deterministic: bool = True,
                     sample_offset: Any = 0, segment_ids: Optional[Array] = None,
                     positions: Optional[Array] = None) -> Array:
        """Megatron's ``post_process`` of a training or evaluation forward: the decoder's
        output ``x [b, s, h]`` -> float32 logits ``[b, s, vocab]`` (:meth:`head`); with
        ``mtp_num_layers`` and the :data:`MTP_COLLECTION` collection mutable, the
        multi-token prediction depths run on the normed ``x`` first
        (:meth:`multi_token_prediction`, their dropout from the ``dropout`` key given to
        ``apply``). ``tokens`` / ``position_ids`` / ``positions`` ``[b, s]``: the
        micro-batch's (the depths embed the tokens rolled)."""
        if not (self.cfg.mtp_num_layers and self.is_mutable_collection(MTP_COLLECTION)):
            return self.head(x)
        x = self.final_layernorm(x)
        self.sow("intermediates", "final_layernorm_output", x)
        base = None if deterministic else self._stream_key("dropout")
        self.multi_token_prediction(x, tokens, position_ids, deterministic, base, sample_offset, segment_ids,
                                    positions)
        return self.head(x, normed=True)

    def multi_token_prediction(self, hidden: Array, tokens: Array, position_ids: Array, deterministic: bool,
                               dropout_base: Any, sample_offset: Any, segment_ids: Optional[Array],
                               positions: Optional[Array] = None) -> None:
        """Megatron's ``MultiTokenPredictionBlock``: depth ``k`` embeds the tokens rolled
        ``k`` places left (zero-filled; learned positions rolled alike, RoPE keeps the
        unrolled positions, as megatron-core's), runs ``mtp_layers_{k-1}`` on them and the
        previous depth's output (depth 1: ``hidden``, the decoder's output after the final
        norm, ``[b, s, h]``) and sows its logits (:meth:`head`, float32 ``[b, s, vocab]``) as
        ``logits`` into the :data:`MTP_COLLECTION` collection. Depth ``k``'s embedding
        dropout draws from :func:`embedding_dropout_rng` ``(dropout_base, num_layers + k)``."""
        c = self.cfg
        for k, layer in enumerate(self.mtp_layers, 1):
            tokens = roll_left(tokens)
            rng = None if dropout_base is None else embedding_dropout_rng(dropout_base, c.num_layers + k)
            embedded = self.embed(tokens, roll_left(position_ids, k), deterministic, rng, sample_offset, positions)
            hidden = layer(hidden, embedded, position_ids, deterministic, sample_offset, segment_ids, positions)
            self.sow(MTP_COLLECTION, "logits", self.head(hidden, normed=True))


def init_kv_cache(cfg: ModelConfig, batch: int, max_length: int, dtype: Any = None) -> Any:
    """An empty (zero) KV cache for :class:`GPTModel` decoding, in ``dtype`` (default the
    compute dtype ``cfg.dtype``).

    Per layer, keys and values ``[batch, max_length, num_query_groups, kv_channels]``
    (grouped-query attention caches one head per group); with multi-latent attention keys
    ``[batch, max_length, heads, qk_head_dim + qk_pos_emb_head_dim]`` and values
    ``[..., v_head_dim]``. Structure: a tuple of
    ``num_layers`` ``(k, v)`` pairs, or with ``scan_layers`` one ``(k, v)`` pair stacked
    ``[num_layers, batch, max_length, ...]`` (the layout of the scanned params).
    """
    dtype = dtype or cfg.dtype
    k_shape = v_shape = (batch, max_length, cfg.num_query_groups, cfg.kv_channels)
    if cfg.multi_latent_attention:  # full keys and values per head (Megatron's static context)
        k_shape = (batch, max_length, cfg.num_attention_heads, cfg.qk_head_dim + cfg.qk_pos_emb_head_dim)
        v_shape = (batch, max_length, cfg.num_attention_heads, cfg.v_head_dim)
    if cfg.scan_layers:
        return (jnp.zeros((cfg.num_layers,) + k_shape, dtype), jnp.zeros((cfg.num_layers,) + v_shape, dtype))
    return tuple((jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype)) for _ in range(cfg.num_layers))


# ------------------------------------------------------------------ pipeline stages
# Megatron builds a GPTModel per pipeline stage with ``pre_process`` (embedding) on the
# first and ``post_process`` (final norm, output layer) on the last
# (megatron/core/models/gpt/gpt_model.py). Here the parameters stay those of one
# ``scan_layers`` GPTModel (stacked ``decoder_layers`` in the stage order of
# jmegatron.parallel.pipeline_layout) and these functions apply its pieces to them:
# GPTModel.embed / head themselves, and the decoder layers as GPTModel.decoder runs them
# (the same TransformerLayer and per-layer keys) over a stage's slice of the stack. The
# schedules in jmegatron.parallel.schedules call them per micro-batch.

def embed_tokens(c: ModelConfig, params: Any, tokens: Array, position_ids: Array, *, deterministic: bool,
                 rng: Any, sample_offset: Any, positions: Optional[Array] = None) -> Array:
    """:meth:`GPTModel.embed` on ``params`` (a GPTModel's; only the embeddings are read):
    ``[b, s]`` int32 -> ``[b, s, h]`` in the compute dtype. ``rng``: the embedding dropout's
    key, :func:`embedding_dropout_rng` of the step's dropout key for the model's masks;
    ``positions``: as :meth:`GPTModel.embed`'s."""
    return GPTModel(c).apply({"params": params}, tokens, position_ids, deterministic, rng, sample_offset,
                             positions, method=GPTModel.embed)


def apply_layers(c: ModelConfig, layer_params: Any, x: Array, position_ids: Array, *, first_layer: Any,
                 deterministic: bool, rng: Any, sample_offset: Any, dot_general: Callable,
                 sow: tuple[str, ...] = (), num_valid: Any = None, moe_sown: bool = False,
                 segment_ids: Optional[Array] = None, positions: Optional[Array] = None) -> Any:
    """The decoder layers whose parameters are stacked ``[n, ...]`` in ``layer_params``
    (a slice of ``decoder_layers``), in order, as :meth:`GPTModel.decoder`'s scan; layer ``k`` is model
    layer ``first_layer + k`` and draws :meth:`GPTModel.decoder`'s masks for it (dropout
    key :func:`layer_dropout_rng` ``(rng, first_layer + k)``, ``rng`` the step's dropout key).
    ``num_valid`` (int, may be traced; None: all ``n``): only the first ``num_valid``
    slots are layers, the rest padding (uneven pipeline stages) that passes ``x`` through
    (``lax.cond``: not computed, :func:`keyed_layer`). ``recompute_granularity="full"`` recomputes each layer in
    the backward. Returns the output ``[b, s, h]``; with ``sow`` (names TransformerLayer
    sows, e.g. ``"input_layernorm_output"``) ``(output, {name: [n, b, s, h]})`` (zeros for
    padding slots). ``moe_sown``: the MoE layers' sown collections
    (:data:`jmegatron.models.moe.moe_layer.MOE_COLLECTIONS`) are mutable too and come back in
    that dict under their collection names, each leaf stacked ``[n, ...]`` (zeros for padding
    slots); :func:`jmegatron.models.moe.moe_layer.chunk_moe_losses` reads them.
    ``segment_ids`` / ``positions`` int ``[b, s]`` (optional): document masking and the
    slots' sequence positions, as :class:`GPTModel`'s."""
    n = jax.tree.leaves(layer_params)[0].shape[0]
    valid = None if num_valid is None else jnp.arange(n) < num_valid
    mutable = (["intermediates"] if sow else []) + (list(MOE_COLLECTIONS) if moe_sown else [])
    out = GPTModel(c, dot_general).apply(
        {"params": {"decoder_layers": layer_params}}, x, position_ids, deterministic, sample_offset, None, segment_ids,
        first_layer + jnp.arange(n), valid, positions, rngs=None if deterministic else {"dropout": rng},
        mutable=mutable or False, method=GPTModel.decoder)
    if not mutable:
        return out[0]
    (y, _), state = out
    sown = {name: state["intermediates"]["decoder_layers"][name][0] for name in sow}
    sown.update({name: state[name]["decoder_layers"] for name in MOE_COLLECTIONS if moe_sown and name in state})
    return y, sown


def final_layernorm(c: ModelConfig, params: Any, x: Array) -> Array:
    """GPTModel's final norm on ``params`` (a GPTModel's), ``[b, s, h]`` -> ``[b, s, h]``."""
    return GPTModel(c).apply({"params": params}, x, method=lambda m, x: m.final_layernorm(x))


def post_process_logits(c: ModelConfig, params: Any, x: Array, micro: dict, *, rng: Any, sample_offset: Any,
                        dot_general: Callable) -> tuple[Array, dict]:
    """:meth:`GPTModel.post_process` on ``params`` (a GPTModel's) in training (dropout on,
    ``rng`` the step's dropout key): the decoder's output ``x [b, s, h]`` and the
    micro-batch's ``tokens`` / ``position_ids`` / ``segment_ids`` / ``positions`` (``micro``) -> (float32
    logits ``[b, s, vocab]``, the sown :data:`MTP_COLLECTION` (``{}`` without
    ``mtp_num_layers``)). A pipeline's last stage runs it: the multi-token prediction
    depths sit there, as in Megatron's last-stage ``MultiTokenPredictionBlock``."""
    model = GPTModel(c, dot_general)
    args = (x, micro["tokens"], micro["position_ids"], False, sample_offset, micro.get("segment_ids"),
            micro.get("positions"))
    rngs = {"dropout": rng}
    if not c.mtp_num_layers:
        return model.apply({"params": params}, *args, rngs=rngs, method=GPTModel.post_process), {}
    return model.apply({"params": params}, *args, rngs=rngs, mutable=[MTP_COLLECTION], method=GPTModel.post_process)


def output_logits(c: ModelConfig, params: Any, x: Array, dot_general: Callable, normed: bool = False) -> Array:
    """:meth:`GPTModel.head` on ``params`` (a GPTModel's): final norm (unless ``normed``)
    and output layer (tied: the word embeddings' ``attend``), ``[b, s, h]`` -> float32
    ``[b, s, vocab]``."""
    return GPTModel(c, dot_general).apply({"params": params}, x, normed, method=GPTModel.head)
