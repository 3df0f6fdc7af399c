#!/usr/bin/env bash
# SFT on Shakespeare dialogue (issue 30): conversations made from the plays (system: the play,
# user: a speaker's line, assistant: the next speaker's reply), four plays held out; a tiny GPT
# pretrained on the plain text of the other plays, then fine-tuned on their conversations
# (configs/sft_tiny.py at 2 x 128: packed, loss on the assistant tokens only); the held-out
# assistant-token loss before SFT (the pretrained model), after SFT, and of the same SFT from
# scratch. About 6 minutes on the 2-core CPU machine. Logs and data in runs/sft_shakespeare/.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PY=${PY:-.venv/bin/python}
W=runs/sft_shakespeare; SRC=../shared/data/shakespeare
PT_ITERS=${PT_ITERS:-400}; SFT_ITERS=${SFT_ITERS:-300}
HELD="hamlet macbeth othello twelfth_night"
mkdir -p $W

# 1. conversations (JSONL, one per reply) and plain text, split by play
[ -f $W/heldout.jsonl ] || HELD="$HELD" $PY - "$SRC" "$W" <<'EOF'
import glob, json, os, re, sys
src, out = sys.argv[1:]
held = set(os.environ["HELD"].split())
speaker = re.compile(r"^([A-Z][A-Za-z' ]{0,28})\.$")
stage = {"Exit", "Exeunt", "Enter", "Scene", "Act", "Flourish", "Alarum", "Epilogue", "Prologue"}
files = {"train": open(f"{out}/train.jsonl", "w"), "heldout": open(f"{out}/heldout.jsonl", "w")}
os.makedirs(f"{out}/plain", exist_ok=True)
counts = {"train": 0, "heldout": 0}
for path in sorted(glob.glob(f"{src}/*_gut.txt")):
    play = os.path.basename(path)[:-len("_gut.txt")]
    text = open(path, encoding="utf-8").read()
    split = "heldout" if play in held else "train"
    if split == "train":  # pretraining text: the training plays only
        open(f"{out}/plain/{play}.txt", "w").write(text)
    title = text.strip().splitlines()[0].strip().title()
    speeches = []
    for block in re.split(r"\n\s*\n", text):
        lines = [l.strip() for l in block.strip().splitlines()]
        m = speaker.match(lines[0]) if lines else None
        if m and len(lines) > 1 and m.group(1).split()[0].title() not in stage:
            speeches.append((m.group(1).title(), " ".join(lines[1:])))
    for (a, said), (b, reply) in zip(speeches, speeches[1:]):
        if a != b and len(said) <= 400 and len(reply) <= 400:
            msgs = [{"role": "system", "content": f"A scene from {title}."},
                    {"role": "user", "content": f"{a}: {said}"}, {"role": "assistant", "content": f"{b}: {reply}"}]
            files[split].write(json.dumps({"messages": msgs}) + "\n")
            counts[split] += 1
print("conversations:", counts)
EOF

# 2. a 4096-token byte-level BPE of the training plays, with ChatML's tokens and template
[ -f $W/tok/tokenizer_config.json ] || {
  $PY -m jmegatron.tools.train_tokenizer --input $W/plain/*.txt --vocab-size 4096 --output $W/bpe.json
  $PY - "$W" <<'EOF'
import sys
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast
w = sys.argv[1]
tok = Tokenizer.from_file(f"{w}/bpe.json")
tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
            "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", chat_template=template).save_pretrained(f"{w}/tok")
EOF
}
# 3. .bin/.idx: the plain text for pretraining, the conversations (+ their loss masks) for SFT
[ -f $W/plain_text_document.idx ] || $PY -m jmegatron.tools.preprocess_data --input $W/plain \
    --output-prefix $W/plain --tokenizer-model $W/tok --append-eod --workers 2
for s in train heldout; do
  [ -f $W/${s}_messages_document_loss_mask.idx ] || $PY -m jmegatron.tools.preprocess_data --input $W/$s.jsonl \
      --json-keys messages --apply-chat-template --output-prefix $W/$s --tokenizer-model $W/tok --workers 2
done

# 4. pretrain on the plain text, then SFT from it (finetune: fresh optimizer and iteration count),
#    and the same SFT from scratch
SIZE="--config.num_layers=2 --config.hidden_size=128 --config.ffn_hidden_size=512 --config.num_attention_heads=4
      --config.tokenizer_model=$W/tok --config.log_interval=50 --config.eval_interval=0 --config.lr_warmup_iters=20"
[ -d $W/pretrain/$PT_ITERS ] || $PY -m jmegatron.train --config configs/gpt_tiny.py $SIZE \
    --config.data_path=$W/plain_text_document --config.split=98,2,0 --config.train_iters=$PT_ITERS \
    --config.save_interval=$PT_ITERS --config.save=$W/pretrain > $W/pretrain.log 2>&1 || { tail -20 $W/pretrain.log; exit 1; }
SFT="--config.data_path=$W/train_messages_document --config.split=98,2,0 --config.train_iters=$SFT_ITERS
     --config.save_interval=$SFT_ITERS --config.lr=3e-4 --config.min_lr=3e-5 --config.lr_decay_style=cosine"
[ -d $W/sft/$SFT_ITERS ] || $PY -m jmegatron.train --config configs/sft_tiny.py $SIZE $SFT \
    --config.load=$W/pretrain --config.finetune=True --config.save=$W/sft > $W/sft.log 2>&1 || { tail -20 $W/sft.log; exit 1; }
[ -d $W/sft_scratch/$SFT_ITERS ] || $PY -m jmegatron.train --config configs/sft_tiny.py $SIZE $SFT --config.lr=1e-3 \
    --config.min_lr=1e-4 --config.save=$W/sft_scratch > $W/sft_scratch.log 2>&1 || { tail -20 $W/sft_scratch.log; exit 1; }

# 5. held-out loss on the assistant tokens (every held-out pack once): the pretrained model read as an
#    SFT model (same sizes), the fine-tuned one, the scratch one; then jmegatron.evaluate on the SFT run
$PY - "$W" <<'EOF' | tee $W/results.txt
import sys
import numpy as np
from jmegatron.data.indexed_dataset import IndexedDataset
from jmegatron.data.sft_dataset import SFTDataset
from jmegatron.training.loop import evaluate
from jmegatron.data.builder import build_datasets
from jmegatron.training.run import restore_run_params
w = sys.argv[1]
held = f"{w}/heldout_messages_document"
packs = SFTDataset(IndexedDataset(held), np.arange(len(IndexedDataset(held))), None, 256, 1234, pad_id=0)
iters = len(packs) // 8
tokens = sum(float(packs[i]["loss_mask"].sum()) for i in range(len(packs)))
print(f"held-out: {len(IndexedDataset(held))} conversations, {len(packs)} packs of 256, {tokens:.0f} assistant "
      f"tokens; {iters} batches of 8 evaluated")
for name in ("pretrain", "sft", "sft_scratch"):
    run, params, meta = restore_run_params(f"{w}/{name}", None, hidden_dropout=0.0, attention_dropout=0.0, sft=True,
                                           reset_attention_mask=True, data_path=held, split="0,0,1",
                                           eval_iters=iters)
    _, _, test = build_datasets(run.cfg, run.global_batch_size)
    loss = evaluate(run, params, test, iters)
    print(f"{name:12s} (iteration {meta['iteration']}): held-out assistant-token loss {loss:.4f} "
          f"(ppl {np.exp(loss):.1f})")
EOF
$PY -m jmegatron.evaluate --load $W/sft --split test --data-path $W/heldout_messages_document --data-split 0,0,1 \
    --eval-iters "$(grep -oE '[0-9]+ batches' $W/results.txt | cut -d' ' -f1)" | tail -1 | tee -a $W/results.txt
