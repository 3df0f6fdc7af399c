"""Llama-2-7B (Touvron et al. 2023), a reference config for FLOPs and memory reports;
it is not trained here (mock_data=True so it validates without data).

Architecture as Megatron-LM's Llama-2 support (docs/llama_mistral.md and
tools/checkpoint/loader_llama_mistral.py: ``--untie-embeddings-and-output-weights
--use-rotary-position-embeddings --normalization RMSNorm --no-position-embedding
--swiglu --disable-bias-linear``, seq 4096): 32 layers, hidden 4096, ffn 11008,
32 heads (num_query_groups 32, i.e. MHA), rope base 10000, RMSNorm eps 1e-5, vocabulary
32000 (already a multiple of 128, so unpadded at tensor parallel size 1: 6,738,415,616
parameters). Optimizer and schedule from the Llama-2 paper: AdamW (0.9, 0.95, eps 1e-5),
lr 3e-4 cosine to 3e-5, 2000 warmup steps, weight decay 0.1, clip 1.0, 4M-token batches
(1024 x 4096), 2T tokens (~500k steps).
"""

from jmegatron.config import base_config


def get_config():
    c = base_config("llama")
    c.num_layers = 32
    c.hidden_size = 4096
    c.ffn_hidden_size = 11008
    c.num_attention_heads = 32
    c.num_query_groups = 32
    c.seq_length = 4096
    c.max_position_embeddings = 4096
    c.vocab_size = 32000  # Llama-2 SentencePiece tokenizer
    c.make_vocab_size_divisible_by = 128
    c.init_method_std = 0.02
    c.bf16 = True
    c.micro_batch_size = 1
    c.global_batch_size = 1024
    c.train_iters = 500000
    c.lr = 3e-4
    c.min_lr = 3e-5
    c.lr_decay_style = "cosine"
    c.lr_warmup_iters = 2000
    c.weight_decay = 0.1
    c.adam_beta1 = 0.9
    c.adam_beta2 = 0.95
    c.adam_eps = 1e-5
    c.clip_grad = 1.0
    c.log_interval = 10
    c.eval_interval = 1000
    c.eval_iters = 10
    c.save_interval = 5000
    c.split = "969,30,1"
    c.mock_data = True
    return c
