#!/bin/bash
# Llama-3.x-style and Qwen3-style tiny models on Shakespeare: train, export hf, import back,
# evaluate both, quantize FP8 to the unified checkpoint (perplexity of each).
set -x
cd /work/main
export OMP_NUM_THREADS=1
PY=.venv/bin/python
for m in llama3_tiny qwen3_tiny; do
  W=runs/chain/$m
  $PY -m jmegatron.tools.demo --workdir $W --config configs/$m.py --train-iters 300 --no-peak || exit 1
  SPLIT=$($PY -c "import json;print(json.load(open('$W/checkpoints/config.json'))['split'])")
  rm -rf $W/hf $W/reimported $W/quant
  $PY -m jmegatron.export hf --load $W/checkpoints --out $W/hf || exit 1
  $PY -m jmegatron.export import-hf --hf $W/hf --out $W/reimported || exit 1
  for c in $W/checkpoints $W/reimported; do
    $PY -m jmegatron.evaluate --load $c --split test --data-path $W/shakespeare_text_document \
        --tokenizer-model $W/tokenizer.json --data-split "$SPLIT" || exit 1
  done
  $PY -m jmegatron.export quantize --load $W/reimported --quant-cfg fp8 --calib-data $W/shakespeare_text_document \
      --split "$SPLIT" --calib-size 512 --calib-batch-size 4 --calib-seq-length 256 --eval-seq-length 256 \
      --out $W/quant || exit 1
done
