#!/usr/bin/env bash
# Issue 11's loss_chart demonstration: gpt_tiny on Shakespeare with its real settings
# (dropout 0.1 in hidden states and attention), 60 iterations logged as Megatron logs them
# (log_interval 1), compared with `bench loss_chart` (ByteMLPerf's criterion: mean relative
# lm-loss error over 50 steps below 0.2%):
#   base (1 device)  vs the same run with another seed                  -> FAIL expected
#   base (1 device)  vs 8 devices: dp 4 x tp 2 + sequence parallel +
#                       distributed optimizer, the same global batch     -> PASS expected
# The data comes from `make demo` (runs/demo: tokenizer and .bin/.idx). Charts, verdicts
# and JSON go to docs/bench/loss_chart/{seed,layout}/; the logs to runs/loss_chart/.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEMO=${DEMO:-runs/demo}
OUT=${OUT:-docs/bench/loss_chart}
LOGS=${LOGS:-runs/loss_chart}
if [ ! -f "$DEMO/tokenizer.json" ]; then
  echo "no $DEMO/tokenizer.json: run make demo first (or DEMO=<its --workdir>)" >&2
  exit 2
fi
mkdir -p "$LOGS" "$OUT"
M="--config configs/gpt_tiny.py --config.data_path=$DEMO/shakespeare_text_document
   --config.tokenizer_model=$DEMO/tokenizer.json --config.train_iters=60 --config.log_interval=1
   --config.eval_interval=0 --config.save_interval=None --config.lr_warmup_iters=10"
XLA_FLAGS=--xla_force_host_platform_device_count=1 $PY -m jmegatron.train $M > "$LOGS/base.log"
XLA_FLAGS=--xla_force_host_platform_device_count=1 $PY -m jmegatron.train $M --config.seed=4321 > "$LOGS/seed.log"
XLA_FLAGS=--xla_force_host_platform_device_count=8 $PY -m jmegatron.train $M \
  --config.tensor_model_parallel_size=2 --config.sequence_parallel=True \
  --config.use_distributed_optimizer=True --config.micro_batch_size=2 > "$LOGS/layout_dp4_tp2.log"
grep -m1 "global batch" "$LOGS/base.log"; grep -m1 "global batch" "$LOGS/layout_dp4_tp2.log"
$PY -m jmegatron.bench loss_chart -b "$LOGS/base.log" -i "$LOGS/seed.log" -o "$OUT/seed" -s 50 -t 0.002
echo "seed: exit $?"
$PY -m jmegatron.bench loss_chart -b "$LOGS/base.log" -i "$LOGS/layout_dp4_tp2.log" -o "$OUT/layout" -s 50 -t 0.002
echo "layout: exit $?"
