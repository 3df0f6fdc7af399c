#!/usr/bin/env bash
# Issue 11's loss_chart demonstration: three short runs of a small GPT on mock data, each
# logged to stdout as Megatron logs (log_interval 1), compared with `bench loss_chart`
# (ByteMLPerf's criterion: mean relative lm-loss error over 50 steps below 0.2%):
#   base vs a run that differs only in the seed       -> FAIL expected (other init and data)
#   base vs a run that differs only in the layout     -> PASS expected (dp1 x 2 micro-batches
#                                                        vs dp2 x 1, same global batch, dropout 0)
# Charts, verdicts and JSON go to docs/bench/loss_chart/{seed,layout}/.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-docs/bench/loss_chart}
LOGS=${LOGS:-runs/loss_chart}
mkdir -p "$LOGS" "$OUT"
M="--config configs/gpt_tiny.py --config.mock_data=True --config.vocab_size=512 --config.num_layers=2
   --config.hidden_size=64 --config.ffn_hidden_size=256 --config.num_attention_heads=4 --config.seq_length=64
   --config.max_position_embeddings=64 --config.micro_batch_size=4 --config.global_batch_size=8
   --config.train_iters=60 --config.log_interval=1 --config.eval_interval=0 --config.save_interval=None
   --config.lr_warmup_iters=5 --config.hidden_dropout=0 --config.attention_dropout=0"
XLA_FLAGS=--xla_force_host_platform_device_count=1 $PY -m jmegatron.train $M > "$LOGS/base.log"
XLA_FLAGS=--xla_force_host_platform_device_count=1 $PY -m jmegatron.train $M --config.seed=4321 > "$LOGS/seed.log"
XLA_FLAGS=--xla_force_host_platform_device_count=2 $PY -m jmegatron.train $M > "$LOGS/layout_dp2.log"
grep -m1 "global batch" "$LOGS/base.log"; grep -m1 "global batch" "$LOGS/layout_dp2.log"
$PY -m jmegatron.bench loss_chart -b "$LOGS/base.log" -i "$LOGS/seed.log" -o "$OUT/seed" -s 50 -t 0.002
echo "seed: exit $?"
$PY -m jmegatron.bench loss_chart -b "$LOGS/base.log" -i "$LOGS/layout_dp2.log" -o "$OUT/layout" -s 50 -t 0.002
echo "layout: exit $?"
