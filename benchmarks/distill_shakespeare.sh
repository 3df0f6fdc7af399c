#!/usr/bin/env bash
# Issue 4's experiment: a larger teacher, then gpt_tiny distilled from it, against gpt_tiny
# trained from scratch on the same tokens (the `make demo` run), all on Shakespeare with
# whole plays held out ("90,5,5"); then the step-time cost of distillation, measured
# alternately in one run. Needs `make demo` first (data, tokenizer, scratch baseline).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
D="--config.data_path=runs/demo/shakespeare_text_document --config.tokenizer_model=runs/demo/tokenizer.json"
$PY -m jmegatron.train --config configs/gpt_teacher.py $D --config.save=runs/distill/teacher
$PY -m jmegatron.train --config configs/distill_gpt_tiny.py $D --config.kd_teacher_load=runs/distill/teacher \
    --config.kd_cfg=configs/distill.yaml --config.save=runs/distill/student
for run in runs/distill/teacher runs/distill/student runs/demo/checkpoints; do
  for split in valid test; do echo "$run $split $($PY -m jmegatron.evaluate --load $run --split $split | tail -1)"; done
done
T="$D --config.train_iters=30 --config.log_interval=10 --config.eval_interval=0 --config.lr_warmup_iters=5"
for round in 1 2; do
  rm -rf /tmp/tm_plain /tmp/tm_kd
  echo "round $round student only"; $PY -m jmegatron.train --config configs/gpt_tiny.py $T --config.save=/tmp/tm_plain | grep "iteration       [23]0/"
  echo "round $round distillation"; $PY -m jmegatron.train --config configs/distill_gpt_tiny.py $T \
      --config.kd_teacher_load=runs/distill/teacher --config.save=/tmp/tm_kd | grep "iteration       [23]0/"
done
