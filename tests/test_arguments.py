"""Configs as Megatron-LM users write them (issue 30, items 5 and 6): Megatron's YAML layout and
flags, a run's config.json, ``--help``, ByteMLPerf's launch scripts, Megatron's resume rules for
the learning-rate schedule.

``python tests/test_arguments.py --write docs/MEGATRON_FLAGS.md`` writes the table of every flag
in ``configs/bytemlperf/*.args``; ``test_bytemlperf_scripts`` checks the file equals it.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import sys

import numpy as np
import pytest

from jmegatron import arguments
from jmegatron.config import (ConfigError, JMegatronConfig, base_config, from_configdict, load_config_file,
                               tokenizer_type_of)
from jmegatron.command_line import config_from_argv
from jmegatron.train import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOCK = {"mock_data": True, "vocab_size": 1000}

# configs/gpt_tiny.py as Megatron's flags (jmegatron's defaults under them)
GPT_TINY_FLAGS = ("--num-layers 4 --hidden-size 256 --ffn-hidden-size 1024 --num-attention-heads 4 --seq-length 256 "
                  "--max-position-embeddings 256 --micro-batch-size 8 --global-batch-size 8 --lr 1e-3 --min-lr 1e-4 "
                  "--lr-warmup-iters 50 --lr-decay-style cosine --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 "
                  "--train-iters 500 --log-interval 10 --eval-interval 100 --eval-iters 10 --save-interval 250 "
                  "--split 90,5,5 --mock-data --vocab-size 1000 --use-flash-attn --no-masked-softmax-fusion").split()


def run_main(argv):
    """(exit status, stdout, stderr) of ``python -m jmegatron.train argv``, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:
            status = e.code
    return status, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------- the same config, four ways

def test_yaml_flags_and_config_json_resolve_to_the_python_config(tmp_path):
    py = load_config_file(f"{REPO}/configs/gpt_tiny.py", MOCK)
    assert load_config_file(f"{REPO}/configs/gpt_tiny.yaml", MOCK) == py
    assert config_from_argv(GPT_TINY_FLAGS) == py
    # flags over a file: Megatron's spelling and --config.<field> mix, a field given both ways must agree
    mixed = config_from_argv(["--config", f"{REPO}/configs/gpt_tiny.yaml", "--mock-data", "--config.vocab_size=1000",
                              "--disable-bias-linear", "--config.lr=0.002", "--fp8-format", "hybrid"])
    assert mixed == py.replace(add_bias_linear=False, lr=0.002, fp8="hybrid")
    with pytest.raises(ConfigError, match=r"config\.lr is given twice"):
        config_from_argv(["--config", f"{REPO}/configs/gpt_tiny.py", "--lr", "1e-3", "--config.lr=0.1"])
    # a run's config.json (what <save>/config.json holds) round-trips, tuples and derived fields too
    for name in ("gpt_tiny.py", "bytemlperf/ds_like_4node.py"):
        cfg = load_config_file(f"{REPO}/configs/{name}", MOCK if "tiny" in name else {})
        path = tmp_path / "config.json"
        path.write_text(cfg.to_json())
        assert load_config_file(str(path)) == cfg
    (tmp_path / "hf.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ConfigError, match="Hugging Face config.*import-hf"):
        load_config_file(str(tmp_path / "hf.json"))


def test_megatron_yaml_layout(tmp_path, monkeypatch):
    """Sections flattened as yaml_arguments.validate_yaml, ${VAR}, TransformerConfig's names,
    nulls, and validate_args' derivations."""
    monkeypatch.setenv("JM_DATA", "/data/corpus_text_document")
    (tmp_path / "c.yaml").write_text(
        "language_model:\n  num_layers: 2\n  hidden_size: 96\n  num_attention_heads: 4\n  num_query_groups: 2\n"
        "  ffn_hidden_size: null\n  activation_func: swiglu\n  layernorm_epsilon: 1.e-6\n"
        "  layernorm_zero_centered_gamma: true\n  add_bias_linear: false\n  persist_layer_norm: true\n"
        "model_parallel:\n  tensor_model_parallel_size: 1\n  sequence_parallel: true\n  bf16: true\n"
        "position_embedding_type: rope\nadd_position_embedding: false\nrampup_batch_size: null\n"
        "dataloader_type: null\ndata_path: ${JM_DATA}\ntokenizer_type: NullTokenizer\nvocab_size: 99\n"
        "lr: 3e-4\ntrain_iters: 10\n")
    cfg = load_config_file(str(tmp_path / "c.yaml"))
    assert (cfg.num_query_groups, cfg.norm_epsilon, cfg.apply_layernorm_1p, cfg.swiglu) == (2, 1e-6, True, True)
    assert cfg.ffn_hidden_size == 256  # int(4 x 96 x 2/3 / 64) x 64, Megatron's swiglu default
    assert not cfg.sequence_parallel and cfg.bf16 and cfg.lr == 3e-4  # off at tp 1; "3e-4" is a YAML string
    assert cfg.data_path == "/data/corpus_text_document" and cfg.dataloader_type == "single"
    (tmp_path / "twice.yaml").write_text("language_model:\n  bf16: true\nmodel_parallel:\n  bf16: false\n")
    with pytest.raises(ConfigError, match="'bf16' is given twice"):
        load_config_file(str(tmp_path / "twice.yaml"))
    (tmp_path / "env.yaml").write_text("data_path: ${JM_UNSET_VAR}\n")
    with pytest.raises(ConfigError, match="JM_UNSET_VAR, which is not set"):
        load_config_file(str(tmp_path / "env.yaml"))


def test_megatron_flag_semantics():
    res = arguments.parse_flags(
        ["--group-query-attention", "--num-layers", "2", "--data-path", "0.3", "A", "0.7", "B", "--expert-model-"
         "parallel-size", "8", "--sequence-parallel", "--tensor-model-parallel-size", "1", "--expert-model-parallel-"
         "size", "1", "--use-rotary-position-embeddings", "--recompute-activations", "--num-experts", "4",
         "--lr-decay-multi-step", "0.5", "0.3", "0.2", "--rampup-batch-size", "8", "8", "1000",
         "--no-check-for-nan-in-loss-and-grad", "--optimizer", "adam", "--rotary-percent", "1.0"], JMegatronConfig)
    res.check()
    assert res.fields == dict(num_layers=2, data_path="0.3 A 0.7 B", tensor_model_parallel_size=1,
                              expert_model_parallel_size=1, position_embedding_type="rope",
                              recompute_granularity="selective", num_moe_experts=4,
                              lr_decay_multi_step=(0.5, 0.3, 0.2), rampup_batch_size=(8, 8, 1000),
                              check_for_nan_in_loss_and_grad=False, num_query_groups=1, rotary_percent=1.0)
    assert [r.status for r in res.rows if r.spelling.startswith("--expert")] == ["accepted", "accepted"]
    assert "overridden by a later" in res.rows[3].detail  # argparse keeps the last, as Megatron's
    seq = next(r for r in res.rows if r.spelling == "--sequence-parallel")
    assert seq.status == "ignored" and "tensor-model-parallel-size 1" in seq.detail
    alone = arguments.parse_flags(["--num-query-groups", "8"], JMegatronConfig)
    assert alone.fields == {} and "--group-query-attention" in alone.rows[0].detail
    assert arguments.parse_flags(["--yaml-cfg", "x.yaml"], JMegatronConfig).config_path == "x.yaml"
    # what Megatron derives yields to a value given as --config.<field>; given alone it stands
    tiny = ["--config", "configs/gpt_tiny.py", "--config.mock_data=True", "--config.vocab_size=512"]
    assert config_from_argv(tiny + ["--hidden-size", "128", "--swiglu"]).ffn_hidden_size == 320
    assert config_from_argv(tiny + ["--hidden-size", "128", "--swiglu", "--config.ffn_hidden_size=512"]
                            ).ffn_hidden_size == 512
    assert config_from_argv(tiny + ["--group-query-attention", "--config.num_query_groups=2"]).num_query_groups == 2
    with pytest.raises(ConfigError, match="given twice"):  # two values the user typed still clash
        config_from_argv(tiny + ["--hidden-size", "128", "--config.hidden_size=64"])


@pytest.mark.parametrize("argv, named", [
    (["--config", "{tmp}/bad.yaml"], ("language_model.hiden_size", "did you mean hidden_size", "squared_relu: True",
                                      "squared-ReLU")),
    (["--config", "{tmp}/syntax.yaml"], ("syntax.yaml' line 2", "not valid YAML")),
    (["--config", "{tmp}/typed.yaml"], ("num_layers='four' is not a valid int",)),
    (["--config", "{repo}/configs/gpt_tiny.py", "--hiden-size", "64"], ("unknown --hiden-size 64",
                                                                          "did you mean --hidden-size")),
    (["--config", "{repo}/configs/gpt_tiny.py", "--squared-relu", "--fp32-residual-connection", "--use-flash-attn"],
     ("refused --squared-relu (the squared-ReLU MLP is not built", "refused --fp32-residual-connection")),
    (["--config", "{repo}/configs/gpt_tiny.py", "--num-layers", "x"], ("--num-layers: invalid int value: 'x'",)),
], ids=["yaml-unknown-and-refused-keys", "yaml-syntax", "yaml-type", "unknown-flag", "refused-flags", "flag-type"])
def test_bad_arguments_exit_2_with_one_line(tmp_path, argv, named):
    (tmp_path / "bad.yaml").write_text("language_model:\n  num_layers: 2\n  hiden_size: 64\nsquared_relu: true\n")
    (tmp_path / "syntax.yaml").write_text("language_model: [1,\n")
    (tmp_path / "typed.yaml").write_text("language_model:\n  num_layers: four\n")
    status, out, err = run_main([a.format(tmp=tmp_path, repo=REPO) for a in argv])
    assert status == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    for text in named:
        assert text in err, err
    assert "--use-flash-attn" not in err  # ignored, not refused


def test_help_lists_every_field_with_type_and_default():
    status, out, _ = run_main(["--help"])
    assert status == 0
    lines = out.splitlines()
    for section, name, typ, default, _ in arguments.field_docs(JMegatronConfig):
        line = next((l for l in lines if l.startswith(f"  {name}: ")), None)
        assert line is not None, name
        assert line.startswith(f"  {name}: {typ} = {default!r}"), line
        assert f"{section}:" in lines
    names = {f for _, f, *_ in arguments.field_docs(JMegatronConfig)}
    assert names == set(JMegatronConfig.__dataclass_fields__)
    assert any("add_bias_linear: bool = True" in l and "--disable-bias-linear" in l for l in lines)
    assert any(l.startswith("  num_moe_experts:") and "--num-experts" in l for l in lines)
    assert any(l.startswith("  hidden_dropout:") and "--hidden-dropout" in l and len(l.split("  ")) > 2 for l in lines)


# ---------------------------------------------------------------- ByteMLPerf's scripts

ARGS_FILES = sorted(glob.glob(f"{REPO}/configs/bytemlperf/*.args"))
# the flags whose values stand for files the config does not name: configs/bytemlperf/*.py
# document them ("--data-path: the user's corpus, so mock_data is on", "--vocab-file: vocab_size
# 50257", "--load: the benchmark starts from a checkpoint")
PLACEHOLDER_FIELDS = ("data_path", "vocab_file", "merge_file", "tokenizer_type", "tokenizer_model", "save", "load",
                      "tensorboard_dir")
# the scripts' path variables (${NAME} in the .args files), each standing for its own name here
PLACEHOLDERS = {n: n for n in ("CHECKPOINT_PATH", "CHECKPOINT_SAVE_PATH", "DATA_PATH", "MERGE_FILE", "PRETRAIN_MODEL_PATH",
                               "TENSORBOARD_LOGS_PATH", "TOKENIZER_MODEL", "VOCAB_FILE")}
# field -> why the script's flags and the .py differ (each must differ, or it is dropped here)
DIFFERENCES = {
    "gpt3_175b": {
        "rampup_batch_size": "the .py leaves it out: with --train-iters Megatron's validate_args (and jmegatron) "
                             "refuse it (the .py's docstring)",
        "tensor_model_parallel_size": "the .py keeps the layout in LAYOUT",
        "pipeline_model_parallel_size": "the .py keeps the layout in LAYOUT"},
    "ds_like_2node": {"ffn_hidden_size": "Megatron derives int(4h x 2/3 / 64) x 64 = 13632 for --swiglu without "
                                         "--ffn-hidden-size; the .py keeps 4h. No layer is dense (moe_layer_freq 1), so "
                                         "no parameter differs"},
    "ds_like_4node": {"ffn_hidden_size": "as ds_like_2node"},
}


def resolve_args_file(path: str) -> tuple:
    """(Resolution, the config of its accepted flags with the placeholders and DIFFERENCES
    replaced by the .py's values, the .py's config, {field: (flags' value, .py's value)})."""
    name = os.path.basename(path)[:-len(".args")]
    res = arguments.parse_flags(arguments.read_args_file(path, PLACEHOLDERS), JMegatronConfig,
                                f"configs/bytemlperf/{name}.args")
    ref = load_config_file(f"{REPO}/configs/bytemlperf/{name}.py")
    cd = base_config()
    for k, v in res.fields.items():
        setattr(cd, k, v)
    for k in PLACEHOLDER_FIELDS:
        setattr(cd, k, None)
    cd.mock_data, cd.vocab_size = True, ref.vocab_size
    differ = {}
    for k in DIFFERENCES.get(name, {}):
        differ[k] = (getattr(cd, k), getattr(ref, k))
        setattr(cd, k, getattr(ref, k))
    return res, from_configdict(cd), ref, differ


def markdown_table() -> str:
    """docs/MEGATRON_FLAGS.md: every flag of every ByteMLPerf argument list, and what its
    config is against the .py beside it."""
    out = ["# Megatron-LM flags in ByteMLPerf's launch scripts", "",
           "<!-- generated: python tests/test_arguments.py --write docs/MEGATRON_FLAGS.md -->", "",
           "Each `configs/bytemlperf/*.args` holds the arguments one of ByteMLPerf's scripts passes to Megatron's",
           "`pretrain_gpt.py`. `python -m jmegatron.train` parses them as Megatron's flags (jmegatron/arguments.py):",
           "**accepted** (the field it sets), **ignored** (no effect on what a run computes: why), **refused**",
           "(a feature jmegatron does not build: why, and what stands for it). tests/test_arguments.py checks this",
           "file and that the accepted flags give the config of the `.py` of the same name, but for the",
           "placeholders (data, tokenizer and checkpoint paths, which the `.py` replaces by mock data) and the",
           "differences listed under each table.", ""]
    for path in ARGS_FILES:
        name = os.path.basename(path)[:-len(".args")]
        res, _, _, differ = resolve_args_file(path)
        with open(path) as f:
            source = " ".join(l[2:].strip() for l in f.read().splitlines()[:2])
        out += [f"## {name}.args", "", source, "", "| flag | status | jmegatron |", "|---|---|---|"]
        for r in res.rows:
            out.append(f"| `{r.spelling}` | {r.status} | {r.detail.replace('|', '/')} |")
        out.append("")
        if differ:
            out.append(f"Against `configs/bytemlperf/{name}.py`:")
            out.append("")
            for k, (mine, theirs) in differ.items():
                out.append(f"* `{k}`: flags {mine!r}, .py {theirs!r}: {DIFFERENCES[name][k]}.")
        else:
            out.append(f"Resolves to `configs/bytemlperf/{name}.py` (placeholders aside).")
        out.append("")
    return "\n".join(out)


def test_bytemlperf_scripts():
    assert len(ARGS_FILES) == 8
    for path in ARGS_FILES:
        res, got, ref, differ = resolve_args_file(path)
        assert not res.by_status("unknown"), res.by_status("unknown")
        assert not res.by_status("refused"), path
        assert got == ref, {k: (v, getattr(ref, k)) for k, v in got.to_dict().items() if v != getattr(ref, k)}
        assert all(mine != theirs for mine, theirs in differ.values()), differ  # each documented one differs
    with open(f"{REPO}/docs/MEGATRON_FLAGS.md") as f:
        assert f.read() == markdown_table(), "run: python tests/test_arguments.py --write docs/MEGATRON_FLAGS.md"


def args_environment(tmp_path, monkeypatch) -> None:
    """The environment a ByteMLPerf script gives its arguments: each path variable set, GPT-2's
    two files (a two-token vocabulary) where VOCAB_FILE and MERGE_FILE point."""
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "vocab.json").write_text('{"a": 0, "<|endoftext|>": 1}')
    (gpt2 / "merges.txt").write_text("#version: 0.2\n")
    for name in PLACEHOLDERS:
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("DATA_PATH", str(tmp_path / "corpus_text_document"))
    monkeypatch.setenv("VOCAB_FILE", str(gpt2 / "vocab.json"))
    monkeypatch.setenv("MERGE_FILE", str(gpt2 / "merges.txt"))
    monkeypatch.setenv("CHECKPOINT_SAVE_PATH", str(tmp_path / "run"))
    monkeypatch.setenv("PRETRAIN_MODEL_PATH", str(tmp_path / "run"))


def test_an_args_file_runs_as_it_is(tmp_path, monkeypatch):
    # ByteMLPerf's argument list with its ${NAME} variables from the environment, given to the
    # trainer as a file, and flags after it win
    path = f"{REPO}/configs/bytemlperf/gpt3_345m_variable_memory.args"
    for name in PLACEHOLDERS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=r"names the environment variable DATA_PATH, which is not set; export DATA_PATH"):
        config_from_argv([path])
    args_environment(tmp_path, monkeypatch)
    for argv in ([path], ["--args-file", path], [f"--args-file={path}"]):
        cfg = config_from_argv(argv + ["--train-iters", "7"])
        assert (cfg.data_path, cfg.vocab_file, cfg.save, cfg.train_iters) == (
            str(tmp_path / "corpus_text_document"), str(tmp_path / "gpt2" / "vocab.json"), str(tmp_path / "run"), 7)
        assert (cfg.seq_length, cfg.seq_length_step, cfg.seq_length_min, cfg.variable_data) == (32768, 1024, 1024, True)
        assert cfg.tokenizer_type is None and tokenizer_type_of(cfg) == "GPT2BPETokenizer"  # pretrain_gpt.py's default
    status, _, err = run_main([str(tmp_path / "missing.args")])
    assert status == 2 and "missing.args: no such file" in err
    # bench precision takes the same forms: it gets past the config to the reference log's check
    from jmegatron.bench.__main__ import main as bench_main

    for argv in ([path], TINY + ["--train-iters", "2"]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert bench_main(["precision", "--reference", str(tmp_path / "ref.log"), *argv]) == 2
        assert "ref.log' does not exist" in err.getvalue(), err.getvalue()


def test_every_args_file_runs_as_it_is(tmp_path, monkeypatch, capsys):
    import jax

    from jmegatron.parallel.mesh import create_mesh
    from jmegatron.training.loop import pretrain

    args_environment(tmp_path, monkeypatch)
    for path in ARGS_FILES:  # the files unchanged: the config of each validates
        if path.endswith("gpt3_175b.args"):  # Megatron's validate_args refuses it too (DIFFERENCES)
            with pytest.raises(ConfigError, match=r"config\.rampup_batch_size=\(16, 16, 5859375\) needs "
                                                  r"config\.train_samples"):
                config_from_argv([path])
            continue
        cfg = config_from_argv([path])
        assert cfg.data_path == str(tmp_path / "corpus_text_document"), path
        assert tokenizer_type_of(cfg) == ("Llama2Tokenizer" if cfg.tokenizer_model else "GPT2BPETokenizer"), path
    # one trains: gpt3_345m's arguments with a tiny model on mock data, GPT-2's files its tokenizer
    tiny = ("--mock-data --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
            "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 2 --train-iters 2 "
            "--eval-iters 1").split()
    cfg = config_from_argv([f"{REPO}/configs/bytemlperf/gpt3_345m.args"] + tiny)
    capsys.readouterr()
    out = pretrain(cfg, create_mesh(cfg, jax.devices()[:1]))
    assert out["iteration"] == 2 and all(np.isfinite(v) for v in out["losses"].values())
    assert capsys.readouterr().out.count("[jmegatron] tokenizer_type not given: GPT2BPETokenizer") == 1


# ---------------------------------------------------------------- Megatron's resume rules

TINY = ("--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 1 --global-batch-size 8 --mock-data --vocab-size 128 --log-interval 1 --eval-interval 0 "
        "--peak-tflops 1.0 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 1 --lr-decay-style cosine").split()


@pytest.fixture(scope="module")
def two_iterations(tmp_path_factory):
    """A tiny run's save directory after 2 iterations (train_iters 2: the decay is 2 iterations)."""
    from jmegatron.training.loop import pretrain

    d = str(tmp_path_factory.mktemp("schedule") / "run")
    pretrain(config_from_argv(TINY + ["--save", d, "--train-iters", "2"]))
    return d


def last_lr(save: str) -> float:
    with open(os.path.join(save, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f][-1]["lr"]


def test_resume_refuses_another_schedule_unless_told_which_wins(two_iterations, tmp_path):
    from jmegatron.checkpoint import checkpointing
    from jmegatron.training.loop import pretrain
    from jmegatron.training.optimizer import lr_schedule

    # train_iters 3 makes the decay 3 iterations: Megatron's "lr_decay_steps do not match"
    more = TINY + ["--load", two_iterations, "--train-iters", "3"]
    with pytest.raises(checkpointing.CheckpointError, match=r"lr_decay_iters \(train_iters when not set\): "
                                                            r"checkpoint 2 vs config 3.*override_opt_param_scheduler"):
        pretrain(config_from_argv(more + ["--save", str(tmp_path / "refused")]))
    status, _, err = run_main(more + ["--save", str(tmp_path / "refused_cli")])
    assert status == 2 and "learning-rate schedule" in err and "Traceback" not in err
    # override: the config's schedule (decay over 3) from iteration 3 on
    cfg = config_from_argv(more + ["--save", str(tmp_path / "override"), "--override-opt_param-scheduler"])
    assert pretrain(cfg)["iteration"] == 3
    assert last_lr(str(tmp_path / "override")) == pytest.approx(float(lr_schedule(cfg)(2)), rel=1e-6)
    # use the checkpoint's: the config is loaded with its decay (2), the run ends at min_lr
    cfg = config_from_argv(more + ["--save", str(tmp_path / "ckpt"), "--use-checkpoint-opt_param-scheduler"])
    assert cfg.lr_decay_iters == 2 and cfg.train_iters == 3
    assert pretrain(cfg)["iteration"] == 3
    assert last_lr(str(tmp_path / "ckpt")) == pytest.approx(1e-4, rel=1e-6)
    assert float(lr_schedule(cfg.replace(lr_decay_iters=3))(2)) > 2e-4  # the two schedules differ at iteration 3
    with pytest.raises(ConfigError, match="override_opt_param_scheduler=True and use_checkpoint_opt_param_scheduler"):
        config_from_argv(more + ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"])
    # finetune starts the schedule afresh; an iteration-0 checkpoint (import-hf) has run none of it
    saved = json.loads(open(os.path.join(two_iterations, "config.json")).read())
    ft = config_from_argv(more + ["--save", str(tmp_path / "ft"), "--finetune"])
    checkpointing.check_schedule(ft, saved, two_iterations, 2)
    checkpointing.check_schedule(ft.replace(finetune=False), saved, two_iterations, 0)
    with pytest.raises(checkpointing.CheckpointError):
        checkpointing.check_schedule(ft.replace(finetune=False), saved, two_iterations, 2)


if __name__ == "__main__":
    # python tests/test_arguments.py [--write docs/MEGATRON_FLAGS.md]: print (or write) the table
    table = markdown_table()
    if sys.argv[1:2] == ["--write"]:
        with open(sys.argv[2], "w") as f:
            f.write(table)
    else:
        print(table)
