"""Self-attention with grouped-query heads, rotary embeddings and pluggable cores
(:mod:`jmegatron.models.core_attention`).

Follows megatron/core/transformer/attention.py (SelfAttention) and
megatron/core/transformer/dot_product_attention.py (core attention), and
megatron/core/models/common/embeddings/rotary_pos_embedding.py for RoPE
(Su et al. 2021, non-interleaved "rotate half" layout, as Hugging Face Llama).

Rotary embeddings and their scalings live in :mod:`jmegatron.models.rope`; with
``qk_layernorm`` each query and key head is normalised over its ``kv_channels`` before RoPE
(megatron-core's ``q_layernorm`` / ``k_layernorm`` submodules; Qwen3, Gemma-3), or with
``qk_layernorm_across_heads`` all query heads together and all key heads together
(:class:`jmegatron.models.layers.HeadsNorm`; OLMo-2/3's ``q_norm`` / ``k_norm``).

Decoding with a KV cache (Megatron-Core's static inference context,
megatron/core/inference/contexts/static_context.py + the key/value memory of
attention.py): the cache holds each layer's keys and values ``[b, max_length, g, d]``
per query group (GQA caches ``g = num_query_groups`` heads, not ``num_attention_heads``),
and a token's slot in the cache is its position id.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jmegatron.kernels.xla.attention import cached_attention
from jmegatron.kernels.xla.dense import dense_dot_general_fn
from jmegatron.models.core_attention import CORE_ATTENTIONS
from jmegatron.models.layers import HeadsNorm, Linear, make_norm
from jmegatron.models.rope import RotaryEmbedding, apply_rope
from jmegatron.parallel.context_parallel import CP_ATTENTIONS
from jmegatron.parallel.rules import CONTEXT_AXIS

Array = jax.Array

def _manual_axis_size(axis: str) -> int:
    """The size of mesh axis ``axis`` when it is manual here (inside the train step's
    ``shard_map``), else 1 (evaluation and generation run the whole sequence, GSPMD)."""
    try:
        return jax.lax.axis_size(axis)
    except NameError:
        return 1


def update_kv_cache(cache: Array, new: Array, start: Array) -> Array:
    """Write ``new [b, s, g, d]`` into ``cache [b, max_length, g, d]`` at slots
    ``start[i] .. start[i] + s - 1`` of row ``i`` (``start``: int ``[b]``), returning the
    updated cache in its own dtype. The caller keeps ``start + s <= max_length``
    (``lax.dynamic_update_slice`` would clamp the start otherwise)."""
    def row(c, n, i):
        return jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), i, axis=0)
    return jax.vmap(row)(cache, new, start)


class SelfAttention(nn.Module):
    """Causal self-attention: ``x [b, s, h]`` -> ``[b, s, h]``.

    One fused ``linear_qkv`` kernel ``[h, nkv, nq / nkv + 2, d]`` (Megatron's layout: for
    each query group its query heads, then its key and its value head; column-parallel
    over groups, so the backward pass all-reduces one input gradient), and
    ``linear_proj`` ``[nq, d, h]`` (row-parallel). ``num_query_groups < num_attention_heads`` gives grouped-query
    attention (Ainslie et al. 2023).
    """

    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    hidden_size: int
    use_bias: bool
    qkv_bias: bool
    rope: Optional[RotaryEmbedding]  # None: no rotary embedding (learned or no positions)
    attention_dropout: float
    init_std: float
    output_init_std: float
    core_attention: str = "xla"
    cp_comm_type: str = "p2p"  # under context parallelism: jmegatron.parallel.context_parallel.CP_ATTENTIONS
    recompute_core_attention: bool = False
    dtype: Any = jnp.float32
    dropout_impl: str = "hash"  # jmegatron.kernels.xla.dropout.DROPOUT_IMPLS
    dot_general: Callable = dense_dot_general_fn
    qk_layernorm: bool = False
    qk_layernorm_across_heads: bool = False  # the q/k norms over all heads together (OLMo-2/3), scales [n, d]
    normalization: str = "RMSNorm"  # the q/k norms' kind and epsilon under qk_layernorm
    norm_epsilon: float = 1e-5
    zero_centered_norms: bool = False  # the q/k norms multiply by 1 + scale (apply_layernorm_1p)
    softmax_scale: Optional[float] = None  # None: 1 / sqrt(kv_channels)
    softcap: Optional[float] = None  # attn_logit_softcapping
    window: Optional[int] = None  # the sliding window W (keys, the query's own included) of windowed calls
    rope_local: Optional[RotaryEmbedding] = None  # the windowed calls' RoPE; None: ``rope``
    # megatron-core's softmax_type: "learnable" holds softmax_offset [nq] (float32, one sink
    # logit per query head, split over tensor ranks with the heads), "off-by-one" a zero logit
    softmax_type: str = "vanilla"

    @nn.compact
    def __call__(self, x: Array, position_ids: Array, deterministic: bool,
                 kv_cache: Optional[tuple[Array, Array]] = None, sample_offset=0,
                 segment_ids: Optional[Array] = None, window_layer: Any = False,
                 positions: Optional[Array] = None, no_rope: Any = False):
        """``x [b, s, h]``, ``position_ids`` int ``[b, s]`` -> ``[b, s, h]``.

        ``position_ids`` feed RoPE only; the causal mask follows the sequence order, so
        ``reset_position_ids`` does not change which keys a query sees. Under context
        parallelism (the ``context`` mesh axis manual) the slots are in Megatron's
        load-balanced order and ``positions`` (int ``[b, s]``: each slot's index in the
        original sequence, the batch's ``positions`` from
        :meth:`jmegatron.training.run.Run.put_batch`) give that order; ValueError when they
        are None there. Elsewhere ``positions`` is not read. ``segment_ids`` (int ``[b, s]``, optional): document
        masking, attention only within equal ids (see :func:`jmegatron.kernels.xla.attention.xla_attention`); not with
        ``kv_cache`` (ValueError).

        ``sample_offset``: the global sample number of ``x[0]``, from which the attention
        dropout masks are drawn (:mod:`jmegatron.kernels.xla.dropout`).

        ``window_layer`` (a Python bool, or a traced bool scalar inside a scan over layers):
        this layer attends within the sliding ``window`` and rotates by ``rope_local``
        (Gemma's local layers); ignored without ``window``.

        ``no_rope`` (a Python bool, or a traced bool scalar inside a scan over layers): this
        layer applies no position embedding (NoPE, megatron-core's ``no_rope_freq``; SmolLM3's
        ``no_rope_layers``): the queries and keys are not rotated (a traced flag selects the
        identity rotation, ``cos = 1``, ``sin = 0``, so one compiled body serves both kinds).

        With ``kv_cache = (k, v)``, each ``[b, max_length, num_query_groups, kv_channels]``,
        this call's keys/values are written at the slots given by ``position_ids`` (which
        must be consecutive in each row, starting at ``position_ids[:, 0]``), the queries
        attend over the cache (:func:`jmegatron.kernels.xla.attention.cached_attention`; ``core_attention`` is not used)
        and ``(out, (k, v))`` is returned with the updated cache.
        """
        dense = functools.partial(Linear, dtype=self.dtype, dot_general=self.dot_general,
                                  kernel_init=nn.initializers.normal(self.init_std))
        nq, nkv, d = self.num_attention_heads, self.num_query_groups, self.kv_channels
        per_group = nq // nkv
        # Megatron's fused linear_qkv layout: per query group, its query heads then K then V.
        qkv = dense((nkv, per_group + 2, d), ("embed", "kv_heads", None, "kv"), tp_mode="column", tp_dim=1,
                    use_bias=self.use_bias or self.qkv_bias, name="linear_qkv")(x)
        b, s = x.shape[:2]
        q = qkv[:, :, :, :per_group, :].reshape(b, s, nq, d)
        k, v = qkv[:, :, :, per_group, :], qkv[:, :, :, per_group + 1, :]
        q = nn.with_logical_constraint(q, ("batch", "length", "activation_heads", "activation_kv"))
        k = nn.with_logical_constraint(k, ("batch", "length", "activation_kv_heads", "activation_kv"))
        v = nn.with_logical_constraint(v, ("batch", "length", "activation_kv_heads", "activation_kv"))
        if self.qk_layernorm and self.qk_layernorm_across_heads:  # over heads x kv_channels, before RoPE
            norm = functools.partial(HeadsNorm, normalization=self.normalization, epsilon=self.norm_epsilon,
                                     dtype=self.dtype, zero_centered=self.zero_centered_norms)
            q = norm(axes=("heads", "kv"), name="q_layernorm")(q)
            k = norm(axes=("kv_heads", "kv"), name="k_layernorm")(k)
            q = nn.with_logical_constraint(q, ("batch", "length", "activation_heads", "activation_kv"))
            k = nn.with_logical_constraint(k, ("batch", "length", "activation_kv_heads", "activation_kv"))
        elif self.qk_layernorm:  # per head, over kv_channels, before RoPE
            q = make_norm(self.normalization, self.norm_epsilon, self.dtype, "q_layernorm",
                          self.zero_centered_norms)(q)
            k = make_norm(self.normalization, self.norm_epsilon, self.dtype, "k_layernorm",
                          self.zero_centered_norms)(k)
        window = self._window(window_layer)
        if self.rope is not None and no_rope is not True:
            cos, sin = self.rope.cos_sin(position_ids)
            if self.window is not None and self.rope_local is not None and window_layer is not False:
                local = self.rope_local.cos_sin(position_ids)
                cos, sin = (local if window_layer is True else
                            tuple(jnp.where(window_layer, lo, gl) for lo, gl in zip(local, (cos, sin))))
            if no_rope is not False:  # traced: the identity rotation on the NoPE layers
                cos, sin = jnp.where(no_rope, 1.0, cos), jnp.where(no_rope, 0.0, sin)
            interleaved = self.rope.config.rotary_interleaved
            q, k = apply_rope(q, cos, sin, interleaved), apply_rope(k, cos, sin, interleaved)
        features = {k_: v_ for k_, v_ in (("softmax_scale", self.softmax_scale), ("softcap", self.softcap),
                                          ("window", window), ("sinks", self._sinks())) if v_ is not None}
        new_cache = None
        if kv_cache is not None and segment_ids is not None:
            raise ValueError("SelfAttention: segment_ids (document masking) is for training and evaluation; "
                             "decoding with a kv_cache takes none")
        if kv_cache is not None:
            start = position_ids[:, 0]
            new_cache = (update_kv_cache(kv_cache[0], k, start), update_kv_cache(kv_cache[1], v, start))
            out = cached_attention(q, new_cache[0], new_cache[1], position_ids, **features)
        elif _manual_axis_size(CONTEXT_AXIS) > 1:  # context parallelism: inside the train step
            # the slots' sequence positions, not position_ids (which restart per document
            # under reset_position_ids): the causal order is the sequence's
            if positions is None:
                raise ValueError("SelfAttention under context parallelism needs positions (int [b, s], each "
                                 "slot's index in the original sequence): Run.put_batch adds them to the batch")
            # whole on every tensor rank, as q, k and v: the ring's data-dependent branches
            # then slice it locally (under sequence parallelism GSPMD would otherwise move
            # slices inside a branch that only some context ranks take: a deadlock)
            positions = nn.with_logical_constraint(positions, ("batch", "length"))
            # the CPU kernel's block forms where the kernel runs (float32, no attention
            # dropout), the Pallas kernel's under attention_impl "pallas", else XLA's blocks
            rate = 0.0 if deterministic else self.attention_dropout
            block = "cpu" if self.core_attention == "cpu" and q.dtype == jnp.float32 and rate == 0.0 else "xla"
            block = "pallas" if self.core_attention == "pallas" else block
            out = CP_ATTENTIONS[self.cp_comm_type](
                q, k, v, positions, CONTEXT_AXIS, _manual_axis_size(CONTEXT_AXIS), segment_ids, block,
                rate, self.make_rng("dropout") if rate > 0.0 else None, sample_offset)
        else:
            out = self._core(q, k, v, deterministic, sample_offset, segment_ids, features)
        out = nn.with_logical_constraint(out, ("batch", "length", "activation_heads", "activation_kv"))
        out = Linear((self.hidden_size,), ("heads", "kv", "embed"), axis=(-2, -1), tp_mode="row", tp_dim=0,
                     use_bias=self.use_bias, dtype=self.dtype, dot_general=self.dot_general,
                     kernel_init=nn.initializers.normal(self.output_init_std),
                     name="linear_proj")(out)
        return out if kv_cache is None else (out, new_cache)

    def _sinks(self) -> Optional[Array]:
        """The attention sinks, float32 ``[num_attention_heads]`` (megatron-core's
        ``softmax_offset``: a learned parameter for ``softmax_type`` "learnable", zeros for
        "off-by-one"), or None for "vanilla". Raises ValueError for another ``softmax_type``."""
        if self.softmax_type == "vanilla":
            return None
        if self.softmax_type == "off-by-one":
            return jnp.zeros((self.num_attention_heads,), jnp.float32)
        if self.softmax_type != "learnable":
            raise ValueError(f"SelfAttention: softmax_type={self.softmax_type!r} is not 'vanilla', 'off-by-one' "
                             f"or 'learnable'")
        return self.param("softmax_offset", nn.with_logical_partitioning(nn.initializers.normal(self.init_std),
                                                                         ("heads",)),
                          (self.num_attention_heads,), jnp.float32)

    def _window(self, window_layer: Any) -> Any:
        """The call's sliding window: ``window`` where ``window_layer``, else None (a Python
        flag), or under a traced flag ``window`` or a width no sequence reaches."""
        if self.window is None or window_layer is False:
            return None
        if window_layer is True:
            return self.window
        return jnp.where(window_layer, self.window, jnp.iinfo(jnp.int32).max)

    def _core(self, q: Array, k: Array, v: Array, deterministic: bool, sample_offset,
              segment_ids: Optional[Array] = None, features: Optional[dict] = None) -> Array:
        core = CORE_ATTENTIONS[self.core_attention]
        if segment_ids is not None:  # only then: a core without document masking keeps its signature
            core = functools.partial(core, segment_ids=segment_ids)
        if features:  # softmax_scale / softcap / window, for the cores that take them
            core = functools.partial(core, **features)
        core = functools.partial(core, dropout_rate=self.attention_dropout, deterministic=deterministic,
                                 dropout_impl=self.dropout_impl, sample_offset=sample_offset,
                                 dropout_rng=None if deterministic or self.attention_dropout == 0.0
                                 else self.make_rng("dropout"))
        if self.recompute_core_attention:  # Megatron's selective recompute
            core = jax.checkpoint(core)
        return core(q, k, v)
