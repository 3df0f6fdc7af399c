"""Model FLOPs per training iteration, parameter counts and MFU.

FLOPs follow ``num_floating_point_operations`` / ``transformer_flops`` in Megatron-LM's
``megatron/training/training.py`` as of NVIDIA/Megatron-LM commit ``d98e8a64dd``
(main, 2026-08; the same dense-model result as tags core_v0.12.0 through core_v0.19.0).
The dense GPT/Llama terms and the MoE MLP term (routed experts counted ``moe_router_topk``
times, shared experts once, the router's gating GEMM not counted, as Megatron) are
implemented, and so are its multi-latent-attention and multi-token-prediction terms (each MTP
depth one more layer of the last decoder layer's kind, its ``eh_proj`` and three norms
counted as GEMMs, and one more logit GEMM); the attention-output-gate and linear-attention
terms are zero for the models jmegatron builds and are left out.

Units: every ``*flops*`` function here returns a count of floating-point operations
(FLOPs), not a rate. Divide by seconds and 1e12 for TFLOP/s, as Megatron's
``training_log`` does (see :func:`tflops_per_device`).

Conventions (Megatron's; all are *model* FLOPs, not hardware FLOPs):

* Only matrix multiplications are counted (no norms, softmax, activations, RoPE,
  residual adds, optimizer step).
* ``2`` FLOPs per multiply-accumulate (``fma_expansion_factor``) and ``3`` for forward +
  backward (``forward_backward_expansion_factor``: forward GEMM, weight-gradient GEMM,
  data-gradient GEMM). Activation recomputation is not counted.
* Sliding-window layers (``window_size``) are counted as full causal attention, as
  Megatron counts them.
* NoPE layers (``no_rope_freq``) cost what RoPE layers cost (RoPE is not counted), and
  Granite's scalars (``embedding_multiplier``, ``residual_multiplier``, ``logits_scaling``)
  are elementwise: none of them changes the count.
* Causal core attention counts half the ``s x s`` score matrix: ``QK^T`` and
  ``softmax(QK^T) V`` together cost ``2 * q_proj * s / 2 * 2`` FLOPs per token and layer,
  i.e. ``q_proj * s`` multiply-accumulates. Megatron counts it this way since commit
  8873b55d6a (2025-03-06, first released in core_v0.12.0); core_v0.11.0 and older counted
  the full square (pass ``causal=False`` to reproduce those numbers). jmegatron's XLA
  attention really computes the full masked square, so hardware FLOPs are higher.
* The logit GEMM ``[h, padded_vocab]`` is counted; the input embedding lookup is not.
"""

from __future__ import annotations

from typing import Optional

from jmegatron.config import JMegatronConfig, moe_layer_pattern

# Megatron's names (megatron/training/training.py, transformer_flops).
FORWARD_BACKWARD_EXPANSION_FACTOR = 3
FMA_EXPANSION_FACTOR = 2


def _token_linear_flops(cfg: JMegatronConfig, padded_vocab_size: int) -> int:
    """FLOPs per token (fwd+bwd) that scale linearly with the token count: QKV and output
    projections, MLP and logits, summed over all layers."""
    h = cfg.hidden_size
    query_projection_size = cfg.kv_channels * cfg.num_attention_heads
    key_projection_size = cfg.kv_channels * cfg.num_query_groups
    value_projection_size = cfg.kv_channels * cfg.num_query_groups
    # 3 GEMM-widths of ffn with SwiGLU (h -> 2*ffn, ffn -> h), 2 without (h -> ffn, ffn -> h).
    ffn_expansion_factor = 3 if cfg.gated_mlp else 2
    num_moe_layers = moe_layer_count(cfg, mtp=True)
    num_dense_layers = transformer_layer_count(cfg) - num_moe_layers
    mlp = h * cfg.ffn_hidden_size * ffn_expansion_factor * num_dense_layers
    if num_moe_layers:  # each token through its top-k routed experts and the shared expert
        moe_ffn = (cfg.moe_ffn_hidden_size * cfg.moe_router_topk
                   + (cfg.moe_shared_expert_intermediate_size or 0))
        mlp += h * moe_ffn * ffn_expansion_factor * num_moe_layers
    self_attn = (h * (query_projection_size + key_projection_size + value_projection_size)
                 + query_projection_size * h)
    if cfg.multi_latent_attention:  # Megatron's MLA term (a latent norm counted as a width-1 GEMM)
        n, dn, dr, dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        rq, rkv = cfg.q_lora_rank, cfg.kv_lora_rank
        q_term = h * n * (dn + dr) if rq is None else rq * (h + n * (dn + dr) + 1)
        self_attn = q_term + rkv * (h + n * (dn + dv) + 1) + h * dr + n * dv * h
    mtp = mtp_depths(cfg)
    mtp_norms_and_proj = mtp * (3 * h + 2 * h * h)  # Megatron: "MTP eh norm + final norm", "eh proj"
    logits = h * padded_vocab_size * (mtp + 1)
    return (FORWARD_BACKWARD_EXPANSION_FACTOR * FMA_EXPANSION_FACTOR
            * (mlp + transformer_layer_count(cfg) * self_attn + mtp_norms_and_proj + logits))


def mtp_depths(cfg: JMegatronConfig) -> int:
    """Multi-token prediction depths (``mtp_num_layers``; 0 without)."""
    return cfg.mtp_num_layers or 0


def transformer_layer_count(cfg: JMegatronConfig) -> int:
    """Transformer layers: the decoder's and one per multi-token prediction depth."""
    return cfg.num_layers + mtp_depths(cfg)


def moe_layer_count(cfg: JMegatronConfig, mtp: bool = False) -> int:
    """Decoder layers whose MLP is an MoE layer (``moe_layer_freq``; 0 for a dense model),
    with ``mtp`` also the multi-token prediction layers when the last decoder layer is one."""
    if cfg.num_moe_experts is None:
        return 0
    pattern = moe_layer_pattern(cfg.moe_layer_freq, cfg.num_layers)
    return sum(pattern) + (pattern[-1] * mtp_depths(cfg) if mtp else 0)


def _core_attention_flops_per_squared_token(cfg: JMegatronConfig, causal: bool) -> int:
    """FLOPs (fwd+bwd, all layers) of ``QK^T`` and ``softmax(QK^T) V`` per unit of
    ``sum_i L_i ** 2`` (``L_i`` the length of each attended sequence)."""
    query_projection_size = cfg.kv_channels * cfg.num_attention_heads
    # Megatron: query_projection_size / 2 (causal mask) * 2 (QK^T and (QK^T)V).
    per_layer = query_projection_size * 2 // (2 if causal else 1)
    if cfg.multi_latent_attention:  # QK^T over dn + dr, (QK^T)V over dv
        n = cfg.num_attention_heads
        per_layer = n * (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim + cfg.v_head_dim) // (2 if causal else 1)
    return FORWARD_BACKWARD_EXPANSION_FACTOR * FMA_EXPANSION_FACTOR * per_layer * transformer_layer_count(cfg)


def num_floating_point_operations(cfg: JMegatronConfig, batch_size: int, padded_vocab_size: int,
                                  *, total_tokens: Optional[int] = None,
                                  seqlen_squared_sum: Optional[int] = None,
                                  causal: bool = True) -> float:
    """FLOPs (a count, not FLOP/s) of one training iteration, forward + backward, over
    ``batch_size`` sequences of ``cfg.seq_length`` tokens (pass the global batch size for
    one optimizer step), for a dense GPT/Llama model.

    With ``T = batch_size * s`` tokens, ``q = kv_channels * num_attention_heads``,
    ``kv = kv_channels * num_query_groups``, ``E = 3`` with SwiGLU else ``2``::

        FLOPs = T * 3 * 2 * (L * (h * ffn * E                # MLP
                                  + h * (q + 2 * kv)         # QKV projection
                                  + q * h)                   # output projection
                             + h * V_padded)                 # logits
              + B * s**2 * 3 * 2 * L * (q / 2 * 2)           # causal QK^T and (QK^T)V

    exactly ``transformer_flops()`` of Megatron-LM ``megatron/training/training.py``
    (commit d98e8a64dd; see the module docstring) with no MoE/MTP/MLA. For plain MHA
    GPT with ``ffn = 4h`` this is the familiar
    ``72 * B * s * L * h**2 * (1 + s / (12 h) + V / (12 L h))``.

    ``total_tokens`` (``sum_i L_i``) and ``seqlen_squared_sum`` (``sum_i L_i**2``) override
    the defaults ``batch_size * s`` and ``batch_size * s**2`` for packed sequences with
    reset attention masks, as Megatron's ``total_real_tokens_in_batch`` /
    ``seqlen_squared_sum_in_batch``. ``causal=False`` counts the full attention square
    (Megatron core_v0.11.0 and older).
    """
    if batch_size < 0:
        raise ValueError(f"batch_size={batch_size} must be >= 0.")
    s = cfg.seq_length
    tokens = batch_size * s if total_tokens is None else total_tokens
    squared = batch_size * s * s if seqlen_squared_sum is None else seqlen_squared_sum
    total = (tokens * _token_linear_flops(cfg, padded_vocab_size)
             + squared * _core_attention_flops_per_squared_token(cfg, causal))
    return float(total)


def core_attention_executed_fraction(cfg: JMegatronConfig, attention_impl: str,
                                     context_parallel_size: int = 1, cp_comm_type: str = "p2p",
                                     kernel_block: int = 64) -> float:
    """Hardware FLOPs of core attention (``QK^T`` and ``PV``, forward + backward, all
    devices together) over Megatron's causal model count (the ``seqlen_squared_sum`` term
    of :func:`num_floating_point_operations`), for the attention path that runs.

    The product of two factors:

    * the share of the ``s x s`` score square computed, over the causal half ``s^2 / 2``:
      XLA's attention (``attention_impl`` "xla" / "dot_product"), ``all_gather`` and ``a2a``
      context parallelism compute the whole masked square: 2. The CPU kernel
      (:mod:`jmegatron.kernels.cpu`, float32) takes queries in blocks of ``kernel_block``
      rows, each against the keys it can see: ``1 + kernel_block / s``; it is the block
      kernel of every ``cp_comm_type`` too, skipping fully masked key tiles, so context
      parallelism adds nothing to it. With XLA's blocks the ring
      (``cp_comm_type="p2p"``, :func:`jmegatron.parallel.context_parallel.ring_attention`)
      computes on each of the ``cp`` ranks its local ``[2c, 2c]`` causal block whole and
      ``cp - 1`` unmasked ``2c x c`` blocks (``c = s / 2 cp``; Transformer Engine's
      load-balanced schedule): ``(cp + 1) / cp``.
    * the backward's recomputation, over Megatron's 3 GEMM passes (forward, and two in the
      backward): flash-style backwards (the CPU kernel, the ring) recompute ``QK^T``
      (7/6); ``recompute_granularity="selective"`` reruns the XLA forward (8/6); else 1.

    Megatron counts neither (its formula is model FLOPs; MFU stays comparable across
    paths). Under cp with attention dropout the blocks are XLA's whatever
    ``attention_impl`` says (the CPU kernel's). The GPU kernels ("pallas", "cudnn",
    "transformer_engine") count as flash attention with 128-row tiles (not measured: no GPU
    here). ``attention_impl`` must be resolved ("xla", "dot_product", "cpu", or a GPU kernel;
    :func:`jmegatron.models.gpt.resolve_impls`); the CPU kernel runs float32 only, so
    ``cfg.bf16`` with "cpu" counts XLA's attention. Raises ValueError for another
    ``attention_impl`` or ``cp_comm_type``, or ``context_parallel_size < 1``.
    Checked against XLA's compiled cost analysis in tests/test_flops.py.
    """
    if context_parallel_size < 1:
        raise ValueError(f"context_parallel_size={context_parallel_size} must be >= 1")
    flash = ("pallas", "cudnn", "transformer_engine")
    if attention_impl not in ("xla", "dot_product", "cpu") + flash:
        raise ValueError(f"attention_impl={attention_impl!r}: pass a resolved one ('xla', 'dot_product', 'cpu', "
                         f"'pallas', 'cudnn', 'transformer_engine')")
    if cp_comm_type not in ("p2p", "all_gather", "a2a"):
        raise ValueError(f"cp_comm_type={cp_comm_type!r}: choose 'p2p', 'all_gather' or 'a2a'")
    cp = context_parallel_size
    kernel = attention_impl == "cpu" and not cfg.bf16
    if kernel and not (cp > 1 and cfg.attention_dropout > 0):  # attention dropout under cp: XLA's blocks
        return (1 + min(kernel_block, cfg.seq_length) / cfg.seq_length) * 7 / 6
    if attention_impl in flash:
        # GPU flash kernels, 128-row query tiles against the keys they can see (the Pallas
        # kernel's default; assumed for cuDNN / TE) and a recomputing backward. Under cp the
        # Pallas blocks mask by position without skipping: the XLA-block shares below, x 7/6.
        if cp == 1:
            return (1 + min(128, cfg.seq_length) / cfg.seq_length) * 7 / 6
        return ((cp + 1) / cp if cp_comm_type == "p2p" else 2.0) * 7 / 6
    if cp > 1 and cp_comm_type == "p2p":
        return (cp + 1) / cp * 7 / 6
    if cp > 1:
        return 2.0
    return 2.0 * (8 / 6 if cfg.recompute_granularity == "selective" else 1.0)


def core_attention_flops(cfg: JMegatronConfig, batch_size: int, *, causal: bool = True) -> float:
    """Megatron's core-attention term alone (``QK^T`` and ``PV``, forward + backward) of
    :func:`num_floating_point_operations` over ``batch_size`` full sequences: a count."""
    return float(batch_size * cfg.seq_length ** 2 * _core_attention_flops_per_squared_token(cfg, causal))


def flops_per_token(cfg: JMegatronConfig, padded_vocab_size: int, *, causal: bool = True) -> float:
    """Training FLOPs (forward + backward) per token of a full ``cfg.seq_length`` sequence:
    :func:`num_floating_point_operations` for one sequence divided by ``cfg.seq_length``.
    Close to ``6 * num_parameters`` plus the attention term ``6 * L * q * s`` (causal)."""
    return num_floating_point_operations(cfg, 1, padded_vocab_size, causal=causal) / cfg.seq_length


def num_parameters(cfg: JMegatronConfig, padded_vocab_size: int) -> int:
    """Exact number of parameters of :class:`jmegatron.models.gpt.GPTModel` for ``cfg``.

    Counts (``d = kv_channels``, ``nq = num_attention_heads``, ``ng = num_query_groups``,
    norm = ``2h`` for LayerNorm (scale + bias), ``h`` for RMSNorm (scale)):

    * ``word_embeddings``: ``V_padded * h``; ``position_embeddings``:
      ``max_position_embeddings * h`` if ``position_embedding_type == "learned_absolute"``.
    * per layer: two norms (four with ``sandwich_norms``); the fused ``linear_qkv`` ``h*(nq + 2*ng)*d``
      each, with biases (``nq*d``, ``ng*d``) if ``add_bias_linear or add_qkv_bias``;
      ``linear_proj`` ``nq*d*h`` (+ ``h`` bias if ``add_bias_linear``); with ``qk_layernorm``
      the ``q_layernorm`` and ``k_layernorm`` of ``kv_channels`` (``2d`` each for LayerNorm; with
      ``qk_layernorm_across_heads`` ``nq*d`` and ``ng*d``); without ``pre_norms`` two norms fewer; ``linear_fc1``
      ``h*ffn`` (``h*2*ffn`` with SwiGLU) (+ ``ffn`` / ``2*ffn`` bias), ``linear_fc2``
      ``ffn*h`` (+ ``h`` bias).
    * ``final_layernorm``; ``output_layer`` ``h * V_padded`` (no bias) if untied.
    * an MoE layer (``moe_layer_freq``) has, instead of the MLP, ``router`` ``h*E``,
      ``E`` experts of ``moe_ffn_hidden_size`` (with ``add_bias_linear`` their fc1 / fc2
      biases and the router's ``bias [E]``) and the shared expert of
      ``moe_shared_expert_intermediate_size`` with its ``[h, 1]`` gate under
      ``moe_shared_expert_gate`` (jmegatron.models.moe), and the router's ``expert_bias [E]``
      under ``moe_router_enable_expert_bias``.
    * multi-latent attention: :func:`mla_parameters` instead of the QKV / proj / QK-norm terms.
    * ``softmax_type="learnable"``: the attention sinks ``softmax_offset [nq]`` per layer.
    * per multi-token prediction depth: ``enorm``, ``hnorm`` and ``final_layernorm``,
      ``eh_proj`` ``2h * h`` and one layer of the last decoder layer's kind.

    Megatron's ``theoretical_memory_usage.compute_weight_and_optimizer_memory`` uses the
    same terms but drops biases and position embeddings; Llama-2-7B (no biases, rope)
    gives 6,738,415,616 in both.
    """
    h, ffn = cfg.hidden_size, cfg.ffn_hidden_size
    d, nq, ng = cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
    norm = 2 * h if cfg.normalization == "LayerNorm" else h
    qkv_bias = cfg.add_bias_linear or cfg.add_qkv_bias
    fc1_width = 2 * ffn if cfg.gated_mlp else ffn

    qk_norms = 2 * (2 * d if cfg.normalization == "LayerNorm" else d) if cfg.qk_layernorm else 0
    if cfg.qk_layernorm and cfg.qk_layernorm_across_heads:  # scales [nq, d] and [ng, d] (+ biases)
        qk_norms = (nq + ng) * d * (2 if cfg.normalization == "LayerNorm" else 1)
    attention = (h * nq * d + 2 * h * ng * d + (nq * d + 2 * ng * d if qkv_bias else 0)
                 + nq * d * h + (h if cfg.add_bias_linear else 0) + qk_norms)
    if cfg.multi_latent_attention:
        attention = mla_parameters(cfg) + (h if cfg.add_bias_linear else 0)
    attention += nq if cfg.softmax_type == "learnable" else 0  # the attention sinks (softmax_offset)
    mlp = (h * fc1_width + ffn * h + (fc1_width + h if cfg.add_bias_linear else 0))
    layer_norms = (4 if cfg.sandwich_norms else 2) * norm  # + post_self_attn / post_mlp_layernorm
    if not cfg.pre_norms:  # no input_layernorm / pre_mlp_layernorm
        layer_norms -= 2 * norm
    layer = layer_norms + attention + mlp
    num_moe_layers = moe_layer_count(cfg)
    moe_layer = 0
    if num_moe_layers:
        def ffn_params(width):  # (+ fc1 and fc2 biases with add_bias_linear)
            fc1 = 2 * width if cfg.gated_mlp else width
            return h * fc1 + width * h + ((fc1 + h if width else 0) if cfg.add_bias_linear else 0)

        moe_layer = (layer_norms + attention + h * cfg.num_moe_experts
                     + cfg.num_moe_experts * ffn_params(cfg.moe_ffn_hidden_size)
                     + ffn_params(cfg.moe_shared_expert_intermediate_size or 0)
                     + (h if cfg.moe_shared_expert_gate else 0)
                     + (cfg.num_moe_experts if cfg.moe_router_enable_expert_bias else 0)
                     + (cfg.num_moe_experts if cfg.add_bias_linear else 0))  # the router's bias

    embeddings = padded_vocab_size * h
    if cfg.position_embedding_type == "learned_absolute":
        embeddings += cfg.max_position_embeddings * h
    output = h * padded_vocab_size if cfg.untie_embeddings_and_output_weights else 0
    mtp_moe = moe_layer_count(cfg, mtp=True) - num_moe_layers
    mtp = mtp_depths(cfg) * (3 * norm + 2 * h * h) + mtp_moe * moe_layer + (mtp_depths(cfg) - mtp_moe) * layer
    return (embeddings + (cfg.num_layers - num_moe_layers) * layer + num_moe_layers * moe_layer + norm + output
            + mtp)


def mla_parameters(cfg: JMegatronConfig) -> int:
    """Parameters of one multi-latent attention (:mod:`jmegatron.models.multi_latent_attention`,
    no bias): ``h rq + rq n (dn + dr)`` for the queries (``h n (dn + dr)`` without
    ``q_lora_rank``), ``h (rkv + dr) + rkv n (dn + dv)`` for keys and values, ``n dv h`` out,
    and with ``qk_layernorm`` the latent norms (``rq``, ``rkv``; doubled for LayerNorm), as
    Megatron-LM's theoretical_memory_usage.py counts them."""
    h, n = cfg.hidden_size, cfg.num_attention_heads
    dn, dr, dv, rq, rkv = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
    per_norm = 2 if cfg.normalization == "LayerNorm" else 1
    q = h * n * (dn + dr) if rq is None else h * rq + rq * n * (dn + dr)
    norms = per_norm * ((rq or 0) + rkv) if cfg.qk_layernorm else 0
    return q + h * (rkv + dr) + rkv * n * (dn + dv) + n * dv * h + norms


def num_active_parameters(cfg: JMegatronConfig, padded_vocab_size: int) -> int:
    """Parameters one token passes through: :func:`num_parameters` less, in every MoE
    layer, the ``num_moe_experts - moe_router_topk`` routed experts it is not sent to
    (``moe_ffn_hidden_size`` each: ``h * ffn`` (``h * 2ffn`` with SwiGLU) + ``ffn * h``). The
    router, the shared expert, attention, norms and embeddings count whole; the word
    embedding table counts whole too (as Mixtral's "12.9B active of 46.7B"), though a token
    reads one row. Equal to :func:`num_parameters` for a dense model. This is the count
    that ``6 * active parameters`` per token approximates Megatron's MoE FLOPs with."""
    total = num_parameters(cfg, padded_vocab_size)
    num_moe_layers = moe_layer_count(cfg, mtp=True)
    if not num_moe_layers:
        return total
    h, f = cfg.hidden_size, cfg.moe_ffn_hidden_size
    expert = h * (2 * f if cfg.gated_mlp else f) + f * h + (((2 * f if cfg.gated_mlp else f) + h)
                                                         if cfg.add_bias_linear else 0)
    return total - num_moe_layers * (cfg.num_moe_experts - cfg.moe_router_topk) * expert


def tflops_per_device(flops: float, seconds: float, num_devices: int) -> float:
    """Achieved model TFLOP/s per device: ``flops / (seconds * 1e12 * num_devices)``, as
    Megatron's ``throughput per GPU (TFLOP/s/GPU)`` in ``training_log``."""
    if seconds <= 0 or num_devices <= 0:
        raise ValueError(f"seconds={seconds} and num_devices={num_devices} must be > 0.")
    return flops / (seconds * 1e12 * num_devices)


def mfu(tflops_per_device: float, peak_tflops: float) -> float:
    """Model FLOPs utilization, a fraction in [0, 1] for sane inputs: achieved model
    TFLOP/s per device (see :func:`tflops_per_device`) over the device's peak TFLOP/s
    (both rates, same units). Raises ValueError for a non-positive peak."""
    if peak_tflops <= 0:
        raise ValueError(f"peak_tflops={peak_tflops} must be > 0 (set config.peak_tflops).")
    return tflops_per_device / peak_tflops
