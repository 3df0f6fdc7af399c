"""Knowledge distillation: the pure-function core (losses and the loss balancer).

Follows Megatron-LM's ``megatron/post_training/algos/distillation.py`` (first added as
``megatron/inference/algos/distillation.py``) and its later home, NVIDIA ModelOpt's
``modelopt/torch/distill/plugins/megatron.py``. Teacher loading and the training-loop
integration live elsewhere.
"""

from jmegatron.distill.balancer import (
    INTERMEDIATE_PREFIX,
    LOGITS_LOSS_KEY,
    STUDENT_LOSS_KEY,
    LogitsAndIntermediatesLossBalancer,
    balance_losses,
)
from jmegatron.distill.losses import (
    COSINE_EPSILON,
    HiddenStateCosineLoss,
    LogitsKLLoss,
    MSELoss,
    ProjectionLayer,
    hidden_state_cosine_loss,
    intermediate_loss_from_name,
    logits_kl_loss,
    mse_loss,
)

__all__ = [
    "COSINE_EPSILON",
    "INTERMEDIATE_PREFIX",
    "LOGITS_LOSS_KEY",
    "STUDENT_LOSS_KEY",
    "HiddenStateCosineLoss",
    "LogitsAndIntermediatesLossBalancer",
    "LogitsKLLoss",
    "MSELoss",
    "ProjectionLayer",
    "balance_losses",
    "hidden_state_cosine_loss",
    "intermediate_loss_from_name",
    "logits_kl_loss",
    "mse_loss",
]
