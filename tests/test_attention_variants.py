"""The attention variants of today's families against the references that define them:
the sliding window (transformers' ``sliding_window_causal_mask_function`` and
``jax.nn.dot_product_attention(local_window_size=)``), the score scale and soft-cap
(transformers' Gemma-2 ``eager_attention_forward``), the attention sinks (gpt-oss's), and the
fields refused where they are not built."""

import numpy as np
import pytest

import torch  # noqa: E402
from transformers import masking_utils as masking  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jmegatron.config import ConfigError, base_config, from_configdict  # noqa: E402
from jmegatron.kernels.xla.attention import cached_attention, causal_mask, xla_attention  # noqa: E402
from jmegatron.models.transformer_config import ModelConfig  # noqa: E402

S = 32


@pytest.mark.parametrize("window", [1, 7, 8, 31, 32, 33])
def test_window_mask_is_transformers_and_jax(window):
    """Query i sees keys ``i - W < j <= i``: transformers' sliding-window causal mask for its
    ``sliding_window`` W, and ``jax.nn.dot_product_attention``'s ``local_window_size=(W - 1, 0)``."""
    ours = np.asarray(causal_mask(S, window=window))
    theirs = masking.sdpa_mask(batch_size=1, q_length=S, kv_length=S, allow_is_causal_skip=False,
                               mask_function=masking.sliding_window_causal_mask_function(window))
    np.testing.assert_array_equal(ours, theirs[0, 0].numpy())
    # the traced width (a layer number selecting it inside a scan) gives the same mask
    np.testing.assert_array_equal(ours, np.asarray(jax.jit(lambda w: causal_mask(S, window=w))(window)))
    rng = np.random.default_rng(window)
    q, k, v = (jnp.asarray(rng.normal(size=(1, S, 2, 8)), jnp.float32) for _ in range(3))
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(window - 1, 0))
    np.testing.assert_allclose(np.asarray(xla_attention(q, k, v, window=window)), np.asarray(ref), atol=2e-6)


def test_scale_softcap_and_window_are_gemma2s_eager_attention():
    """Scores scaled by ``query_pre_attn_scalar ** -0.5``, soft-capped, masked by the window:
    transformers' own Gemma-2 core (grouped-query, float32), forward and gradients; the KV
    cache form gives the same rows."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    rng = np.random.default_rng(0)
    b, nq, nkv, d, window, scale, cap = 2, 4, 2, 16, 8, 20 ** -0.5, 5.0
    q, k, v = (rng.normal(size=(b, S, n, d)).astype(np.float32) for n in (nq, nkv, nkv))
    dout = rng.normal(size=(b, S, nq, d)).astype(np.float32)

    class Module:
        num_key_value_groups, training = nq // nkv, False

    allowed = masking.sdpa_mask(batch_size=b, q_length=S, kv_length=S, allow_is_causal_skip=False,
                                mask_function=masking.sliding_window_causal_mask_function(window))
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    tq, tk, tv = (torch.tensor(x.transpose(0, 2, 1, 3), requires_grad=True) for x in (q, k, v))
    out, _ = eager_attention_forward(Module(), tq, tk, tv, additive, scaling=scale, softcap=cap)
    (out * torch.from_numpy(dout)).sum().backward()

    def ours(q, k, v):
        return xla_attention(q, k, v, softmax_scale=scale, softcap=cap, window=window)

    got, vjp = jax.vjp(ours, q, k, v)
    np.testing.assert_allclose(np.asarray(got), out.detach().numpy(), atol=2e-6)
    for g, t in zip(vjp(jnp.asarray(dout)), (tq, tk, tv)):
        np.testing.assert_allclose(np.asarray(g), t.grad.numpy().transpose(0, 2, 1, 3), atol=2e-5)
    # every feature changes the result (a test that would catch a dropped one)
    for changed in (dict(softmax_scale=None, softcap=cap, window=window), dict(softmax_scale=scale, window=window),
                    dict(softmax_scale=scale, softcap=cap)):
        assert float(jnp.max(jnp.abs(xla_attention(q, k, v, **changed) - got))) > 1e-2, changed
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (b, S))
    cached = cached_attention(q, k, v, positions, softmax_scale=scale, softcap=cap, window=window)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(got), atol=2e-6)


def gemma_cfg(**changes):
    c = base_config("gemma3")
    fields = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=32,
                  ffn_hidden_size=96, seq_length=32, vocab_size=256, mock_data=True, window_size=(7, 0),
                  window_attn_skip_freq=3, softmax_scale=0.2, attn_logit_softcapping=5.0,
                  micro_batch_size=2, global_batch_size=4)
    for key, value in dict(fields, **changes).items():
        setattr(c, key, value)
    return from_configdict(c)


@pytest.mark.parametrize("changes, match", [
    (dict(window_size=(7, 2)), r"window_size=\(7, 2\): only causal windows"),
    (dict(window_size=(7,)), r"window_size=\(7,\) must be \(left, right\)"),
    (dict(window_attn_skip_freq=[1, 0]), r"window_attn_skip_freq=\(1, 0\) must be an int or one 0/1 per layer"),
    (dict(window_size=None), "window_attn_skip_freq=3 needs config.window_size"),
    (dict(attn_logit_softcapping=-1.0), "attn_logit_softcapping=-1.0 must be > 0"),
    (dict(context_parallel_size=2), "window_size=\\(7, 0\\) with context_parallel_size=2 is not built"),
    (dict(num_moe_experts=4, moe_ffn_hidden_size=32), "gated_linear_unit=True .* the MoE experts build SwiGLU"),
])
def test_gemma_fields_refuse_what_is_not_built(changes, match):
    with pytest.raises(ConfigError, match=match):
        gemma_cfg(**changes)


@pytest.mark.parametrize("impl", ["cpu", "pallas", "dot_product"])
def test_kernels_without_the_variants_refuse_by_name_and_auto_falls_back(impl):
    with pytest.raises(ConfigError, match=rf"attention_impl='{impl}' does not build softmax_scale, "
                                          r"attn_logit_softcapping, window_size"):
        ModelConfig.from_config(gemma_cfg(attention_impl=impl), 256)
    assert ModelConfig.from_config(gemma_cfg(), 256).attention_impl == "xla"


def test_sinks_are_gpt_oss_eager_attention():
    """Attention sinks (megatron-core's ``softmax_type="learnable"``): one logit per query head
    joins each query's softmax, its probability dropped: transformers' own gpt-oss core
    (grouped-query, a sliding window, float32), forward and gradients (the sinks' included);
    the KV-cache form gives the same rows, and the sinks change the result."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    rng = np.random.default_rng(1)
    b, nq, nkv, d, window = 2, 4, 2, 16, 8
    q, k, v = (rng.normal(size=(b, S, n, d)).astype(np.float32) for n in (nq, nkv, nkv))
    sinks = rng.normal(size=(nq,)).astype(np.float32) * 2.0
    dout = rng.normal(size=(b, S, nq, d)).astype(np.float32)

    class Module(torch.nn.Module):
        num_key_value_groups = nq // nkv

        def __init__(self):
            super().__init__()
            self.sinks = torch.nn.Parameter(torch.from_numpy(sinks.copy()))

    module = Module().eval()
    allowed = masking.sdpa_mask(batch_size=b, q_length=S, kv_length=S, allow_is_causal_skip=False,
                                mask_function=masking.sliding_window_causal_mask_function(window))
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    tq, tk, tv = (torch.tensor(x.transpose(0, 2, 1, 3), requires_grad=True) for x in (q, k, v))
    out, _ = eager_attention_forward(module, tq, tk, tv, additive, scaling=d ** -0.5)
    (out * torch.from_numpy(dout)).sum().backward()

    def ours(q, k, v, s):
        return xla_attention(q, k, v, window=window, sinks=s)

    got, vjp = jax.vjp(ours, q, k, v, sinks)
    np.testing.assert_allclose(np.asarray(got), out.detach().numpy(), atol=2e-6)
    grads = vjp(jnp.asarray(dout))
    for g, t in zip(grads[:3], (tq, tk, tv)):
        np.testing.assert_allclose(np.asarray(g), t.grad.numpy().transpose(0, 2, 1, 3), atol=2e-5)
    np.testing.assert_allclose(np.asarray(grads[3]), module.sinks.grad.numpy(), atol=2e-5)
    assert float(jnp.max(jnp.abs(xla_attention(q, k, v, window=window) - got))) > 1e-2
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (b, S))
    cached = cached_attention(q, k, v, positions, window=window, sinks=sinks)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(got), atol=2e-6)


def test_sinks_refuse_what_is_not_built():
    """``softmax_type``: the cores other than XLA refuse it by name and "auto" falls back to
    "xla"; context parallelism and multi-latent attention refuse it; an unknown value is named."""
    def cfg(**changes):
        c = base_config()
        fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256,
                      mock_data=True, position_embedding_type="rope", normalization="RMSNorm",
                      micro_batch_size=2, global_batch_size=4, softmax_type="learnable")
        for key, value in dict(fields, **changes).items():
            setattr(c, key, value)
        return from_configdict(c)

    with pytest.raises(ConfigError, match="attention_impl='cpu' does not build softmax_type"):
        ModelConfig.from_config(cfg(attention_impl="cpu"), 256)
    assert ModelConfig.from_config(cfg(), 256).attention_impl == "xla"
    with pytest.raises(ConfigError, match="softmax_type='learnable' with context_parallel_size=2 is not built"):
        cfg(context_parallel_size=2)
    with pytest.raises(ConfigError, match="softmax_type='sigmoid' is not one of"):
        cfg(softmax_type="sigmoid")
    with pytest.raises(ConfigError, match="multi_latent_attention=True .*softmax_type"):
        cfg(multi_latent_attention=True, num_moe_experts=None)
