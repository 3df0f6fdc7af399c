"""Mixture of experts in Megatron-Core's layout (megatron/core/transformer/moe/):
moe_utils (settings, routing and loss functions), router (TopKRouter), token_dispatcher,
experts (GroupedMLP), shared_experts, moe_layer (MoELayer). See docs/MOE.md."""
