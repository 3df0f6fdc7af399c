"""Megatron logs both ways: jmegatron writes Megatron-LM's console lines and reads Megatron's
(and its own) logs back; ``bench loss_chart`` / ``memory_chart`` / ``precision`` /
``memory --log`` on them.

The Megatron lines here are written with Megatron-LM's own format strings, transcribed from
megatron/training/training.py ``training_log`` / ``evaluate_and_print_results`` and
megatron/training/utils.py ``report_memory`` as ByteMLPerf's fork has them
(bytedance/ByteMLPerf a30b4f9, byte_train_perf/Megatron-LM/megatron/training/).
"""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jmegatron.bench.__main__ import main as bench_main
from jmegatron.bench.common import BenchError
from jmegatron.bench.loss_chart import compare_losses
from jmegatron.bench.megatron_log import LogFormatError, read_log
from jmegatron.bench.precision import read_loss_log

REPO = pathlib.Path(__file__).resolve().parents[1]


# ------------------------------------------------------------ Megatron's format strings
def megatron_iteration_line(iteration, train_iters, consumed, elapsed_s, lr, batch_size, losses, grad_norm,
                            num_zeros_in_grad=None, loss_scale=1.0, skipped=0, nan=0,
                            stamp="2025-02-06 08:48:13"):
    log_string = f" [{stamp}]"
    log_string += ' iteration {:8d}/{:8d} |'.format(iteration, train_iters)
    log_string += ' consumed samples: {:12d} |'.format(consumed)
    log_string += ' elapsed time per iteration (ms): {:.1f} |'.format(elapsed_s * 1000.0)
    log_string += f' learning rate: {lr:.6E} |'
    log_string += f' global batch size: {batch_size:5d} |'
    for key, avg in losses.items():
        if avg > 0.0:
            log_string += ' {}: {:.6E} |'.format(key, avg)
    log_string += f' loss scale: {loss_scale:.1f} |'
    if grad_norm is not None:
        log_string += f' grad norm: {grad_norm:.3f} |'
    if num_zeros_in_grad is not None:
        log_string += f' num zeros: {num_zeros_in_grad} |'
    log_string += ' number of skipped iterations: {:3d} |'.format(skipped)
    log_string += ' number of nan iterations: {:3d} |'.format(nan)
    return log_string


def megatron_validation_block(prefix, losses):
    string = f' validation loss at {prefix} | '
    for key, value in losses.items():
        string += '{} value: {:.6E} | '.format(key, value)
        ppl = math.exp(min(20, value))
        string += '{} PPL: {:.6E} | '.format(key, ppl)
    length = len(string) + 1
    return ['-' * length, string, '-' * length]


def megatron_memory_line(rank, name, allocated, max_allocated, reserved, max_reserved):
    mega_bytes = 1024.0 * 1024.0
    string = name + ' memory (MB)'
    string += ' | allocated: {}'.format(allocated / mega_bytes)
    string += ' | max allocated: {}'.format(max_allocated / mega_bytes)
    string += ' | reserved: {}'.format(reserved / mega_bytes)
    string += ' | max reserved: {}'.format(max_reserved / mega_bytes)
    return "[Rank {}] {}".format(rank, string)


def write_megatron_log(path, lm_losses, *, lb_losses=None, ranks=2, memory_every=False, grow=0.0,
                       rank_scale=None, val_at=None, train_iters=500000, gbs=256):
    """A Megatron/ByteMLPerf stdout log: its start-up noise, one iteration line per entry of
    ``lm_losses`` ({iteration: loss}), memory lines (after the first iteration, or each with
    ByteMLPerf's --test-memory) for ``ranks`` ranks, a validation block at ``val_at``."""
    lines = ["------------------------ arguments ------------------------",
             "  log_interval .................................... 1",
             "[before the start of training step] datetime: 2025-02-06 08:47:49 "]
    for n, (it, loss) in enumerate(sorted(lm_losses.items())):
        losses = {"lm loss": loss}
        if lb_losses:
            losses["load_balancing_loss"] = lb_losses[it]
        line = megatron_iteration_line(it, train_iters, it * gbs, 7.3, 2e-7 * it, gbs, losses, 33.5 - 0.1 * it,
                                       num_zeros_in_grad=0)
        if n == 0:  # rank 0's report_theoretical_memory lands after the '|' in ByteMLPerf's logs
            line += "Number of parameters in transformer layers in billions:  4.56"
        lines.append(line)
        if n == 0 or memory_every:
            for r in range(ranks):
                scale = (rank_scale or {}).get(r, 1.0) * (1.0 + grow * n)
                lines.append(megatron_memory_line(r, f"(after {it} iterations)", 34595.1e6 * scale,
                                                  36827.0e6 * scale, 40638.0 * 2 ** 20 * scale,
                                                  40638.0 * 2 ** 20 * scale))
        if val_at == it:
            lines += megatron_validation_block(f"iteration {it}", {"lm loss": loss + 0.1})
    pathlib.Path(path).write_text("\n".join(lines) + "\n")
    return path


LOSSES = {i: 10.5 - 0.05 * i for i in range(1, 61)}


# ------------------------------------------------------------ reading Megatron's log
def test_megatron_log_read_by_name_rank_and_iteration(tmp_path):
    lb = {i: 1.7 - 0.001 * i for i in LOSSES}
    path = write_megatron_log(tmp_path / "megatron.log", LOSSES, lb_losses=lb, ranks=4, memory_every=True, val_at=50)
    log = read_log(str(path))
    assert log.format == "text" and log.train_iters == 500000
    assert sorted(log.losses) == ["lm loss", "load_balancing_loss"]
    assert log.loss("lm loss") == {i: float(f"{v:.6E}") for i, v in LOSSES.items()}
    assert log.losses["load_balancing_loss"][60] == pytest.approx(1.64, rel=1e-6)
    assert log.fields[3]["consumed samples"] == 768 and log.fields[3]["global batch size"] == 256
    assert log.fields[3]["grad norm"] == 33.2 and log.fields[3]["num zeros"] == 0
    assert log.validation == {"lm loss": {50: pytest.approx(LOSSES[50] + 0.1)}}
    assert sorted(log.memory) == [0, 1, 2, 3] and all(len(v) == 60 for v in log.memory.values())
    first = log.memory[2][0]
    assert (first.iteration, first.source) == (1, None)
    assert first.allocated == pytest.approx(34595.1e6 / 2 ** 20) and first.reserved == 40638.0
    assert first.value("fragment") == pytest.approx(40638.0 - 34595.1e6 / 2 ** 20)
    with pytest.raises(LogFormatError, match="no 'kd loss'.*lm loss"):
        log.loss("kd loss")


def test_truncated_and_foreign_logs_name_file_and_line(tmp_path):
    path = write_megatron_log(tmp_path / "full.log", {1: 10.5, 2: 10.4, 3: 10.3})
    lines = path.read_text().splitlines()
    last = len(lines)  # the iteration-3 line is the last one
    for cut in (40, 120, len(lines[-1]) - 5):
        trunc = tmp_path / f"cut{cut}.log"
        trunc.write_text("\n".join(lines[:-1] + [lines[-1][:cut]]))
        with pytest.raises(LogFormatError, match=rf"cut{cut}.log:{last}: .*truncated"):
            read_log(str(trunc))
    mem = tmp_path / "mem.log"
    mem.write_text("\n".join(lines[:5] + [lines[5][:70]]))
    assert lines[5].startswith("[Rank 1] (after 1 iterations)")
    with pytest.raises(LogFormatError, match=r"mem.log:6: truncated memory line"):
        read_log(str(mem))
    bad = tmp_path / "bad.log"
    bad.write_text(lines[3].replace("grad norm: 33.400", "grad norm: 33.4x0") + "\n")
    with pytest.raises(LogFormatError, match=r"bad.log:1: 'grad norm' has '33.4x0', not a number"):
        read_log(str(bad))
    foreign = tmp_path / "lightning.log"  # another framework's log
    foreign.write_text("\nGPU available: True (cuda), used: True\nEpoch 0:  50%|#####     | 5/10 [00:01<00:01, "
                       "loss=2.31, v_num=0]\n")
    with pytest.raises(LogFormatError, match=r"lightning.log has no Megatron iteration line.*its 3 lines; line 2 "
                                             r"reads 'GPU available"):
        read_log(str(foreign))
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text('{"iteration": 1, "lm_loss": 2.0, "step_losses": [2.0]}\n{"iteration": 2, "lm_lo')
    with pytest.raises(LogFormatError, match=r"metrics.jsonl:2 is not JSON"):
        read_log(str(jsonl))
    # a non-finite loss is strict JSON's null in metrics.jsonl, read back as NaN
    jsonl.write_text('{"iteration": 2, "lm_loss": null, "step_losses": [2.0, null], "val_loss": null}\n')
    strict = read_log(str(jsonl))
    assert strict.loss()[1] == 2.0 and math.isnan(strict.loss()[2]) and math.isnan(strict.validation["lm loss"][2])
    with pytest.raises(LogFormatError, match=r"'.*nothing.log' does not exist"):
        read_log(str(tmp_path / "nothing.log"))
    # the bench commands turn them into exit status 2
    assert bench_main(["loss_chart", "-b", str(path), "-i", str(tmp_path / "cut40.log"), "-o",
                       str(tmp_path / "out"), "-s", "2"]) == 2


# ------------------------------------------------------------ loss_chart
def test_loss_chart_mean_relative_error_criterion(tmp_path):
    base = {i: 2.0 for i in range(1, 11)}
    cand = {i: 2.0 * (1 + (0.003 if i <= 5 else 0.0)) for i in range(1, 11)}  # 0.3 % on half the steps
    r = compare_losses(base, cand, 10, 0.002)
    assert r["mean_relative_error"] == pytest.approx(0.0015) and r["passed"]
    assert r["max_relative_error"] == pytest.approx(0.003) and r["max_at"] == 1
    assert not compare_losses(base, cand, 5, 0.002)["passed"]  # the first 5 steps only: 0.3 %
    assert not compare_losses(base, {**cand, 3: float("nan")}, 10, 0.002)["passed"]
    with pytest.raises(BenchError, match="share 10 logged iterations, -s asks 50"):
        compare_losses(base, cand, 50, 0.002)

    a = write_megatron_log(tmp_path / "gpu.log", LOSSES)
    near = write_megatron_log(tmp_path / "near.log", {i: v * (1 + 0.001 * (-1) ** i) for i, v in LOSSES.items()})
    far = write_megatron_log(tmp_path / "far.log", {i: v * 1.0025 for i, v in LOSSES.items()})
    assert bench_main(["loss_chart", "-b", str(a), "-i", str(near), "-o", str(tmp_path / "near"),
                       "-s", "50", "-t", "0.002"]) == 0
    assert bench_main(["loss_chart", "-b", str(a), "-i", str(far), "-o", str(tmp_path / "far")]) == 1
    verdict = json.loads((tmp_path / "far" / "loss_chart.json").read_text())
    assert not verdict["passed"] and verdict["mean_relative_error"] == pytest.approx(0.0025, rel=1e-3)
    assert len(verdict["iterations"]) == 50 and verdict["iterations"][-1] == 50
    assert "**FAIL**" in (tmp_path / "far" / "loss_chart.md").read_text()
    assert (tmp_path / "far" / "loss_chart.png").stat().st_size > 0


# ------------------------------------------------------------ memory_chart, memory --log
def test_memory_chart_per_rank(tmp_path):
    its = {i: 10.0 for i in range(1, 6)}
    gpu = write_megatron_log(tmp_path / "gpu.log", its, ranks=4, memory_every=True)
    same = write_megatron_log(tmp_path / "vendor.log", its, ranks=4, memory_every=True,
                              rank_scale={0: 1.001, 1: 0.999})
    off = write_megatron_log(tmp_path / "off.log", its, ranks=4, memory_every=True, rank_scale={2: 1.01})
    out = tmp_path / "mc"
    assert bench_main(["memory_chart", "-b", str(gpu), "-i", str(same), "-o", str(out)]) == 0
    r = json.loads((out / "memory_chart.json").read_text())
    assert r["metric"] == "allocated" and len(r["points"]) == 20 and sorted(r["per_rank"]) == ["0", "1", "2", "3"]
    assert r["per_rank"]["0"]["max_difference"] == pytest.approx(0.001)
    assert bench_main(["memory_chart", "-b", str(gpu), "-i", str(off), "-o", str(out), "--reserved"]) == 1
    r = json.loads((out / "memory_chart.json").read_text())
    assert r["metric"] == "reserved" and r["per_rank"]["2"]["max_difference"] == pytest.approx(0.01)
    assert r["per_rank"]["1"]["max_difference"] == 0.0 and not r["passed"]
    # the fragmentation fraction (reserved - allocated) / reserved is the same under a uniform scale
    assert bench_main(["memory_chart", "-b", str(gpu), "-i", str(off), "-o", str(out), "--fragment"]) == 0
    assert (out / "memory_chart.png").stat().st_size > 0 and "PASS" in (out / "memory_chart.md").read_text()
    no_memory = tmp_path / "nomem.log"
    no_memory.write_text("\n".join(l for l in gpu.read_text().splitlines() if "[Rank" not in l))
    assert bench_main(["memory_chart", "-b", str(gpu), "-i", str(no_memory), "-o", str(out)]) == 2


def test_bench_memory_reads_a_log(tmp_path):
    its = {i: 10.0 for i in range(1, 101)}
    flat = write_megatron_log(tmp_path / "flat.log", its, ranks=2, memory_every=True)
    leak = write_megatron_log(tmp_path / "leak.log", its, ranks=2, memory_every=True, grow=0.001)
    assert bench_main(["memory", "--log", str(flat), "--out", str(tmp_path / "flat")]) == 0
    assert bench_main(["memory", "--log", str(leak), "--out", str(tmp_path / "leak")]) == 1
    r = json.loads((tmp_path / "leak" / "memory.json").read_text())
    assert r["judged_ranks"] == 2 and r["ranks"]["1"]["growth"]["growth"] > 0.01
    assert r["ranks"]["0"]["iterations"] == list(range(1, 101))
    assert bench_main(["memory", "--out", str(tmp_path / "none")]) == 2  # neither --config nor --log


# ------------------------------------------------------------ jmegatron's own log, both ways
TINY = ["--config", "configs/gpt_tiny.py", "--config.mock_data=True", "--config.vocab_size=128",
        "--config.num_layers=2", "--config.hidden_size=32", "--config.ffn_hidden_size=64",
        "--config.num_attention_heads=2", "--config.seq_length=16", "--config.max_position_embeddings=16",
        "--config.micro_batch_size=2", "--config.global_batch_size=4", "--config.lr_warmup_iters=2",
        "--config.lr_decay_iters=10", "--config.hidden_dropout=0", "--config.attention_dropout=0",
        "--config.peak_tflops=1.0", "--config.log_interval=1", "--config.train_iters=8"]


def _run(module, *args, cwd=REPO):
    from conftest import subprocess_env

    env = subprocess_env(1)  # one device, the suite's compile flags and cache
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def jmegatron_log(tmp_path_factory):
    """A tiny mock-data pretrain's stdout (``train.log``) and ``metrics.jsonl``."""
    d = tmp_path_factory.mktemp("jm")
    proc = _run("jmegatron.train", *TINY, "--config.eval_interval=4", "--config.eval_iters=1",
                "--config.log_num_zeros_in_grad=True", "--config.test_memory=True", f"--config.save={d / 'ckpt'}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (d / "train.log").write_text(proc.stdout)
    return d


@pytest.mark.slow
def test_console_is_megatrons(jmegatron_log):
    text = (jmegatron_log / "train.log").read_text()
    lines = [l for l in text.splitlines() if re.search(r" iteration +\d+/", l)]
    assert len(lines) == 8
    keys = [seg.split(":")[0].strip() for seg in lines[2].split("] ", 1)[1].split("|")[1:-1]]
    assert keys == ["consumed samples", "elapsed time per iteration (ms)", "learning rate", "global batch size",
                    "lm loss", "loss scale", "grad norm", "num zeros", "number of skipped iterations",
                    "number of nan iterations", "tokens/s", "TFLOP/s/device"] + (
                        [] if "peak for MFU: none" in text else ["MFU"]) + (
                        # only beside a stated theoretical peak (none for a hypervisor's nominal
                        # clock before bench peak measured this machine: jmegatron.reporting.peak)
                        [] if "theoretical peak: unknown" in text else ["MFU (theoretical peak)"])
    assert re.match(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration        3/       8 \| consumed samples: "
                    r"          12 \|", lines[2])
    assert " global batch size:     4 | lm loss: " in lines[2] and " loss scale: 1.0 |" in lines[2]
    log = read_log(str(jmegatron_log / "train.log"))
    assert sorted(log.memory) == [0] and [m.iteration for m in log.memory[0]] == list(range(1, 9))  # test_memory
    m = log.memory[0][0]
    assert m.source == "compiled train step per device (reserved: the largest step program's peak)"
    assert 0 < m.allocated < m.max_allocated == m.reserved == m.max_reserved  # one program: its peak is the pool
    assert log.validation["lm loss"].keys() == {4, 8}
    val = [i for i, l in enumerate(text.splitlines()) if l.startswith(" validation loss at iteration 4 |")][0]
    block = text.splitlines()[val - 1:val + 2]
    assert block[0] == block[2] == "-" * (len(block[1]) + 1)
    # the same losses in the console (6 digits) and metrics.jsonl (every iteration)
    jsonl = read_log(str(jmegatron_log / "ckpt" / "metrics.jsonl"))
    assert jsonl.loss().keys() == log.loss().keys() == set(range(1, 9))
    for it, v in log.loss().items():
        assert v == pytest.approx(jsonl.loss()[it], rel=1e-6)
    assert [m.iteration for m in jsonl.memory[0]] == list(range(1, 9))
    records = [json.loads(l) for l in (jmegatron_log / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "step_losses" in r]
    assert [r["consumed_samples"] for r in train] == [4 * i for i in range(1, 9)]
    assert all(r["global_batch_size"] == 4 and r["loss_scale"] == 1.0 and r["nan_iterations"] == 0 for r in train)
    assert all(0 <= r["num_zeros"] < 10_000 for r in train)


@pytest.mark.slow
def test_round_trip_loss_chart_and_precision_against_megatron_log(jmegatron_log, tmp_path):
    train_log = jmegatron_log / "train.log"
    out = tmp_path / "same"
    assert bench_main(["loss_chart", "-b", str(train_log), "-i", str(train_log), "-o", str(out), "-s", "8"]) == 0
    assert json.loads((out / "loss_chart.json").read_text())["mean_relative_error"] == 0.0
    # a perturbed copy: every lm loss 0.5 % higher
    perturbed = tmp_path / "perturbed.log"
    perturbed.write_text(re.sub(r"lm loss: (\S+) \|", lambda m: f"lm loss: {float(m.group(1)) * 1.005:.6E} |",
                                train_log.read_text()))
    assert bench_main(["loss_chart", "-b", str(train_log), "-i", str(perturbed), "-o", str(tmp_path / "p"),
                       "-s", "8"]) == 1
    assert json.loads((tmp_path / "p" / "loss_chart.json").read_text())["mean_relative_error"] == \
        pytest.approx(0.005, rel=1e-3)

    # a Megatron-format log of the same losses, written with Megatron's format strings, read by bench precision
    losses = read_log(str(jmegatron_log / "ckpt" / "metrics.jsonl")).loss()
    megatron = write_megatron_log(tmp_path / "megatron.log", losses, ranks=1, train_iters=8, gbs=4)
    proc = _run("jmegatron.bench", "--devices", "1", "precision", *TINY, "--reference", str(megatron),
                "--window", "8", "--out", str(tmp_path / "precision"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "precision" / "precision.json").read_text())
    assert r["passed"] and r["iterations"] == list(range(1, 9)) and r["max_window_mean"] < 1e-5
    # that run's own stdout is a second jmegatron log: loss_chart against the first passes
    second = tmp_path / "second.log"
    second.write_text(proc.stdout)
    assert bench_main(["loss_chart", "-b", str(train_log), "-i", str(second), "-o", str(tmp_path / "two"),
                       "-s", "8"]) == 0
    assert read_loss_log(str(megatron)) == {i: float(f"{v:.6E}") for i, v in losses.items()}


# ------------------------------------------------------------ the logger's own parts
class FakeDevice:
    def __init__(self, id, stats):
        self.id, self._stats = id, stats

    def memory_stats(self):
        return self._stats


def test_logger_device_memory_lines_and_mfu(tmp_path, capsys):
    import io

    from jmegatron.training.logging import MetricsLogger

    stream = io.StringIO()
    logger = MetricsLogger(str(tmp_path), None, flops_per_iteration=4e12, num_devices=2, peak_tflops=1.0,
                           train_iters=10, stream=stream, theoretical_peak_tflops=4.0)
    gpu = [FakeDevice(0, {"bytes_in_use": 3 * 2 ** 20, "peak_bytes_in_use": 5 * 2 ** 20, "pool_bytes": 8 * 2 ** 20,
                          "peak_pool_bytes": 9 * 2 ** 20, "bytes_reserved": 0, "bytes_limit": 70 * 2 ** 30}),
           FakeDevice(1, {"bytes_in_use": 2 ** 20, "bytes_reserved": 0, "bytes_limit": 2 ** 30})]
    step = {"lm_loss": 2.0, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.5, "num_tokens": 64.0, "skipped": 0, "nan": 1}
    record = logger.log_train(3, [step, dict(step, lm_loss=4.0)], elapsed_s=1.0, consumed_samples=24,
                              global_batch_size=8, memory_devices=gpu)
    logger.close()
    # 2 iterations of 4 TFLOP in 1 s on 2 devices: 4 TFLOP/s/device, 400 % of 1.0, 100 % of 4.0
    assert record["mfu"] == pytest.approx(4.0) and record["mfu_theoretical"] == pytest.approx(1.0)
    assert "peak" in capsys.readouterr().err  # MFU > 100 % is said once
    logger2 = MetricsLogger(None, None, 4e12, 2, 1.0, 10, stream=io.StringIO())
    logger2.log_train(1, [step], 1.0)
    logger2.log_train(2, [step], 1.0)
    assert capsys.readouterr().err.count("WARNING: MFU") == 1
    path = tmp_path / "stdout.log"
    path.write_text(stream.getvalue())
    log = read_log(str(path))
    assert log.loss() == {3: 3.0} and log.fields[3]["number of nan iterations"] == 2  # per interval, as Megatron
    assert log.fields[3]["MFU (theoretical peak)"] == 100.0
    m0, m1 = log.memory[0][0], log.memory[1][0]
    assert (m0.allocated, m0.max_allocated, m0.reserved, m0.max_reserved) == (3.0, 5.0, 8.0, 9.0)
    assert m0.source == "device memory_stats (reserved: pool_bytes)"
    assert (m1.allocated, m1.max_allocated, m1.reserved) == (1.0, 1.0, 1024.0)
    jsonl = read_log(str(tmp_path / "metrics.jsonl"))
    assert jsonl.memory[1][0].reserved == 1024.0 and jsonl.loss() == {2: 2.0, 3: 4.0}


def test_num_zeros_in_grad_counts_the_reduced_gradients():
    """``num_zeros`` (Megatron's --log-num-zeros-in-grad) equals a count over the gradients
    the step applies, under dp 2 with 2 micro-batches: the unused vocabulary rows of the
    embedding have zero gradients (tokens are drawn from 40 of the 128 entries)."""
    import jax
    import numpy as np

    from jmegatron.config import base_config, from_configdict
    from jmegatron.parallel.mesh import create_mesh
    from jmegatron.training.run import build

    c = base_config()
    c.mock_data, c.vocab_size, c.num_layers, c.hidden_size, c.num_attention_heads = True, 128, 1, 16, 2
    c.ffn_hidden_size, c.seq_length, c.max_position_embeddings = 32, 8, 8
    c.micro_batch_size, c.global_batch_size, c.log_num_zeros_in_grad = 1, 4, True
    c.untie_embeddings_and_output_weights = True  # tied, the output layer gives every row a gradient
    cfg = from_configdict(c)
    run = build(cfg, create_mesh(cfg, jax.devices()[:2]))
    rs = np.random.RandomState(0)
    toks = rs.randint(0, 40, size=(4, 9)).astype(np.int32)
    batch = {"tokens": toks[:, :-1], "labels": toks[:, 1:], "loss_mask": np.ones((4, 8), np.float32),
             "position_ids": np.tile(np.arange(8, dtype=np.int32), (4, 1))}
    batch = run.put_batch({k: v.reshape(run.num_microbatches, -1, 8) for k, v in batch.items()})
    state = run.init_state()
    grads, _, _ = run.compute_grads(state, batch)
    expected = sum(int(np.sum(np.asarray(g) == 0)) for g in jax.tree.leaves(jax.device_get(grads)))
    _, metrics = run.train_step(state, batch)
    assert expected >= (128 - 40) * 16  # at least the unused embedding rows
    assert float(metrics["num_zeros"]) == expected
