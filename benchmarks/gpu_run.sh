#!/usr/bin/env bash
# One command for a lent GPU machine (docs/GPU.md): run from the checkout's root, with the
# three wheels of ../shared/gpu/whl/ copied into .whl/ and carried (an ignored path):
#
#   bash benchmarks/gpu_run.sh [STAGE ...]      # default: env check 345m_cudnn 7b_cudnn 345m_fp8 7b_fp8
#   bash benchmarks/gpu_run.sh check_pl 345m_pl 7b_pl  # the Pallas stages (a second command)
#
# Stages (each a separate process under its own timeout, so one crash or hang costs only
# itself; logs in $OUT/<stage>.log, a summary on stdout at the end):
#   env        nvidia-smi, versions, the resolved backend, TE, FP8 dtypes in the compiled HLO
#   check      gpu_check: XLA float32 (TF32, and HIGHEST) / bf16 / fp16, cuDNN attention, pure-JAX FP8
#              (gpt_tiny; per row the dots' precision, MFU against that dtype's peak, allocator memory)
#   check_pl   gpu_check: Pallas attention and cross-entropy
#   345m_cudnn gpt3_345m bf16, cuDNN attention (no attention dropout: cuDNN's dropout differs)
#   345m_pl    gpt3_345m bf16, Pallas attention
#   345m_fp8   gpt3_345m bf16 + FP8 (hybrid, delayed scaling, pure JAX)
#   7b_cudnn   Llama-2-7B's layer shape (hidden 4096, seq 4096), 4 of its 32 layers, bf16
#   7b_fp8     the same with FP8
#   7b_pl      the same in bf16 with Pallas attention
# The default stages take about 8 minutes (their timeouts add to 10: the last stage may be cut); the
# Pallas three about 5.
# Measured on an H200 (docs/GPU.md): a gpt3_345m process spends ~35 s before its first step
# and ~35 s compiling it; gpu_check ~20 s per variant.
set -u
O=${OUT:-/tmp/gpu_run}; mkdir -p "$O"; S=/tmp/site
STAGES=${*:-env check 345m_cudnn 7b_cudnn 345m_fp8 7b_fp8}

if [ ! -d $S/ml_collections ]; then
  python3 -m pip install -q --no-index --no-deps --target $S .whl/*.whl >"$O/pip.txt" 2>&1
fi
export PYTHONPATH=$PWD:$S${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# a plain checkout (not pip-installed): kernels/ and export/ import as jmegatron.* through links
python3 -c "import jmegatron.kernels, jmegatron.export" 2>/dev/null || {
  ln -sfn ../kernels jmegatron/kernels; ln -sfn ../export jmegatron/export; }

run() {  # run NAME TIMEOUT_S CMD...: the command's output in $O/NAME.log
  local n=$1 t=$2 s=$SECONDS; shift 2
  timeout -k 5 "$t" "$@" >"$O/$n.log" 2>&1
  echo "== $n rc=$? $((SECONDS - s))s" | tee -a "$O/summary.txt"
}

CHECK="python3 -m jmegatron.tools.gpu_check --steps 4"
TRAIN="python3 -m jmegatron.train --config.train_iters=12 --config.log_interval=1 --config.eval_interval=0
       --config.save=None --config.lr_warmup_iters=2"
T345="$TRAIN --config configs/gpt3_345m.py --config.micro_batch_size=8 --config.global_batch_size=32
      --config.attention_dropout=0.0 --config.hidden_dropout=0.0"
T7B="$TRAIN --config configs/llama2_7b.py --config.num_layers=4 --config.micro_batch_size=1
     --config.global_batch_size=8"

for st in $STAGES; do
  case $st in
    env) nvidia-smi >"$O/smi.txt" 2>&1
         run env 60 python3 benchmarks/gpu_env.py ;;
    check) run check 180 $CHECK --only xla cudnn fp8 ;;
    check_pl) run check_pl 100 $CHECK --only pallas ;;
    345m_cudnn) run 345m_cudnn 100 $T345 --config.attention_impl=cudnn ;;
    345m_pl) run 345m_pl 100 $T345 --config.attention_impl=pallas ;;
    345m_fp8) run 345m_fp8 100 $T345 --config.attention_impl=cudnn --config.fp8=hybrid ;;
    7b_cudnn) run 7b_cudnn 60 $T7B --config.attention_impl=cudnn ;;
    7b_fp8) run 7b_fp8 120 $T7B --config.attention_impl=cudnn --config.fp8=hybrid ;;
    7b_pl) run 7b_pl 100 $T7B --config.attention_impl=pallas ;;
    *) echo "unknown stage $st" ;;
  esac
done

# the summary: the device, the gpu_check tables, each run's last log line and its errors
grep -m1 -E 'H100|H200|NVIDIA' "$O/smi.txt" 2>/dev/null
cat "$O/env.log" 2>/dev/null | tail -n 25 | cut -c1-240
for f in "$O"/check*.log "$O"/345m*.log "$O"/7b*.log; do
  [ -f "$f" ] || continue
  echo "## $(basename "$f")"
  sed -n '/^variant/,$p' "$f" | cut -c1-200
  grep -m2 -E 'peak for MFU|resolved' "$f" | cut -c1-240
  grep -E ' iteration +[0-9]+/' "$f" | tail -1 | sed -E 's/\| (consumed|learning|global|loss scale|number)[^|]*//g' | cut -c1-400
  grep -E 'Error|error:|FAIL|Killed' "$f" | grep -v '^ *File' | tail -4 | cut -c1-300
done
cat "$O/summary.txt"
