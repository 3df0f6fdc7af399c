"""The decoder-only transformer: GPT (learned positions, LayerNorm, GELU, biases) and
Llama (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied output) from one module.

Follows megatron/core/models/gpt/gpt_model.py (GPTModel),
megatron/core/transformer/transformer_block.py, transformer_layer.py (pre-norm layer:
input_layernorm -> self_attention -> residual, pre_mlp_layernorm -> mlp -> residual)
and mlp.py (linear_fc1 -> activation -> linear_fc2). Parameter names follow
Megatron-Core's module names so the distillation YAML and the export mapping can
name them (see docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jmegatron.kernels.xla.dense import dense_dot_general_fn
from jmegatron.models.attention import SelfAttention
from jmegatron.models.dropout import Dropout
from jmegatron.models.layers import Embed, Linear, make_norm
from jmegatron.models.mlp import MLP
from jmegatron.models.moe.moe_layer import MOE_COLLECTIONS, MoELayer
from jmegatron.models.transformer_config import ModelConfig

Array = jax.Array
KVPair = tuple[Array, Array]  # one layer's (keys, values), each [b, max_length, num_query_groups, kv_channels]


class TransformerLayer(nn.Module):
    """Pre-norm transformer layer ``[b, s, h]`` -> ``[b, s, h]``
    (megatron/core/transformer/transformer_layer.py). Sows ``input_layernorm`` and
    ``pre_mlp_layernorm`` outputs (as ``<name>_output``) into the ``intermediates``
    collection when it is mutable."""

    cfg: ModelConfig
    deterministic: bool = True
    dot_general: Callable = dense_dot_general_fn
    # MoELayer instead of the MLP; None: when every layer of cfg is an MoE layer (stacked layers)
    moe_layer: Optional[bool] = None

    @nn.compact
    def __call__(self, x: Array, position_ids: Array, sample_offset: Array, kv_cache: Optional[KVPair] = None,
                 segment_ids: Optional[Array] = None) -> tuple[Array, Optional[KVPair]]:
        """``(x, None)``, or ``(x, updated kv_cache)`` when decoding with a cache (see
        :class:`SelfAttention`). ``sample_offset``: the global sample number of ``x[0]``
        (dropout masks, :mod:`jmegatron.models.dropout`); ``segment_ids`` int ``[b, s]``:
        document masking (attention within equal ids only), None: causal over the sequence."""
        c = self.cfg
        linear_dot = c.linear_dot_general(self.dot_general)  # FP8 for QKV, proj, fc1, fc2
        drop = Dropout(rate=c.hidden_dropout, deterministic=self.deterministic, impl=c.dropout_impl)
        h = make_norm(c.normalization, c.norm_epsilon, c.dtype, "input_layernorm")(x)
        self.sow("intermediates", "input_layernorm_output", h)
        attention = SelfAttention(
            num_attention_heads=c.num_attention_heads, num_query_groups=c.num_query_groups,
            kv_channels=c.kv_channels, hidden_size=c.hidden_size, use_bias=c.add_bias_linear,
            qkv_bias=c.add_qkv_bias, use_rope=c.position_embedding_type == "rope",
            rotary_base=c.rotary_base, attention_dropout=c.attention_dropout, dropout_impl=c.dropout_impl,
            init_std=c.init_method_std,
            output_init_std=c.init_method_std / math.sqrt(2.0 * c.num_layers),
            core_attention=c.attention_impl, cp_comm_type=c.cp_comm_type,
            recompute_core_attention=c.recompute_granularity == "selective",
            dtype=c.dtype, dot_general=linear_dot, name="self_attention",
        )
        if kv_cache is None:
            h = attention(h, position_ids, self.deterministic, sample_offset=sample_offset, segment_ids=segment_ids)
        else:
            h, kv_cache = attention(h, position_ids, self.deterministic, kv_cache)
        x = x + drop(h, sample_offset=sample_offset)
        x = nn.with_logical_constraint(x, ("batch", "activation_length", "activation_embed"))
        h = make_norm(c.normalization, c.norm_epsilon, c.dtype, "pre_mlp_layernorm")(x)
        self.sow("intermediates", "pre_mlp_layernorm_output", h)
        moe = self.moe_layer if self.moe_layer is not None else all(c.moe_layers())
        if moe:
            h = MoELayer(c, training=not self.deterministic, dot_general=self.dot_general, name="mlp")(h)
        else:
            h = MLP(c, dot_general=linear_dot, name="mlp")(h)
        x = x + drop(h, sample_offset=sample_offset)
        x = nn.with_logical_constraint(x, ("batch", "activation_length", "activation_embed"))
        return x, kv_cache


class GPTModel(nn.Module):
    """Decoder-only language model: int32 ``tokens [b, s]`` -> float32 ``logits [b, s, vocab]``.

    ``position_ids [b, s]`` default to ``0..s-1``. ``deterministic=False`` turns dropout
    on and needs a ``dropout`` RNG; ``sample_offset`` (int or integer scalar) is the global
    sample number of ``tokens[0]`` in the step's batch, so that a data-parallel rank's rows
    draw the masks they would draw in a single-device run (:mod:`jmegatron.models.dropout`).
    Parameters (all float32 master weights): ``word_embeddings/embedding`` ``[vocab, h]``,
    ``position_embeddings/embedding`` ``[max_pos, h]`` (learned_absolute only),
    ``decoder_layers_{i}/...`` (or one
    ``decoder_layers/...`` stacked ``[num_layers, ...]`` with ``scan_layers``),
    ``final_layernorm``, and ``output_layer/kernel [h, vocab]`` when untied (layout in
    jmegatron/export/hf.py).

    Decoding: with ``kv_cache`` (from :func:`init_kv_cache`) the call writes the tokens'
    keys/values into the cache at their positions (consecutive per row) and returns
    ``(logits, updated kv_cache)``; prefill and single-token decode steps are both this
    call (jmegatron/inference/generate.py drives it).

    Document masking (Megatron's ``reset_attention_mask``): ``segment_ids`` int32 ``[b, s]``
    (the number of EODs before each token, :func:`jmegatron.data.gpt_dataset.get_ltor_masks_and_position_ids`)
    restricts attention to keys of the query's own segment, so a packed sequence's documents
    give the logits each would give alone (with ``reset_position_ids`` position ids). Raises
    ValueError with ``kv_cache``.
    """

    cfg: ModelConfig
    dot_general: Callable = dense_dot_general_fn

    @nn.compact
    def __call__(self, tokens: Array, position_ids: Optional[Array] = None,
                 deterministic: bool = True, kv_cache: Any = None, sample_offset: Any = 0,
                 segment_ids: Optional[Array] = None):
        c = self.cfg
        if segment_ids is not None and kv_cache is not None:
            raise ValueError("GPTModel: segment_ids (document masking) is for training and evaluation; decoding "
                             "with a kv_cache takes none")
        sample_offset = jnp.asarray(sample_offset, jnp.uint32)
        dot_general = self.dot_general
        if dot_general is dense_dot_general_fn:
            dot_general = c.dense_dot_general()
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        embed_init = nn.initializers.normal(c.init_method_std)
        word = Embed(c.vocab_size, c.hidden_size, ("vocab", "embed"), dtype=c.dtype,
                     embedding_init=embed_init, name="word_embeddings")
        x = word(tokens)
        if c.position_embedding_type == "learned_absolute":
            x = x + Embed(c.max_position_embeddings, c.hidden_size, (None, "embed"), dtype=c.dtype,
                          embedding_init=embed_init, name="position_embeddings")(position_ids)
        x = Dropout(rate=c.hidden_dropout, deterministic=deterministic, impl=c.dropout_impl)(
            x, sample_offset=sample_offset)
        x = nn.with_logical_constraint(x, ("batch", "activation_length", "activation_embed"))

        layer_cls = TransformerLayer
        if c.recompute_granularity == "full":
            layer_cls = nn.remat(layer_cls, prevent_cse=not c.scan_layers,
                                 policy=jax.checkpoint_policies.nothing_saveable)
        if c.scan_layers:
            # With a cache, the stacked (k, v) [num_layers, ...] is scanned along with the
            # stacked params and comes back as the scan's per-layer outputs.
            cached = () if kv_cache is None else (kv_cache,)
            # segment ids follow an absent cache (None, broadcast): decoding takes none
            segments = () if segment_ids is None else (None, segment_ids)
            stack = nn.scan(layer_cls, variable_axes={"params": 0, "intermediates": 0, "moe_losses": 0,
                                                      "moe_stats": 0},
                            split_rngs={"params": True, "dropout": True},
                            in_axes=(nn.broadcast, nn.broadcast) + (0,) * len(cached)
                            + (nn.broadcast,) * len(segments), length=c.num_layers,
                            metadata_params={nn.PARTITION_NAME: "layers"})
            x, kv_cache = stack(c, deterministic, dot_general, name="decoder_layers")(
                x, position_ids, sample_offset, *cached, *segments)
        else:
            new_cache = []
            moe_layers = c.moe_layers()
            for i in range(c.num_layers):
                layer = layer_cls(c, deterministic, dot_general, bool(moe_layers[i]), name=f"decoder_layers_{i}")
                if kv_cache is None:
                    x, _ = layer(x, position_ids, sample_offset, None, segment_ids)
                else:
                    x, kv = layer(x, position_ids, sample_offset, kv_cache[i])
                    new_cache.append(kv)
            kv_cache = None if kv_cache is None else tuple(new_cache)
        x = make_norm(c.normalization, c.norm_epsilon, c.dtype, "final_layernorm")(x)
        self.sow("intermediates", "final_layernorm_output", x)
        if c.untie_embeddings_and_output_weights:
            logits = Linear((c.vocab_size,), ("embed", "vocab"), dtype=c.dtype, tp_mode="column", tp_dim=1,
                            dot_general=dot_general, kernel_init=embed_init,
                            name="output_layer")(x)
        else:
            logits = word.attend(x, dot_general)
        logits = nn.with_logical_constraint(logits, ("batch", "length", "activation_vocab"))
        logits = logits.astype(jnp.float32)
        return logits if kv_cache is None else (logits, kv_cache)


def init_kv_cache(cfg: ModelConfig, batch: int, max_length: int, dtype: Any = None) -> Any:
    """An empty (zero) KV cache for :class:`GPTModel` decoding, in ``dtype`` (default the
    compute dtype ``cfg.dtype``).

    Per layer, keys and values ``[batch, max_length, num_query_groups, kv_channels]``
    (grouped-query attention caches one head per group). Structure: a tuple of
    ``num_layers`` ``(k, v)`` pairs, or with ``scan_layers`` one ``(k, v)`` pair stacked
    ``[num_layers, batch, max_length, ...]`` (the layout of the scanned params).
    """
    dtype = dtype or cfg.dtype
    shape = (batch, max_length, cfg.num_query_groups, cfg.kv_channels)
    if cfg.scan_layers:
        stacked = jnp.zeros((cfg.num_layers,) + shape, dtype)
        return (stacked, stacked)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers))


# ------------------------------------------------------------------ pipeline stages
# Megatron builds a GPTModel per pipeline stage with ``pre_process`` (embedding) on the
# first and ``post_process`` (final norm, output layer) on the last
# (megatron/core/models/gpt/gpt_model.py). Here the parameters stay those of one
# ``scan_layers`` GPTModel (stacked ``decoder_layers`` in the stage order of
# jmegatron.parallel.pipeline_layout) and these functions apply its parts to them; the
# schedules in jmegatron.parallel.schedules call them per micro-batch.

def _embed_init(c: ModelConfig):
    return nn.initializers.normal(c.init_method_std)


def embed_tokens(c: ModelConfig, params: Any, tokens: Array, position_ids: Array, *, deterministic: bool,
                 rng: Any, sample_offset: Any) -> Array:
    """GPTModel's pre-process: word (+ learned position) embeddings and embedding dropout,
    ``[b, s]`` int32 -> ``[b, s, h]`` in the compute dtype. ``rng``: the dropout key."""
    word = Embed(c.vocab_size, c.hidden_size, ("vocab", "embed"), dtype=c.dtype, embedding_init=_embed_init(c))
    x = word.apply({"params": params["word_embeddings"]}, tokens)
    if c.position_embedding_type == "learned_absolute":
        pos = Embed(c.max_position_embeddings, c.hidden_size, (None, "embed"), dtype=c.dtype,
                    embedding_init=_embed_init(c))
        x = x + pos.apply({"params": params["position_embeddings"]}, position_ids)
    drop = Dropout(rate=c.hidden_dropout, deterministic=deterministic, impl=c.dropout_impl)
    x = drop.apply({}, x, sample_offset=jnp.asarray(sample_offset, jnp.uint32),
                   rngs=None if deterministic else {"dropout": rng})
    return nn.with_logical_constraint(x, ("batch", "activation_length", "activation_embed"))


def apply_layers(c: ModelConfig, layer_params: Any, x: Array, position_ids: Array, *, first_layer: Any,
                 deterministic: bool, rng: Any, sample_offset: Any, dot_general: Callable,
                 sow: tuple[str, ...] = (), num_valid: Any = None, moe_sown: bool = False,
                 segment_ids: Optional[Array] = None) -> Any:
    """The decoder layers whose parameters are stacked ``[n, ...]`` in ``layer_params``
    (a slice of ``decoder_layers``), in order, as one ``lax.scan``; layer ``k`` is model
    layer ``first_layer + k`` (its dropout key ``fold_in(rng, first_layer + k)``).
    ``num_valid`` (int, may be traced; None: all ``n``): only the first ``num_valid``
    slots are layers, the rest padding (uneven pipeline stages) that passes ``x`` through
    (``lax.cond``: not computed). ``recompute_granularity="full"`` recomputes each layer in
    the backward. Returns the output ``[b, s, h]``; with ``sow`` (names TransformerLayer
    sows, e.g. ``"input_layernorm_output"``) ``(output, {name: [n, b, s, h]})`` (zeros for
    padding slots). ``moe_sown``: the MoE layers' sown collections
    (:data:`jmegatron.models.moe.moe_layer.MOE_COLLECTIONS`) are mutable too and come back in
    that dict under their collection names, each leaf stacked ``[n, ...]`` (zeros for padding
    slots); :func:`jmegatron.models.moe.moe_layer.chunk_moe_losses` reads them.
    ``segment_ids`` int ``[b, s]`` (optional): document masking, as :class:`GPTModel`'s."""
    layer = TransformerLayer(c, deterministic, dot_general)
    offset = jnp.asarray(sample_offset, jnp.uint32)

    def body(h, xs):
        p, k = xs
        rngs = None if deterministic else {"dropout": jax.random.fold_in(rng, first_layer + k)}
        if not sow and not moe_sown:
            return layer.apply({"params": p}, h, position_ids, offset, None, segment_ids, rngs=rngs)[0], None
        mutable = (["intermediates"] if sow else []) + (list(MOE_COLLECTIONS) if moe_sown else [])
        (h, _), state = layer.apply({"params": p}, h, position_ids, offset, None, segment_ids, rngs=rngs,
                                    mutable=mutable)
        out = {name: state["intermediates"][name][0] for name in sow}
        out.update({name: state[name] for name in MOE_COLLECTIONS if moe_sown and name in state})
        return h, out

    if c.recompute_granularity == "full":
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    if num_valid is not None:
        layer_body = body

        def body(h, xs):
            def skip(h, xs):
                out = jax.eval_shape(layer_body, h, xs)[1]
                return h, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), out)

            return jax.lax.cond(xs[1] < num_valid, layer_body, skip, h, xs)
    n = jax.tree.leaves(layer_params)[0].shape[0]
    out, sown = jax.lax.scan(body, x, (layer_params, jnp.arange(n)))
    return (out, sown) if sow or moe_sown else out


def final_layernorm(c: ModelConfig, params: Any, x: Array) -> Array:
    """GPTModel's final norm, ``[b, s, h]`` -> ``[b, s, h]``."""
    return make_norm(c.normalization, c.norm_epsilon, c.dtype, "final_layernorm").apply(
        {"params": params["final_layernorm"]}, x)


def output_logits(c: ModelConfig, params: Any, x: Array, dot_general: Callable, normed: bool = False) -> Array:
    """GPTModel's post-process: final norm (unless ``normed``) and output layer (tied: the
    word embeddings' ``attend``), ``[b, s, h]`` -> float32 ``[b, s, vocab]``."""
    if not normed:
        x = final_layernorm(c, params, x)
    if c.untie_embeddings_and_output_weights:
        logits = Linear((c.vocab_size,), ("embed", "vocab"), dtype=c.dtype, tp_mode="column", tp_dim=1,
                        dot_general=dot_general).apply({"params": params["output_layer"]}, x)
    else:
        word = Embed(c.vocab_size, c.hidden_size, ("vocab", "embed"), dtype=c.dtype)
        logits = word.apply({"params": params["word_embeddings"]}, x, dot_general, method=Embed.attend)
    logits = nn.with_logical_constraint(logits, ("batch", "length", "activation_vocab"))
    return logits.astype(jnp.float32)
