"""ByteMLPerf's "gpt3 345M" training workload, with its script's exact model and training
arguments.

Source: bytedance/ByteMLPerf ``byte_train_perf/Megatron-LM/examples/gpt3/
train_gpt3_345M_distributed.sh`` (commit a30b4f97b174, 2025-08-18), run by
``examples/gpt3/run_345M.sh`` with ``MAX_TRAIN_STEPS=500000`` and its output compared by
``loss_chart.py -s 50 -t 0.002``.

Not Megatron-LM's 345M: ByteMLPerf keeps the name but runs 12 layers x hidden 512 x 8
heads (64,633,856 parameters with the padded GPT-2 vocabulary, ``python -m
jmegatron.tools.model_report --config configs/bytemlperf/gpt3_345m.py``), seq 1024 with
2048 learned positions. Megatron's own 345M (24 x 1024 x 16, seq 1024) is
``configs/gpt3_345m.py``.

Script arguments with no jmegatron field, and what stands for them:

* ``--vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt``: the GPT-2 BPE vocabulary,
  ``vocab_size`` 50257 (padded to 50304). ``--data-path``: the user's corpus, so
  ``mock_data`` is on here; pass ``--config.data_path=... --config.tokenizer_model=...``
  (a tokenizer.json of GPT-2's BPE) and ``--config.mock_data=False``.
* ``--load $PRETRAIN_MODEL_PATH``: the benchmark starts from a pretrained checkpoint
  (``--config.load``).
* ``--deterministic-mode``, ``NCCL_ALGO=Ring``, ``CUBLAS_WORKSPACE_CONFIG``: jmegatron's
  step is deterministic on its own (``bench determinism``); ``--attention-backend auto``:
  ``attention_impl`` "auto"; ``--data-cache-path``, wandb, tensorboard: logging only.
* Megatron defaults the script relies on and jmegatron shares: learned absolute
  positions, LayerNorm (eps 1e-5), GELU MLP of 4h, biases, tied output layer, dropout 0.1,
  adam_eps 1e-8, seed 1234.
"""

# The script's layout: 8 GPUs on one node (GPUS_PER_NODE=8, NUM_NODES=1), tp 1, pp 1, so
# data parallel 8. model_report uses it by default.
LAYOUT = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=8)

from jmegatron.config import base_config  # noqa: E402


def get_config():
    c = base_config("gpt2")  # Megatron's GPT defaults the script relies on (docstring)
    # GPT_MODEL_ARGS
    c.num_layers = 12
    c.hidden_size = 512
    c.num_attention_heads = 8
    c.seq_length = 1024
    c.max_position_embeddings = 2048
    c.ffn_hidden_size = 4 * 512  # Megatron's default 4h
    c.vocab_size = 50257  # GPT-2 BPE (gpt2-vocab.json)
    c.make_vocab_size_divisible_by = 128
    # TRAINING_ARGS
    c.micro_batch_size = 32
    c.global_batch_size = 512
    c.train_iters = 500000  # --train-iters $MAX_TRAIN_STEPS, 500000 in run_345M.sh
    c.weight_decay = 0.1
    c.adam_beta1 = 0.9
    c.adam_beta2 = 0.95
    c.init_method_std = 0.006
    c.clip_grad = 1.0
    c.bf16 = True
    c.lr = 6.0e-5
    c.lr_decay_style = "cosine"
    c.min_lr = 6.0e-6
    c.lr_decay_iters = 430000
    c.lr_warmup_fraction = 0.001  # Megatron: warm-up = 0.001 x lr_decay_iters = 430 iterations
    # MODEL_PARALLEL_ARGS: tp 1, pp 1 (LAYOUT above)
    c.tensor_model_parallel_size = 1
    c.pipeline_model_parallel_size = 1
    # DATA_ARGS
    c.split = "949,50,1"
    c.mock_data = True
    # EVAL_AND_LOGGING_ARGS
    c.log_interval = 1
    c.save_interval = 10000
    c.eval_interval = 1000
    c.eval_iters = 1000
    return c
