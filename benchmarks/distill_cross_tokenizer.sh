#!/bin/bash
# Distillation across tokenizers on Shakespeare: a teacher (6 x 384) trained on a byte-level
# *Unigram* tokenizer of the plays (4096 pieces; unlike a smaller BPE of the same corpus, its
# vocabulary is not nested in the student's 8192-token BPE), cached at the student's positions
# matched by text, then the gpt_tiny student trained with ULD alone and with GOLD's hybrid
# (the KL over the shared tokens + ULD), both at kd_loss_alpha 0.5 (CE + KD). Compared with
# runs/distill_chain/scratch (benchmarks/distill_chain.sh). Logs in runs/distill_chain/.
set -x
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
PY=${PY:-.venv/bin/python}
W=runs/distill_chain; D=runs/chain/llama3_tiny; U=$W/unigram
ITERS=${ITERS:-150}
mkdir -p $U
DATA="--config.data_path=$D/shakespeare_text_document --config.tokenizer_model=$D/tokenizer.json
      --config.train_iters=$ITERS --config.eval_interval=0 --config.log_interval=50 --config.save_interval=$ITERS"
[ -f $U/tokenizer.json ] || $PY - <<EOF || exit 1
import glob
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from jmegatron.data.tokenizer import iter_documents
tok = Tokenizer(models.Unigram())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.UnigramTrainer(vocab_size=4096, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
files = sorted(glob.glob("../shared/data/shakespeare/*_gut.txt"))
tok.train_from_iterator((d for f in files for d in iter_documents(f)), trainer=trainer)
tok.save("$U/tokenizer.json")
EOF
[ -f $U/shakespeare_text_document.idx ] || $PY -m jmegatron.tools.preprocess_data \
    --input ../shared/data/shakespeare/*_gut.txt --output-prefix $U/shakespeare --tokenizer-model $U/tokenizer.json \
    --append-eod --workers 2 > $U/pre.log 2>&1 || exit 1
[ -d $W/teacher_unigram/$ITERS ] || $PY -m jmegatron.train --config configs/gpt_teacher.py \
    --config.data_path=$U/shakespeare_text_document --config.tokenizer_model=$U/tokenizer.json \
    --config.train_iters=$ITERS --config.eval_interval=0 --config.log_interval=50 --config.save_interval=$ITERS \
    --config.save=$W/teacher_unigram > $W/teacher_unigram.log 2>&1 || { tail -20 $W/teacher_unigram.log; exit 1; }
[ -f $W/cache_unigram/progress.json ] && grep -q "\"samples_done\": $((ITERS * 8))" $W/cache_unigram/progress.json || \
  $PY -m jmegatron.tools.cache_teacher_logits --config configs/distill_gpt_tiny.py $DATA \
      --config.kd_teacher_load=$W/teacher_unigram --teacher-tokenizer $U/tokenizer.json --output $W/cache_unigram \
      --top-k 64 --batch-size 16 > $W/cache_unigram.log 2>&1 || { tail -20 $W/cache_unigram.log; exit 1; }
printf 'kd_loss_alpha: 0.5\n' > $W/uld_a05.yaml
printf 'cross_tokenizer_loss: hybrid\nkd_loss_alpha: 0.5\n' > $W/hybrid_a05.yaml
for n in uld hybrid; do
  [ -d $W/unigram_${n}_a05/$ITERS ] || $PY -m jmegatron.train --config configs/distill_gpt_tiny.py $DATA \
      --config.save=$W/unigram_${n}_a05 --config.kd_teacher_logits_path=$W/cache_unigram \
      --config.kd_cfg=$W/${n}_a05.yaml > $W/unigram_${n}_a05.log 2>&1 || { tail -20 $W/unigram_${n}_a05.log; exit 1; }
done
SPLIT=$($PY -c "import json;print(json.load(open('$W/scratch/config.json'))['split'])" 2>/dev/null || echo "90,5,5")
$PY -m jmegatron.evaluate --load $W/teacher_unigram --split test --data-path $U/shakespeare_text_document \
    --tokenizer-model $U/tokenizer.json --data-split "$SPLIT" > $W/teacher_unigram.eval 2>&1
echo "teacher_unigram (its own tokens): $(grep -E 'loss' $W/teacher_unigram.eval | tail -1 | cut -c1-200)"
$PY -c "
import numpy as np
from jmegatron.data.tokenizer import load_tokenizer
from jmegatron.distill.cross_tokenizer import vocabulary_map
ids = np.load('$W/cache_unigram/ids.npy', mmap_mode='r')[:200]
m = vocabulary_map(load_tokenizer('$U/tokenizer.json'), load_tokenizer('$D/tokenizer.json'), 1 + int(ids.max()))
ok = ids[..., 0] >= 0
print(f'positions matched by text {ok.mean():.3f}; teacher top-64 entries the student vocabulary has '
      f'{(m[np.maximum(ids, 0)] >= 0)[ok].mean():.3f}')"
for n in scratch unigram_uld_a05 unigram_hybrid_a05; do
  [ -f $W/$n.eval ] || $PY -m jmegatron.evaluate --load $W/$n --split test --data-path $D/shakespeare_text_document \
      --tokenizer-model $D/tokenizer.json --data-split "$SPLIT" > $W/$n.eval 2>&1
  echo "$n: $(grep -E 'loss' $W/$n.eval | tail -1 | cut -c1-200)"
done
