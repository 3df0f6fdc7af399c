"""Run tracking: Weights & Biases with Megatron's flags (offline), the console's compile /
progress / summary lines, the short no-peak line, strict-JSON ``metrics.jsonl``.

One tiny mock-data run through the CLI's entry point (``jmegatron.train.main``, in process,
so the peak can be made unknown: MFU is then NaN) serves every assertion. The W&B run is
read back from its offline files (``run-*.wandb``: W&B's LevelDB-style record log of
``wandb.proto`` Records), the TensorBoard scalars from the event file (TFRecord framing).
"""

import contextlib
import glob
import io
import json
import math
import pathlib
import re
import struct
import sys

import pytest

from jmegatron.reporting.peak import PeakChoice
from jmegatron.training import loop

from conftest import REPO

TINY = ["--config", str(REPO / "configs/gpt_tiny.py"), "--config.mock_data=True", "--config.vocab_size=128",
        "--config.num_layers=1", "--config.hidden_size=32", "--config.ffn_hidden_size=64",
        "--config.num_attention_heads=2", "--config.seq_length=32", "--config.max_position_embeddings=32",
        "--config.micro_batch_size=1", "--config.global_batch_size=8", "--config.lr_warmup_iters=1",
        "--config.train_iters=6", "--config.log_interval=2", "--config.eval_interval=3", "--config.eval_iters=1",
        "--config.save_interval=0"]
HIDDEN_WANDB_KEYS = {"_step", "_timestamp", "_runtime"}


def strict_loads(line: str):
    """json.loads that refuses NaN / Infinity (not JSON: RFC 8259)."""
    def refuse(token):
        raise ValueError(f"non-JSON constant {token}")
    return json.loads(line, parse_constant=refuse)


def tensorboard_scalars(logdir) -> dict:
    """{tag: {step: value}} of the simple-value scalars in ``logdir``'s event files (TFRecord:
    uint64 length, uint32 CRC, payload, uint32 CRC)."""
    from tensorboardX.proto import event_pb2

    out = {}
    for path in sorted(pathlib.Path(logdir).glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


def wandb_records(path) -> list:
    """The ``wandb.proto`` Records of an offline run file: a 7-byte ``:W&B`` header, then
    LevelDB log blocks of 32 KiB holding records (4-byte CRC, 2-byte length, 1-byte type:
    1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = pathlib.Path(path).read_bytes()
    assert data[:4] == b":W&B", path
    pos, chunks, pending = 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            chunks.append(pending + chunk)
    return [pb.Record.FromString(c) for c in chunks]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """(stdout, save dir) of a 6-iteration run with W&B offline and no known peak."""
    from jmegatron.train import main as train_main

    import wandb
    save = tmp_path_factory.mktemp("tracking") / "run"
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.setenv("WANDB_MODE", "offline")
        mp.setattr(loop, "resolve_peak_for_config", lambda cfg, **kw: PeakChoice(
            None, "none: no bench peak record (test)", None, "not stated (test)", "float32"))
        code = train_main(TINY + [f"--config.save={save}", "--config.wandb_project=jmegatron-test",
                                  "--config.wandb_exp_name=tiny"])
    wandb.teardown()  # the W&B service writes the offline run file out at teardown
    assert code == 0, stdout.getvalue()[-3000:]
    return stdout.getvalue(), save


def test_console_compile_progress_and_summary_lines(cli_run):
    text, save = cli_run
    lines = text.splitlines()
    assert "\r" not in text  # a log file: no carriage-return redraws
    compiling = lines.index("[jmegatron] compiling the train step for tokens [1, 8, 32] ...")
    compiled = next(i for i, l in enumerate(lines) if l.startswith("[jmegatron] compiled the train step for tokens "
                                                                   "[1, 8, 32] in "))
    first_iteration = next(i for i, l in enumerate(lines) if re.search(r" iteration +\d+/", l))
    assert compiling < compiled < first_iteration
    assert float(re.search(r" in ([0-9.]+) s$", lines[compiled]).group(1)) > 0
    # the evaluation step's compilation is announced too, once, before the first validation block
    evaluating = [i for i, l in enumerate(lines) if l.startswith("[jmegatron] compiled the evaluation step for ")]
    assert len(evaluating) == 1 and evaluating[0] < next(i for i, l in enumerate(lines) if " validation loss" in l)
    # one tqdm progress line right after each of Megatron's iteration lines
    iterations = [i for i, l in enumerate(lines) if re.search(r" iteration +\d+/ +6 \|", l)]
    assert len(iterations) == 3
    for i, it in zip(iterations, (2, 4, 6)):
        assert re.fullmatch(rf"\[jmegatron\] progress: +\d+%\|[#0-9 ]+\| {it}/6 \[\d\d:\d\d<\d\d:\d\d, +"
                            r"[0-9.]+(it/s|s/it)\]", lines[i + 1]), lines[i + 1]
    # no peak: one short line naming the command that measures one, and no MFU column
    peak = [l for l in lines if "peak for MFU" in l]
    assert len(peak) == 1 and len(peak[0]) < 200 and "python -m jmegatron.bench peak" in peak[0], peak
    assert "peak for MFU: none" in peak[0] and not any(" MFU: " in lines[i] for i in iterations)
    # the closing line: iterations, time, step time, throughput, losses, where things are
    summary = lines[-1]
    assert summary.startswith("[jmegatron] done: 6 iterations in "), summary
    step_ms = float(re.search(r"mean step ([0-9.]+) ms", summary).group(1))
    tokens = float(re.search(r"([0-9,]+) tokens/s", summary).group(1).replace(",", ""))
    assert step_ms > 0 and tokens > 0
    # the same figures as metrics.jsonl: its last training record's loss, its last validation
    records = [strict_loads(l) for l in open(save / "metrics.jsonl")]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    last_step = [r for r in records if "step_losses" in r][-1]["step_losses"][-1]
    assert f"final lm loss: {last_step:.6E}" in summary and f"validation lm loss: {val[-1]:.6E}" in summary
    assert f"checkpoint: {save} (iteration 6)" in summary and f"metrics: {save / 'metrics.jsonl'}" in summary
    assert f"TensorBoard: {save / 'tensorboard'}" in summary and f"{save / 'wandb'}" in summary


def test_metrics_jsonl_is_strict_json_without_a_peak(cli_run):
    _, save = cli_run
    text = (save / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    records = [strict_loads(l) for l in text.splitlines()]
    train = [r for r in records if "step_losses" in r]
    assert [r["iteration"] for r in train] == [2, 4, 6]
    assert all(r["mfu"] is None and r["mfu_theoretical"] is None for r in train)  # NaN in the record -> null
    assert all(math.isfinite(r["lm_loss"]) and r["tflops_per_device"] > 0 for r in train)
    # the bench tools read it as before
    from jmegatron.bench.megatron_log import read_log

    log = read_log(str(save / "metrics.jsonl"))
    assert sorted(log.loss()) == list(range(1, 7)) and sorted(log.validation["lm loss"]) == [3, 6]


def test_wandb_offline_run_holds_config_and_the_tensorboard_scalars(cli_run):
    _, save = cli_run
    runs = glob.glob(str(save / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, runs  # Megatron's default directory: <save>/wandb
    records = wandb_records(runs[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.display_name) == ("jmegatron-test", "tiny")
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["wandb_project"] == "jmegatron-test" and config["train_iters"] == 6  # the run's config
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            history.setdefault(row.pop("_step"), {}).update({k: v for k, v in row.items()
                                                             if k not in HIDDEN_WANDB_KEYS})
    # every TensorBoard scalar at every step, the same value (float32 in the event file)
    tb = tensorboard_scalars(save / "tensorboard")
    assert {"lm_loss", "grad_norm", "lr", "val_loss", "mem-allocated-bytes"} <= set(tb)
    assert "mfu" not in tb  # NaN: left out of TensorBoard, and of W&B alike
    tb_rows = {}
    for tag, steps in tb.items():
        for step, value in steps.items():
            tb_rows.setdefault(step, {})[tag] = value
    assert sorted(history) == sorted(tb_rows) == [2, 3, 4, 6]
    for step, row in tb_rows.items():
        assert set(history[step]) == set(row), step
        for tag, value in row.items():
            assert history[step][tag] == pytest.approx(value, rel=1e-6), (step, tag)


def test_progress_rate_leaves_compilation_out_and_a_missing_wandb_is_named(monkeypatch, tmp_path):
    from jmegatron.config import ConfigError
    from jmegatron.training.logging import ProgressLine, init_wandb

    now = [0.0]
    progress = ProgressLine(100, start_iteration=10, clock=lambda: now[0])  # a run resumed at 10
    now[0] = 30.0
    progress.start_rate(11)  # the first call took 30 s (compilation)
    now[0] = 40.0  # 10 more iterations in 10 s: 1 it/s, 79 to go
    assert progress.line(21).endswith(" 21/100 [00:40<01:19,  1.00it/s]"), progress.line(21)
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError, match="pip install wandb"):
        init_wandb("p", "n", str(tmp_path / "wandb"), {})
    assert not (tmp_path / "wandb").exists()
