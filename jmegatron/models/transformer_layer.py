"""Megatron-Core's pre-norm transformer layer (megatron/core/transformer/transformer_layer.py):
input_layernorm -> self_attention -> residual, pre_mlp_layernorm -> mlp (or the MoE layer)
-> residual; the decoder's layers (:mod:`jmegatron.models.gpt`) and the multi-token
prediction layers (:mod:`jmegatron.models.multi_token_prediction`) are this module.
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
from jmegatron.models.layers import make_norm
from jmegatron.models.mlp import MLP
from jmegatron.models.multi_latent_attention import MLASelfAttention
from jmegatron.models.moe.moe_layer import MoELayer
from jmegatron.models.transformer_config import ModelConfig

Array = jax.Array
KVPair = tuple[Array, Array]  # one layer's (keys, values), each [b, max_length, num_query_groups, kv_channels]


class TransformerLayer(nn.Module):
    """Pre-norm transformer layer ``[b, s, h]`` -> ``[b, s, h]``
    (megatron/core/transformer/transformer_layer.py; post-norms only with ``pre_norms=False``). Sows ``input_layernorm`` and
    ``pre_mlp_layernorm`` outputs (as ``<name>_output``) into the ``intermediates``
    collection when it is mutable."""

    cfg: ModelConfig
    deterministic: bool = True
    dot_general: Callable = dense_dot_general_fn
    # MoELayer instead of the MLP; None: when every layer of cfg is an MoE layer (stacked layers)
    moe_layer: Optional[bool] = None

    @nn.compact
    def __call__(self, x: Array, position_ids: Array, sample_offset: Array, kv_cache: Optional[KVPair] = None,
                 segment_ids: Optional[Array] = None, layer_number: Any = None,
                 positions: Optional[Array] = None) -> tuple[Array, Optional[KVPair]]:
        """``(x, None)``, or ``(x, updated kv_cache)`` when decoding with a cache (see
        :class:`SelfAttention`). ``sample_offset``: the global sample number of ``x[0]``
        (dropout masks, :mod:`jmegatron.models.dropout`); ``segment_ids`` int ``[b, s]``:
        document masking (attention within equal ids only), None: causal over the sequence.
        ``layer_number``: this layer's 0-based number in the model (an int, or a traced int
        scalar in a scan over layers), read only when the layers differ in their attention
        (``window_attn_skip_freq``, ``no_rope_freq``); ValueError if it is needed and None. ``positions`` int
        ``[b, s]``: each slot's original sequence position, the causal order under context
        parallelism (:class:`SelfAttention`) and the dropout masks' sequence index
        (:class:`jmegatron.models.dropout.Dropout`); None: ``0..s-1``.

        With ``sandwich_norms``, ``post_self_attn_layernorm`` and ``post_mlp_layernorm``
        normalise the attention's and the MLP's outputs before dropout and the residual add
        (Gemma-2/3). Without ``pre_norms`` the attention and the MLP take the residual
        stream itself (no ``input_layernorm`` / ``pre_mlp_layernorm``; the sown
        ``<name>_output`` is then that input), and the post-norms are the layer's only norms
        (OLMo-2/3: ``x + post_norm(attn(x))``).
        ``residual_multiplier`` m multiplies each sublayer's output (after its
        post-norm) before the residual add, ``x + m * h`` in the compute dtype (Granite's
        decoder layer). ``no_rope_freq``: the NoPE layers (:meth:`ModelConfig.no_rope_layers`)
        rotate no queries or keys; ``layer_number`` is read for them as for the windows."""
        c = self.cfg
        linear_dot = c.linear_dot_general(self.dot_general)  # FP8 for QKV, proj, fc1, fc2
        drop = Dropout(rate=c.hidden_dropout, deterministic=self.deterministic, impl=c.dropout_impl)

        def norm(name):
            return make_norm(c.normalization, c.norm_epsilon, c.dtype, name, c.apply_layernorm_1p)

        h = norm("input_layernorm")(x) if c.pre_norms else x
        self.sow("intermediates", "input_layernorm_output", h)
        attention = MLASelfAttention(
            num_attention_heads=c.num_attention_heads, hidden_size=c.hidden_size, q_lora_rank=c.q_lora_rank,
            kv_lora_rank=c.kv_lora_rank, qk_head_dim=c.qk_head_dim, qk_pos_emb_head_dim=c.qk_pos_emb_head_dim,
            v_head_dim=c.v_head_dim, rope=c.rotary_embedding(), attention_dropout=c.attention_dropout,
            init_std=c.init_method_std, output_init_std=c.init_method_std / math.sqrt(2.0 * c.num_layers),
            use_bias=c.add_bias_linear, qk_layernorm=c.qk_layernorm, normalization=c.normalization,
            norm_epsilon=c.norm_epsilon, zero_centered_norms=c.apply_layernorm_1p,
            recompute_core_attention=c.recompute_granularity == "selective", dtype=c.dtype,
            dropout_impl=c.dropout_impl, dot_general=linear_dot, name="self_attention",
        ) if c.multi_latent_attention else SelfAttention(
            num_attention_heads=c.num_attention_heads, num_query_groups=c.num_query_groups,
            kv_channels=c.kv_channels, hidden_size=c.hidden_size, use_bias=c.add_bias_linear,
            qkv_bias=c.add_qkv_bias, rope=c.rotary_embedding(),
            attention_dropout=c.attention_dropout, dropout_impl=c.dropout_impl,
            qk_layernorm=c.qk_layernorm, qk_layernorm_across_heads=c.qk_layernorm_across_heads,
            normalization=c.normalization, norm_epsilon=c.norm_epsilon,
            zero_centered_norms=c.apply_layernorm_1p, softmax_scale=c.softmax_scale,
            softcap=c.attn_logit_softcapping, window=c.attention_window, rope_local=c.local_rotary_embedding(),
            init_std=c.init_method_std,
            output_init_std=c.init_method_std / math.sqrt(2.0 * c.num_layers),
            core_attention=c.attention_impl, cp_comm_type=c.cp_comm_type, softmax_type=c.softmax_type,
            recompute_core_attention=c.recompute_granularity == "selective",
            dtype=c.dtype, dot_general=linear_dot, name="self_attention",
        )
        window_layer = _window_layer(c, layer_number)
        nope = {"no_rope": _no_rope_layer(c, layer_number)} if any(c.no_rope_layers()) else {}
        if kv_cache is None:
            cp_order = {} if c.multi_latent_attention else {"positions": positions}
            h = attention(h, position_ids, self.deterministic, sample_offset=sample_offset, segment_ids=segment_ids,
                          window_layer=window_layer, **cp_order, **nope)
        else:
            h, kv_cache = attention(h, position_ids, self.deterministic, kv_cache, window_layer=window_layer, **nope)
        if c.sandwich_norms:
            h = norm("post_self_attn_layernorm")(h)
        h = _residual_scaled(c, h)
        x = x + drop(h, sample_offset=sample_offset, positions=positions)
        x = nn.with_logical_constraint(x, ("batch", "activation_length", "activation_embed"))
        h = norm("pre_mlp_layernorm")(x) if c.pre_norms else x
        self.sow("intermediates", "pre_mlp_layernorm_output", h)
        moe = self.moe_layer if self.moe_layer is not None else all(c.moe_layers())
        if moe:
            h = MoELayer(c, training=not self.deterministic, dot_general=self.dot_general, name="mlp")(h)
        else:
            h = MLP(c, dot_general=linear_dot, name="mlp")(h)
        if c.sandwich_norms:
            h = norm("post_mlp_layernorm")(h)
        h = _residual_scaled(c, h)
        x = x + drop(h, sample_offset=sample_offset, positions=positions)
        x = nn.with_logical_constraint(x, ("batch", "activation_length", "activation_embed"))
        return x, kv_cache


def _window_layer(c: ModelConfig, layer_number: Any) -> Any:
    """Whether decoder layer ``layer_number`` slides (:meth:`ModelConfig.window_layers`): a
    Python bool when every layer agrees or the number is an int, else a traced bool."""
    pattern = c.window_layers()
    if all(pattern) or not any(pattern):
        return bool(pattern[0]) if pattern else False
    if layer_number is None:
        raise ValueError("TransformerLayer: window_attn_skip_freq mixes sliding and full layers; the call needs "
                         "its layer_number")
    if isinstance(layer_number, int):
        return bool(pattern[layer_number])
    return jnp.asarray(pattern, jnp.bool_)[layer_number]


def _no_rope_layer(c: ModelConfig, layer_number: Any) -> Any:
    """Whether decoder layer ``layer_number`` skips RoPE (:meth:`ModelConfig.no_rope_layers`):
    a Python bool when every layer agrees or the number is an int, else a traced bool."""
    pattern = c.no_rope_layers()
    if all(pattern) or not any(pattern):
        return bool(pattern[0]) if pattern else False
    if layer_number is None:
        raise ValueError("TransformerLayer: no_rope_freq mixes RoPE and NoPE layers; the call needs its layer_number")
    if isinstance(layer_number, int):
        return bool(pattern[layer_number])
    return jnp.asarray(pattern, jnp.bool_)[layer_number]


def _residual_scaled(c: ModelConfig, h: Array) -> Array:
    """A sublayer's output ``h [b, s, h]`` times ``residual_multiplier`` (Granite), in ``h``'s
    dtype; ``h`` itself at 1.0."""
    if c.residual_multiplier == 1.0:
        return h
    return h * jnp.asarray(c.residual_multiplier, h.dtype)
