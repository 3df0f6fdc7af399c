"""Megatron-LM's GPT "345M" model (GPT-2 medium shape), a reference config for FLOPs and
memory reports; it is not trained here (mock_data=True so it validates without data).

Settings follow Megatron-LM's ``examples/pretrain_gpt.sh`` ("Runs the 345M parameter
model"; the same argument style as ``examples/gpt3/train_gpt3_175b_distributed.sh``):
24 layers, hidden 1024, 16 heads, seq 1024, micro batch 4, global batch 8, lr 1.5e-4
cosine to 1e-5 over 320k of 500k iterations, 1% warmup (``--lr-warmup-fraction .01`` of
``--lr-decay-iters`` = 3200 iterations), weight decay 0.01, clip 1.0, GPT-2 BPE vocabulary
(50257 tokens, padded to 50304 by make_vocab_size_divisible_by=128). Megatron's
example uses ``--fp16``; jmegatron has bf16 only. With the padded vocabulary the model
has 354,871,296 parameters (jmegatron.reporting.flops.num_parameters).

ByteMLPerf's "345M" is another model: 12 layers x hidden 512 x 8 heads, 2048 positions,
64.6M parameters (configs/bytemlperf/gpt3_345m.py); its "857M" is this shape at seq 2048
(configs/bytemlperf/gpt3_857m.py).
"""

from jmegatron.config import base_config


def get_config():
    c = base_config("gpt2")
    c.num_layers = 24
    c.hidden_size = 1024
    c.ffn_hidden_size = 4096
    c.num_attention_heads = 16
    c.seq_length = 1024
    c.max_position_embeddings = 1024
    c.vocab_size = 50257  # GPT-2 BPE (gpt2-vocab.json)
    c.make_vocab_size_divisible_by = 128
    c.init_method_std = 0.02
    c.bf16 = True
    c.micro_batch_size = 4
    c.global_batch_size = 8
    c.train_iters = 500000
    c.lr = 1.5e-4
    c.min_lr = 1.0e-5
    c.lr_decay_style = "cosine"
    c.lr_decay_iters = 320000
    c.lr_warmup_iters = 3200  # --lr-warmup-fraction .01 x --lr-decay-iters 320000
    c.weight_decay = 1e-2
    c.clip_grad = 1.0
    c.log_interval = 100
    c.save_interval = 10000
    c.eval_interval = 1000
    c.eval_iters = 10
    c.split = "949,50,1"
    c.mock_data = True
    return c
