"""Bad input fails before work starts, says what and how to fix it, and changes nothing on disk.

Issue 16 item 7. One table (``CASES``) of bad configs, data files, checkpoints and CLI
arguments of ``python -m jmegatron.train / evaluate / export / tools.preprocess_data``. Every
row runs its CLI's ``main`` in this process against one shared "world" directory (a tokenizer, a
preprocessed dataset, a finished 2-iteration run with config.json, metrics.jsonl and a
checkpoint, another model's checkpoint, broken copies of the data and checkpoints) and asserts:

* the command fails (exit status 2, or argparse's 2, or the named exception),
* its message matches every pattern of the row (the field / file, and the fix),
* nothing under the world directory changed: the names, sizes, mtimes and SHA-256 of every
  file and the set of directories are equal before and after.

``python tests/test_bad_input.py`` runs the same table outside pytest and prints the markdown
table of docs/RELIABILITY.md (``## Bad input``); ``--write docs/RELIABILITY.md`` replaces it there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import io
import os
import re
import shutil
import struct
import sys
from typing import Callable

if __name__ == "__main__":  # the table script: same device set-up as tests/conftest.py
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

# ---------------------------------------------------------------- the world

TINY_CONFIG = '''\
from jmegatron.config import base_config


def get_config():
    c = base_config()
    c.num_layers, c.hidden_size, c.num_attention_heads = 2, 32, 2
    c.seq_length = c.max_position_embeddings = 32
    c.micro_batch_size, c.global_batch_size = 1, 8
    c.train_iters, c.log_interval, c.eval_interval, c.eval_iters = 2, 1, 0, 1
    c.lr, c.lr_warmup_iters, c.peak_tflops = 1e-3, 0, 1.0
    c.split = "80,10,10"
    c.data_path = {data!r}
    c.tokenizer_model = {tok!r}
    return c
'''


@dataclasses.dataclass
class World:
    root: str

    def p(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    @property
    def data(self) -> str:  # the good dataset prefix
        return self.p("data", "corpus_text_document")

    @property
    def config(self) -> str:
        return self.p("tiny.py")

    @property
    def tokenizer(self) -> str:
        return self.p("tokenizer.json")

    @property
    def run(self) -> str:  # a finished run: config.json, metrics.jsonl, checkpoint 2
        return self.p("run")


def _copy_dataset(src: str, dst: str) -> None:
    for ext in (".bin", ".idx"):
        shutil.copyfile(src + ext, dst + ext)


def build_world(root: str) -> World:
    """Write every input the table needs under ``root`` (a few seconds; nothing is trained)."""
    from jmegatron.config import load_config_file
    from jmegatron.data.tokenizer import train_bpe_tokenizer
    from jmegatron.tools import preprocess_data
    from jmegatron.checkpoint import checkpointing
    from jmegatron.training.run import build, checkpoint_meta

    w = World(root)
    os.makedirs(w.p("raw"))
    rng = np.random.default_rng(0)
    words = ["the", "king", "queen", "sword", "night", "love", "crown", "speak", "death", "fair"]
    for i in range(12):
        with open(w.p("raw", f"doc{i:02d}.txt"), "w") as f:
            f.write(" ".join(rng.choice(words, size=120)) + "\n")
    train_bpe_tokenizer([w.p("raw", f"doc{i:02d}.txt") for i in range(12)], 300, w.tokenizer)
    preprocess_data.preprocess([w.p("raw")], w.p("data", "corpus"), w.tokenizer, append_eod=True, log=None)
    with open(w.config, "w") as f:
        f.write(TINY_CONFIG.format(data=w.data, tok=w.tokenizer))
    with open(w.p("noget.py"), "w") as f:
        f.write("x = 1\n")
    with open(w.p("syntax.py"), "w") as f:
        f.write("def get_config(:\n    pass\n")
    with open(w.p("raw", "bad.jsonl"), "w") as f:
        f.write('{"text": "the king"}\n{"text": "the queen"\n')

    # broken datasets (the good one is never touched)
    os.makedirs(w.p("bad"))
    size = os.path.getsize(w.data + ".bin")
    _copy_dataset(w.data, w.p("bad", "truncated"))
    with open(w.p("bad", "truncated.bin"), "r+b") as f:
        f.truncate(size - 10)
    _copy_dataset(w.data, w.p("bad", "mismatched"))  # .idx of a smaller dataset beside this .bin
    from jmegatron.data.indexed_dataset import IndexedDatasetBuilder
    with IndexedDatasetBuilder(w.p("bad", "small.bin"), dtype=np.uint16) as b:
        b.add_document(np.arange(40), [40])
        b.finalize(w.p("bad", "mismatched.idx"))
    os.remove(w.p("bad", "small.bin"))
    _copy_dataset(w.data, w.p("bad", "int32"))  # the index claims int32, the tokens are uint16
    with open(w.p("bad", "int32.idx"), "r+b") as f:
        f.seek(17)
        f.write(struct.pack("<B", 4))
    _copy_dataset(w.data, w.p("bad", "badcode"))  # no dtype has code 42
    with open(w.p("bad", "badcode.idx"), "r+b") as f:
        f.seek(17)
        f.write(struct.pack("<B", 42))
    with IndexedDatasetBuilder(w.p("bad", "bigvocab.bin"), dtype=np.int32) as b:  # another tokenizer's ids
        for i in range(12):
            b.add_document(rng.integers(0, 50257, size=100), [100])
        b.finalize(w.p("bad", "bigvocab.idx"))
    _copy_dataset(w.data, w.p("bad", "notidx"))
    with open(w.p("bad", "notidx.idx"), "wb") as f:
        f.write(b"this is not an index file\n" * 4)

    # "a finished run": what pretrain leaves in `save` after 2 iterations (config.json,
    # metrics.jsonl, checkpoint 2), written without compiling a train step
    import jax

    from jmegatron.parallel.mesh import create_mesh

    cfg = load_config_file(w.config, {"save": w.run})
    one_device = create_mesh(cfg, jax.devices()[:1])  # any layout restores into any other

    def zeros_state(run):  # a TrainState of the run's shapes and dtypes, without compiling its init
        return jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype)), run.abstract_state)

    run = build(cfg, one_device)

    def save(directory, state, meta):
        ck = checkpointing.Checkpointer(directory)
        ck.save(meta["iteration"], state, meta)
        ck.close()

    run_meta = checkpoint_meta(cfg, run, 2, 2 * cfg.global_batch_size)
    save(w.run, zeros_state(run), run_meta)
    with open(w.p("run", "config.json"), "w") as f:
        f.write(cfg.to_json())
    with open(w.p("run", "metrics.jsonl"), "w") as f:
        f.write('{"iteration": 1, "lm_loss": 5.7}\n{"iteration": 2, "lm_loss": 5.6}\n')
    other_cfg = cfg.replace(hidden_size=64, save=None)
    other = build(other_cfg, one_device)
    other_state = zeros_state(other)
    save(w.p("other_model"), other_state, checkpoint_meta(other_cfg, other, 0, 0))
    save(w.p("wrong_shapes"), other_state, run_meta)  # this model's meta, another's arrays
    moved = dict(run_meta, config=dict(run_meta["config"], data_path=w.p("moved", "corpus_text_document")))
    save(w.p("data_moved"), zeros_state(run), moved)  # its config's data is gone
    for item in ("meta", "state"):
        shutil.copytree(w.run, w.p(f"no_{item}"))
        shutil.rmtree(w.p(f"no_{item}", "2", item))
    os.makedirs(w.p("empty"))
    os.makedirs(w.p("hf_out"))
    with open(w.p("hf_out", "keep.txt"), "w") as f:
        f.write("an earlier export\n")
    return w


def snapshot(root: str) -> dict:
    """{relative path: (size, mtime_ns, sha256)} of every file, {relative dir: None} of every
    directory under ``root``."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            snap[os.path.relpath(os.path.join(dirpath, d), root) + "/"] = None
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            snap[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns, digest)
    return snap


def snapshot_diff(before: dict, after: dict) -> list[str]:
    """Human-readable differences between two snapshots (empty: nothing changed)."""
    out = [f"removed {k}" for k in before if k not in after]
    out += [f"created {k}" for k in after if k not in before]
    out += [f"changed {k}" for k in before if k in after and before[k] != after[k]]
    return sorted(out)


# ---------------------------------------------------------------- the CLIs, in this process

def _call(main: Callable, argv: list[str]) -> tuple[object, str]:
    """(exit status or exception type name, stderr + message) of ``main(argv)``."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = main(argv)
        except SystemExit as e:
            if isinstance(e.code, str):  # SystemExit("tool: error: ...") prints and exits 1
                return 1, err.getvalue() + e.code
            return e.code, err.getvalue()
        except Exception as e:  # noqa: BLE001 - reported, the row says what it expects
            return type(e).__name__, err.getvalue() + f"{type(e).__name__}: {e}"
    return status, err.getvalue()


def train(w: World, *args: str):
    from jmegatron.train import main

    return _call(main, list(args))


def train_cfg(w: World, *overrides: str):
    return train(w, "--config", w.config, *overrides)


def evaluate(w: World, *args: str):
    from jmegatron.evaluate import main

    return _call(main, list(args))


def export(w: World, *args: str):
    from jmegatron.export.__main__ import main

    return _call(main, list(args))


def preprocess(w: World, *args: str):
    from jmegatron.tools.preprocess_data import main

    return _call(main, list(args))


@dataclasses.dataclass
class Case:
    id: str
    input: str  # what is wrong, as the table shows it
    act: Callable[[World], tuple[object, str]]
    status: object  # expected exit status (or exception type name)
    patterns: tuple[str, ...]  # each must match the message: the field / file and the fix
    slow: bool = False  # imports ModelOpt (about 20 s on this machine): marked slow, CI still runs it


C = Case
CASES = [
    # -- configs (python -m jmegatron.train)
    C("config-unknown-field", "`--config.hiden_size=64` (typo)",
      lambda w: train_cfg(w, "--config.hiden_size=64"), 2, (r"hiden_size", r"hidden_size")),
    C("config-bad-value", "`--config.train_iters=ten`",
      lambda w: train_cfg(w, "--config.train_iters=ten"), 2,
      (r"config\.train_iters='ten'", r"e\.g\. --config\.train_iters=\d+")),
    C("config-bad-bool", "`--config.mock_data=maybe`",
      lambda w: train_cfg(w, "--config.mock_data=maybe"), 2, (r"config\.mock_data", r"True or False")),
    C("config-heads", "`--config.num_attention_heads=3` with hidden_size 32",
      lambda w: train_cfg(w, "--config.num_attention_heads=3"), 2,
      (r"num_attention_heads", r"hidden_size")),
    C("config-seq-length", "`--config.seq_length=64` > max_position_embeddings 32",
      lambda w: train_cfg(w, "--config.seq_length=64"), 2,
      (r"config\.seq_length=64", r"raise max_position_embeddings")),
    C("config-bad-choice", "`--config.attention_impl=flash`",
      lambda w: train_cfg(w, "--config.attention_impl=flash"), 2, (r"config\.attention_impl='flash'", r"one of")),
    C("config-syntax-error", "`--config` a file with a syntax error",
      lambda w: train(w, "--config", w.p("syntax.py")), 2, (r"syntax\.py", r"line 1", r"fix the Python syntax")),
    C("config-no-get-config", "`--config` a file without get_config()",
      lambda w: train(w, "--config", w.p("noget.py")), 2, (r"noget\.py", r"get_config\(\)", r"configs/gpt_tiny\.py")),
    C("config-batch-for-devices", "`--config.global_batch_size=12` on 8 devices (micro batch 1)",
      lambda w: train_cfg(w, "--config.global_batch_size=12", f"--config.save={w.run}"), 2,
      (r"config\.global_batch_size=12", r"data_parallel_size=8")),
    C("config-tp-for-devices", "`--config.tensor_model_parallel_size=16` on 8 devices",
      lambda w: train_cfg(w, "--config.tensor_model_parallel_size=16", f"--config.save={w.run}"), 2,
      (r"tensor\(16\)", r"8 devices")),
    C("config-file-missing", "`--config nothere.py`",
      lambda w: train(w, "--config", w.p("nothere.py")), 2, (r"nothere\.py",)),
    C("config-no-data", "`--config.data_path=None` (and mock_data False)",
      lambda w: train_cfg(w, "--config.data_path=None"), 2, (r"config\.data_path", r"preprocess_data|mock_data")),
    # -- data files, against the existing run's directory (config.json, metrics.jsonl, checkpoint)
    C("data-missing", "`--config.data_path=` a prefix with no files, `save` = an existing run",
      lambda w: train_cfg(w, f"--config.data_path={w.p('data', 'corpus')}", f"--config.save={w.run}"), 2,
      (r"corpus", r"_text_document|preprocess_data")),
    C("data-bad-split", "`--config.split=90,x`",
      lambda w: train_cfg(w, "--config.split=90,x", f"--config.save={w.run}"), 2,
      (r"split='90,x'", r"949,50,1")),
    C("data-blend-odd", "`--config.data_path='0.5 PREFIX 0.5'` (a weight without its prefix)",
      lambda w: train_cfg(w, f"--config.data_path=0.5 {w.data} 0.5", f"--config.save={w.run}"), 2,
      (r"data_path=", r"'0\.5' looks like a weight", r"'weight prefix' pairs")),
    C("data-truncated-bin", "truncated `.bin` (10 bytes short), `save` = an existing run",
      lambda w: train_cfg(w, f"--config.data_path={w.p('bad', 'truncated')}", f"--config.save={w.run}"), 2,
      (r"truncated\.bin", r"preprocess_data")),
    C("data-mismatched-idx", "`.idx` of another dataset beside the `.bin`",
      lambda w: train_cfg(w, f"--config.data_path={w.p('bad', 'mismatched')}", f"--config.save={w.run}"), 2,
      (r"mismatched\.(bin|idx)", r"preprocess_data")),
    C("data-wrong-dtype", "`.idx` says int32, the `.bin` holds uint16 tokens",
      lambda w: train_cfg(w, f"--config.data_path={w.p('bad', 'int32')}", f"--config.save={w.run}"), 2,
      (r"int32\.(bin|idx)", r"int32", r"preprocess_data")),
    C("data-unknown-dtype", "`.idx` dtype code 42",
      lambda w: train_cfg(w, f"--config.data_path={w.p('bad', 'badcode')}", f"--config.save={w.run}"), 2,
      (r"badcode\.idx", r"42", r"preprocess_data")),
    C("data-not-an-index", "`.idx` is a text file",
      lambda w: train_cfg(w, f"--config.data_path={w.p('bad', 'notidx')}", f"--config.save={w.run}"), 2,
      (r"notidx\.idx", r"MMIDIDX", r"preprocess_data")),
    C("data-other-tokenizer", "data tokenized with a 50257-id vocabulary, tokenizer of 299 ids",
      lambda w: train_cfg(w, f"--config.data_path={w.p('bad', 'bigvocab')}", f"--config.save={w.run}"), 2,
      (r"bigvocab\.bin", r"outside the vocabulary of 299 ids", r"preprocess_data|tokenizer_model")),
    C("data-tokenizer-missing", "`--config.tokenizer_model=` a missing file",
      lambda w: train_cfg(w, f"--config.tokenizer_model={w.p('none.json')}", f"--config.save={w.run}"), 2,
      (r"none\.json", r"train_tokenizer")),
    # -- checkpoints
    C("ckpt-other-model", "rerun an existing run with `--config.hidden_size=64`",
      lambda w: train_cfg(w, "--config.hidden_size=64", "--config.num_attention_heads=2",
                          f"--config.save={w.run}"), 2,
      (r"hidden_size: checkpoint 32 vs config 64", r"checkpoint's config|new --config\.save")),
    C("ckpt-load-other-model", "`--config.load=` another model's checkpoint (hidden 64), new `save`",
      lambda w: train_cfg(w, f"--config.load={w.p('other_model')}", f"--config.save={w.p('new_run')}"), 2,
      (r"other_model", r"hidden_size: checkpoint 64 vs config 32", r"checkpoint's config|new --config\.save")),
    C("ckpt-wrong-shapes", "checkpoint whose arrays have other shapes than its meta says",
      lambda w: train_cfg(w, f"--config.load={w.p('wrong_shapes')}", f"--config.save={w.p('new_run')}"), 2,
      (r"wrong_shapes", r"shape", r"config\.load")),
    C("ckpt-missing-meta", "checkpoint step without its `meta` item",
      lambda w: train_cfg(w, f"--config.load={w.p('no_meta')}", f"--config.save={w.p('new_run')}"), 2,
      (r"no_meta", r"meta", r"config\.load")),
    C("ckpt-missing-state", "checkpoint step without its `state` item",
      lambda w: train_cfg(w, f"--config.load={w.p('no_state')}", f"--config.save={w.p('new_run')}"), 2,
      (r"no_state", r"state", r"config\.load")),
    C("ckpt-load-empty", "`--config.load=` a directory with no checkpoint",
      lambda w: train_cfg(w, f"--config.load={w.p('empty')}", f"--config.save={w.p('new_run')}"), 2,
      (r"config\.load=.*empty", r"holds no checkpoint")),
    # -- CLI arguments
    C("train-unknown-flag", "`python -m jmegatron.train --config F --lrr 1e-3`",
      lambda w: train_cfg(w, "--lrr", "1e-3"), 2, (r"unknown --lrr 1e-3", r"did you mean --lr\b", r"--config\.<field>")),
    C("train-refused-flag", "`python -m jmegatron.train --config F --squared-relu` (a Megatron flag of no feature here)",
      lambda w: train_cfg(w, "--squared-relu"), 2, (r"refused --squared-relu", r"not built", r"--swiglu")),
    C("train-no-config", "`python -m jmegatron.train --config.lr=0.1` (no --config)",
      lambda w: train(w, "--config.lr=0.1"), 2, (r"--config is required", r"usage")),
    C("evaluate-unknown-flag", "`python -m jmegatron.evaluate --load RUN --iters 5`",
      lambda w: evaluate(w, "--load", w.run, "--iters", "5"), 2, (r"--iters", r"usage")),
    C("evaluate-bad-split", "`python -m jmegatron.evaluate --load RUN --split train`",
      lambda w: evaluate(w, "--load", w.run, "--split", "train"), 2, (r"--split", r"'valid', 'test'")),
    C("evaluate-bad-iters", "`python -m jmegatron.evaluate --load RUN --eval-iters -1`",
      lambda w: evaluate(w, "--load", w.run, "--eval-iters", "-1"), 2, (r"--eval-iters", r"-1", r">= 1|positive")),
    C("evaluate-no-checkpoint", "`python -m jmegatron.evaluate --load EMPTY_DIR`",
      lambda w: evaluate(w, "--load", w.p("empty")), 2, (r"empty", r"no checkpoint", r"save directory")),
    C("evaluate-missing-meta", "`python -m jmegatron.evaluate --load` a step without `meta`",
      lambda w: evaluate(w, "--load", w.p("no_meta")), 2, (r"no_meta", r"meta")),
    C("evaluate-data-moved", "`python -m jmegatron.evaluate --load` a run whose data was moved",
      lambda w: evaluate(w, "--load", w.p("data_moved")), 2, (r"moved", r"corpus_text_document", r"preprocess_data")),
    C("export-unknown-command", "`python -m jmegatron.export gguf`",
      lambda w: export(w, "gguf"), 2, (r"gguf", r"choose from")),
    C("export-unknown-flag", "`python -m jmegatron.export hf --load RUN --out D --fp16`",
      lambda w: export(w, "hf", "--load", w.run, "--out", w.p("hf_new"), "--fp16"), 2, (r"--fp16", r"usage")),
    C("export-bad-dtype", "`python -m jmegatron.export hf ... --dtype float8`",
      lambda w: export(w, "hf", "--load", w.run, "--out", w.p("hf_new"), "--dtype", "float8"), 2,
      (r"--dtype", r"float8", r"choose from")),
    C("export-out-not-empty", "`python -m jmegatron.export hf --out` a non-empty folder",
      lambda w: export(w, "hf", "--load", w.run, "--out", w.p("hf_out")), 2, (r"hf_out", r"choose a new folder")),
    C("export-no-checkpoint", "`python -m jmegatron.export hf --load EMPTY_DIR`",
      lambda w: export(w, "hf", "--load", w.p("empty"), "--out", w.p("hf_new")), 2,
      (r"--load .*empty", r"no checkpoint", r"save directory")),
    C("export-quantize-bad-cfg", "`python -m jmegatron.export quantize --quant-cfg int3`",
      lambda w: export(w, "quantize", "--load", w.run, "--quant-cfg", "int3", "--calib-data", w.data,
                       "--out", w.p("q")), 2, (r"--quant-cfg", r"int3", r"choose from")),
    C("export-quantize-truncated-calib", "`python -m jmegatron.export quantize --calib-data` a truncated `.bin`",
      lambda w: export(w, "quantize", "--load", w.run, "--quant-cfg", "int8_sq", "--calib-data",
                       w.p("bad", "truncated"), "--out", w.p("q")), 2, (r"truncated\.bin", r"preprocess_data"),
      slow=True),
    C("export-trtllm-out-not-empty", "`python -m jmegatron.export trtllm --out` a non-empty folder",
      lambda w: export(w, "trtllm", "--load", w.run, "--out", w.p("hf_out")), 2,
      (r"hf_out", r"new folder|--overwrite")),
    C("export-import-hf-no-config", "`python -m jmegatron.export import-hf --hf` a folder without config.json",
      lambda w: export(w, "import-hf", "--hf", w.p("empty"), "--out", w.p("imported")), 2,
      (r"--hf .*empty", r"config\.json", r"save_pretrained")),
    C("export-bad-iteration", "`python -m jmegatron.export hf --load RUN --iteration 7`",
      lambda w: export(w, "hf", "--load", w.run, "--out", w.p("hf_new"), "--iteration", "7"), 2,
      (r"iteration 7", r"available: \[2\]")),
    C("preprocess-flag-of-another-tokenizer", "`python -m jmegatron.tools.preprocess_data ... --vocab-file V`",
      lambda w: preprocess(w, "--input", w.p("raw"), "--output-prefix", w.p("data", "corpus"),
                           "--tokenizer-model", w.tokenizer, "--vocab-file", "v.txt"), 2,
      (r"--vocab-file is GPT2BPETokenizer's", r"usage")),
    C("preprocess-workers-0", "`preprocess_data ... --workers 0`",
      lambda w: preprocess(w, "--input", w.p("raw"), "--output-prefix", w.p("data", "corpus"),
                           "--tokenizer-model", w.tokenizer, "--workers", "0"), 1, (r"--workers", r">= 1")),
    C("preprocess-no-tokenizer", "`preprocess_data --tokenizer-model` a missing file",
      lambda w: preprocess(w, "--input", w.p("raw"), "--output-prefix", w.p("data", "corpus"),
                           "--tokenizer-model", w.p("none.json")), 1, (r"none\.json", r"train_tokenizer")),
    C("preprocess-bad-json", "`preprocess_data --input bad.jsonl` onto an existing dataset's prefix",
      lambda w: preprocess(w, "--input", w.p("raw", "bad.jsonl"), "--output-prefix", w.p("data", "corpus"),
                           "--tokenizer-model", w.tokenizer), 1, (r"bad\.jsonl", r"JSON")),
    C("preprocess-missing-key", "`preprocess_data --json-keys body` (lines have `text`)",
      lambda w: preprocess(w, "--input", w.p("raw", "bad.jsonl"), "--output-prefix", w.p("data", "corpus"),
                           "--tokenizer-model", w.tokenizer, "--json-keys", "body"), 1, (r"body",)),
]


def run_case(w: World, case: Case) -> dict:
    """Run one row; returns {status, message, diff}."""
    # An earlier row's refused Orbax restore can leave a coroutine that Python reports
    # ("Exception ignored in ...") when it is collected: collect it before this row's capture.
    gc.collect()
    before = snapshot(w.root)
    status, message = case.act(w)
    diff = snapshot_diff(before, snapshot(w.root))
    return {"status": status, "message": message.strip(), "diff": diff}


def check(case: Case, result: dict) -> None:
    msg = result["message"]
    assert result["status"] == case.status, f"{case.id}: status {result['status']!r}, message:\n{msg}"
    for pat in case.patterns:
        assert re.search(pat, msg), f"{case.id}: {pat!r} not in message:\n{msg}"
    assert "Traceback" not in msg, msg
    assert not result["diff"], f"{case.id}: the disk changed: {result['diff']}"


# ---------------------------------------------------------------- pytest

@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    """The shared world. While the module runs, the objects alive before its rows are out of
    the collector's reach (gc.freeze): run_case's gc.collect() scans only what the rows made,
    not the heap left by the test files before this one in the worker (~1 s a row)."""
    w = build_world(str(tmp_path_factory.mktemp("bad_input")))
    gc.collect()
    gc.freeze()
    yield w
    gc.unfreeze()


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.slow else c for c in CASES],
                         ids=[c.id for c in CASES])
def test_bad_input(world, case):
    check(case, run_case(world, case))


def test_world_is_good_but_for_the_planted_faults(world):
    """The control: the good config, dataset and run restore and build, so each row's failure
    comes from its own fault."""
    from jmegatron.config import load_config_file
    from jmegatron.data.indexed_dataset import IndexedDataset
    from jmegatron.data.builder import build_datasets
    from jmegatron.training.run import restore_run

    before = snapshot(world.root)
    assert len(IndexedDataset(world.data)) == 12
    cfg = load_config_file(world.config, {"save": world.run})
    train_ds, valid_ds, _ = build_datasets(cfg, cfg.global_batch_size)
    assert len(train_ds) >= 2 * cfg.global_batch_size and valid_ds is not None
    run, state, meta = restore_run(world.run)
    assert meta["iteration"] == 2 and run.cfg.hidden_size == 32
    assert not snapshot_diff(before, snapshot(world.root))


@pytest.mark.parametrize("argv, message", [
    (["jmegatron.train", "--config", "configs/gpt_tiny.py", "--lrr", "1e-3"], "did you mean --lr,"),
    (["jmegatron.evaluate", "--load", "x", "--iters", "5"], "unrecognized arguments: --iters 5"),
    (["jmegatron.export", "hf", "--load", "x", "--out", "y", "--fp16"], "unrecognized arguments: --fp16"),
    (["jmegatron.tools.preprocess_data", "--input", "x", "--output-prefix", "y", "--tokenizer-model", "z",
      "--split-sentences"], "unrecognized arguments: --split-sentences"),
], ids=["train", "evaluate", "export", "preprocess_data"])
def test_python_dash_m_exits_2(tmp_path, argv, message):
    """The real entry points (``python -m ...``): exit status 2, the message on stderr, nothing
    written in the working directory."""
    import subprocess

    from conftest import REPO

    env = dict(os.environ, PYTHONPATH=str(REPO))
    if argv[0] == "jmegatron.train":
        argv = [argv[0], argv[1], str(REPO / argv[2]), *argv[3:]]
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == []


def test_ids_unique():
    assert len({c.id for c in CASES}) == len(CASES)


# ---------------------------------------------------------------- the table

def _first_error_line(message: str) -> str:
    lines = [l for l in message.splitlines() if l.strip()]
    for l in lines:
        if "error" in l.lower():
            return l.strip()
    return lines[-1].strip() if lines else ""


def markdown_table(w: World, results: dict) -> str:
    rows = ["| input | error (exit status: message) | nothing lost |", "|---|---|---|"]
    for case in CASES:
        r = results[case.id]
        msg = _first_error_line(r["message"]).replace(w.root + os.sep, "").replace(w.root, ".")
        msg = msg.replace("|", "\\|")
        lost = "yes: nothing changed" if not r["diff"] else "NO: " + ", ".join(r["diff"])
        rows.append(f"| {case.input} | {r['status']}: {msg} | {lost} |")
    return "\n".join(rows)


TABLE_BEGIN, TABLE_END = "<!-- bad-input-table: python tests/test_bad_input.py --write docs/RELIABILITY.md -->", \
    "<!-- /bad-input-table -->"


def write_table(path: str, table: str) -> None:
    """Replace the text between TABLE_BEGIN and TABLE_END in ``path`` with ``table``."""
    with open(path) as f:
        text = f.read()
    begin, end = text.index(TABLE_BEGIN) + len(TABLE_BEGIN), text.index(TABLE_END)
    with open(path, "w") as f:
        f.write(text[:begin] + "\n" + table + "\n" + text[end:])


if __name__ == "__main__":
    # python tests/test_bad_input.py [--write docs/RELIABILITY.md]: run every row, print (or write) the table
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        w = build_world(os.path.join(tmp, "w"))
        results = {c.id: run_case(w, c) for c in CASES}
        failed = []
        for c in CASES:
            try:
                check(c, results[c.id])
            except AssertionError as e:
                failed.append(str(e))
        table = markdown_table(w, results)
        if sys.argv[1:2] == ["--write"]:
            write_table(sys.argv[2], table)
        else:
            print(table)
        for f in failed:
            print("FAILED:", f, file=sys.stderr)
        sys.exit(1 if failed else 0)
