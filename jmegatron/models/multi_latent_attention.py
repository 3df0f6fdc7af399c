"""Multi-latent attention (DeepSeek-V2, arXiv:2405.04434; DeepSeek-V3, arXiv:2412.19437).

Follows megatron/core/transformer/multi_latent_attention.py (``MLASelfAttention``) with the
parameter names of its local layer spec. With ``n`` heads, ``dn = qk_head_dim``,
``dr = qk_pos_emb_head_dim``, ``dv = v_head_dim``, ``rq = q_lora_rank``, ``rkv = kv_lora_rank``:

* queries: ``c_q = q_layernorm(x W_qd)`` (``linear_q_down_proj [h, rq]``), ``q = c_q W_qu``
  (``linear_q_up_proj [rq, n, dn + dr]``); without ``q_lora_rank`` one ``linear_q_proj
  [h, n, dn + dr]``. Each head is ``[q_nope (dn) | q_pe (dr)]``.
* keys and values: ``[c_kv (rkv) | k_pe (dr)] = x W_kvd`` (``linear_kv_down_proj
  [h, rkv + dr]``), ``kv_layernorm(c_kv) W_kvu`` (``linear_kv_up_proj [rkv, n, dn + dv]``)
  gives per head ``[k_nope (dn) | v (dv)]``; ``k_pe`` is one head shared by all.
* RoPE on ``q_pe`` and ``k_pe`` only, over ``dr``: Megatron's layout de-interleaves the
  pairs (``t[0::2] | t[1::2]``) and rotates halves (megatron/core/models/common/embeddings/
  rope_utils.py), which is Hugging Face DeepSeek-V3's ``rope_interleave=True``.
* attention of ``[q_nope | q_pe]`` over ``[k_nope | k_pe]`` (head dim ``dn + dr``) and ``v``
  (head dim ``dv``), scaled by ``mscale(s, mscale_all_dim)**2 / sqrt(dn + dr)`` under YaRN
  (``s`` its factor; megatron-core's ``softmax_scale``), else ``1 / sqrt(dn + dr)``; then
  ``linear_proj [n, dv, h]``.

The latent norms are built with ``qk_layernorm`` (Megatron's spec: the DeepSeek-V3 recipe
passes ``--qk-layernorm``). The down projections are replicated over tensor-parallel ranks
(Transformer Engine's "duplicated" layers in Megatron's TE spec), the up projections are
column-parallel over heads and ``linear_proj`` row-parallel. The core attention is XLA's
(:func:`jmegatron.kernels.xla.attention.xla_attention`; the other cores refuse a value head
dimension unlike the key's). The KV cache holds the full keys ``[b, L, n, dn + dr]`` and
values ``[b, L, n, dv]`` (Megatron's static inference context), not the latents.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jmegatron.config.model import yarn_get_mscale
from jmegatron.kernels.xla.attention import cached_attention, xla_attention
from jmegatron.kernels.xla.dense import dense_dot_general_fn
from jmegatron.models.attention import update_kv_cache
from jmegatron.models.layers import Linear, make_norm
from jmegatron.models.rope import RotaryEmbedding, apply_rope

Array = jax.Array


def deinterleave(x: Array) -> Array:
    """``[..., d]`` -> the even then the odd entries of the last axis (Megatron's MLA RoPE
    layout before the rotate-half rotation)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def mla_softmax_scale(qk_dim: int, rope: Optional[RotaryEmbedding]) -> float:
    """The score scale of multi-latent attention: ``1 / sqrt(qk_dim)``, times
    ``mscale(factor, mscale_all_dim)**2`` under YaRN (megatron-core ``MLASelfAttention``;
    transformers' DeepseekV3Attention scales the same when ``mscale_all_dim`` is set)."""
    scale = qk_dim ** -0.5
    if rope is not None and rope.config.position_embedding_type == "yarn":
        scale *= yarn_get_mscale(rope.config.yarn_rotary_scaling_factor, rope.config.yarn_mscale_all_dim) ** 2
    return scale


class MLASelfAttention(nn.Module):
    """Causal multi-latent self-attention: ``x [b, s, h]`` -> ``[b, s, h]`` (module docstring).

    ``rope``: the rotary embedding (its ``kv_channels`` replaced by ``qk_pos_emb_head_dim``
    here). ``__call__`` takes what :class:`jmegatron.models.attention.SelfAttention` takes;
    with ``kv_cache = (k [b, L, n, dn + dr], v [b, L, n, dv])`` it returns ``(out, cache)``.
    """

    num_attention_heads: int
    hidden_size: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    rope: RotaryEmbedding
    attention_dropout: float
    init_std: float
    output_init_std: float
    use_bias: bool = False
    qk_layernorm: bool = True
    normalization: str = "RMSNorm"
    norm_epsilon: float = 1e-5
    zero_centered_norms: bool = False
    recompute_core_attention: bool = False
    dtype: Any = jnp.float32
    dropout_impl: str = "hash"
    dot_general: Callable = dense_dot_general_fn

    @nn.compact
    def __call__(self, x: Array, position_ids: Array, deterministic: bool,
                 kv_cache: Optional[tuple[Array, Array]] = None, sample_offset=0,
                 segment_ids: Optional[Array] = None, window_layer: Any = False):
        n, dn, dr, dv = self.num_attention_heads, self.qk_head_dim, self.qk_pos_emb_head_dim, self.v_head_dim
        dense = functools.partial(Linear, dtype=self.dtype, dot_general=self.dot_general,
                                  kernel_init=nn.initializers.normal(self.init_std))

        def norm(name):
            if not self.qk_layernorm:
                return lambda t: t
            return make_norm(self.normalization, self.norm_epsilon, self.dtype, name, self.zero_centered_norms)

        if self.q_lora_rank is None:
            q = dense((n, dn + dr), ("embed", "heads", "kv"), tp_mode="column", tp_dim=1, name="linear_q_proj")(x)
        else:
            c_q = dense((self.q_lora_rank,), ("embed", None), name="linear_q_down_proj")(x)
            c_q = norm("q_layernorm")(c_q)
            q = dense((n, dn + dr), (None, "heads", "kv"), tp_mode="column", tp_dim=1,
                      name="linear_q_up_proj")(c_q)
        kv_down = dense((self.kv_lora_rank + dr,), ("embed", None), name="linear_kv_down_proj")(x)
        c_kv, k_pe = kv_down[..., :self.kv_lora_rank], kv_down[..., self.kv_lora_rank:]
        kv = dense((n, dn + dv), (None, "heads", "kv"), tp_mode="column", tp_dim=1,
                   name="linear_kv_up_proj")(norm("kv_layernorm")(c_kv))
        q = nn.with_logical_constraint(q, ("batch", "length", "activation_heads", "activation_kv"))
        kv = nn.with_logical_constraint(kv, ("batch", "length", "activation_heads", "activation_kv"))
        q_nope, q_pe = q[..., :dn], q[..., dn:]
        k_nope, v = kv[..., :dn], kv[..., dn:]
        rope = dataclasses.replace(self.rope, kv_channels=dr)
        cos, sin = rope.cos_sin(position_ids)
        q_pe = apply_rope(deinterleave(q_pe), cos, sin)
        k_pe = apply_rope(deinterleave(k_pe[:, :, None, :]), cos, sin)  # one head, shared
        query = jnp.concatenate([q_nope, q_pe], axis=-1)
        key = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, k_nope.shape[:-1] + (dr,))], axis=-1)
        scale = mla_softmax_scale(dn + dr, self.rope)
        new_cache = None
        if kv_cache is not None:
            start = position_ids[:, 0]
            new_cache = (update_kv_cache(kv_cache[0], key, start), update_kv_cache(kv_cache[1], v, start))
            out = cached_attention(query, new_cache[0], new_cache[1], position_ids, softmax_scale=scale)
        else:
            rate = 0.0 if deterministic else self.attention_dropout
            core = functools.partial(xla_attention, dropout_rate=rate, deterministic=deterministic,
                                     dropout_impl=self.dropout_impl, sample_offset=sample_offset,
                                     dropout_rng=self.make_rng("dropout") if rate > 0.0 else None,
                                     segment_ids=segment_ids, softmax_scale=scale)
            if self.recompute_core_attention:
                core = jax.checkpoint(core)
            out = core(query, key, v)
        out = nn.with_logical_constraint(out, ("batch", "length", "activation_heads", "activation_kv"))
        out = Linear((self.hidden_size,), ("heads", "kv", "embed"), axis=(-2, -1), tp_mode="row", tp_dim=0,
                     use_bias=self.use_bias, dtype=self.dtype, dot_general=self.dot_general,
                     kernel_init=nn.initializers.normal(self.output_init_std), name="linear_proj")(out)
        return out if kv_cache is None else (out, new_cache)
