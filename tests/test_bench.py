"""python -m jmegatron.bench: the windowed relative error, log reading, memory helpers, the
stored peak, and the subcommands end to end on a very small gpt_tiny (subprocesses)."""

import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import pytest

from jmegatron.bench import common
from jmegatron.bench.memory import bucket_length, draw_lengths, rss_growth
from jmegatron.bench.precision import read_loss_log, windowed_relative_error, write_loss_log

REPO = pathlib.Path(__file__).resolve().parents[1]


# ------------------------------------------------------------ precision maths
def _curves(errors, ref=2.5):
    reference = {i + 1: ref for i in range(len(errors))}
    losses = {i + 1: ref * (1 + e) for i, e in enumerate(errors)}
    return losses, reference


def test_windowed_relative_error_known_curve():
    # 100 steps at 0.1 % error, ten of them (51-60) at 0.5 %: the worst 50-step window holds
    # all ten, mean (40 * 0.001 + 10 * 0.005) / 50 = 0.18 % < 0.2 %.
    errors = [0.001] * 100
    errors[50:60] = [0.005] * 10
    r = windowed_relative_error(*_curves(errors))
    assert r["window"] == 50 and not r["short_window"] and r["contiguous"]
    assert len(r["window_means"]) == 51
    assert r["max_window_mean"] == pytest.approx(0.0018, rel=1e-9)
    assert r["worst_window"][1] - r["worst_window"][0] == 49
    assert r["worst_window"][0] <= 51 and r["worst_window"][1] >= 60
    assert r["mean_relative_error"] == pytest.approx((90 * 0.001 + 10 * 0.005) / 100, rel=1e-9)
    assert r["max_step_relative_error"] == pytest.approx(0.005, rel=1e-9)
    assert r["passed"]
    # Two more bad steps inside that window: (38 * 0.001 + 12 * 0.005) / 50 = 0.196 %; three: 0.204 %.
    errors[60:62] = [0.005] * 2
    assert windowed_relative_error(*_curves(errors))["passed"]
    errors[62] = 0.005
    r = windowed_relative_error(*_curves(errors))
    assert r["max_window_mean"] == pytest.approx(0.00204, rel=1e-9) and not r["passed"]
    # The same errors spread out never fill one window: windows average them away.
    spread = [0.005 if i % 10 == 0 else 0.001 for i in range(100)]
    assert windowed_relative_error(*_curves(spread))["max_window_mean"] == pytest.approx(0.0014, rel=1e-9)


def test_windowed_relative_error_short_and_partial():
    losses, reference = _curves([0.01, 0.0, 0.0, 0.0])
    r = windowed_relative_error(losses, reference)
    assert r["short_window"] and r["window"] == 4 and r["requested_window"] == 50
    assert r["max_window_mean"] == pytest.approx(0.0025) and not r["passed"]
    # Only shared iterations are compared; the gap is reported.
    del reference[2]
    r = windowed_relative_error(losses, reference, window=2)
    assert r["iterations"] == [1, 3, 4] and not r["contiguous"]
    with pytest.raises(common.BenchError, match="share no iteration"):
        windowed_relative_error({1: 1.0}, {2: 1.0})
    nan = windowed_relative_error({1: float("nan")}, {1: 1.0})
    assert not nan["passed"]


def test_read_loss_log_formats(tmp_path):
    jm = tmp_path / "metrics.jsonl"  # jmegatron's metrics.jsonl: step_losses per log record, val lines
    jm.write_text("\n".join(json.dumps(r) for r in [
        {"iteration": 3, "lm_loss": 9.0, "step_losses": [3.0, 2.0, 1.0]},
        {"iteration": 3, "val_loss": 5.0, "val_ppl": 148.4},
        {"iteration": 5, "lm_loss": 9.0, "step_losses": [0.5, 0.25]},
    ]) + "\n")
    assert read_loss_log(str(jm)) == {1: 3.0, 2: 2.0, 3: 1.0, 4: 0.5, 5: 0.25}
    other = tmp_path / "other.jsonl"  # one iteration per line, any of the loss keys
    other.write_text('{"iteration": 1, "lm loss": 4.0}\n\n{"iteration": 2, "loss": 3.5}\n'
                     '{"iteration": 2, "lm_loss": 3.25}\n')
    assert read_loss_log(str(other)) == {1: 4.0, 2: 3.25}  # a repeated iteration keeps the last
    out = tmp_path / "roundtrip.jsonl"
    write_loss_log(out, {2: 1.5, 1: 2.5}, "test")
    assert read_loss_log(str(out)) == {1: 2.5, 2: 1.5}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"iteration": 1, "loss": 1.0}\nnot json\n')
    with pytest.raises(common.BenchError, match="bad.jsonl:2 is not JSON"):
        read_loss_log(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"iteration": 1, "val_loss": 1.0}\n')
    with pytest.raises(common.BenchError, match="no per-iteration losses"):
        read_loss_log(str(empty))
    with pytest.raises(common.BenchError, match="does not exist"):
        read_loss_log(str(tmp_path / "missing.jsonl"))


# ------------------------------------------------------------ memory helpers
def test_bucket_lengths_and_draws():
    assert [bucket_length(n, 64) for n in (1, 64, 65, 128, 129, 1000, 2048)] == [64, 64, 128, 128, 256, 1024, 2048]
    lengths = draw_lengths(40, 64, 2048, seed=3)
    assert len(lengths) == 40 and min(lengths) == 64 and max(lengths) == 2048
    assert all(64 <= n <= 2048 for n in lengths) and lengths == draw_lengths(40, 64, 2048, seed=3)
    assert len({bucket_length(n, 64) for n in lengths}) <= 6


def test_rss_growth():
    flat = [100.0] * 10 + [200.0] * 90  # warm-up allocations, then flat
    g = rss_growth(flat, warmup=10, window=20)
    assert g["growth"] == 0.0 and g["passed"] and g["baseline_bytes"] == 200.0
    leak = [200.0 + 0.05 * i for i in range(100)]  # +5 over 100 steps: 2.4 % from the baseline window
    g = rss_growth(leak, warmup=0, window=10)
    assert g["baseline_bytes"] == pytest.approx(200.225) and g["final_bytes"] == pytest.approx(204.725)
    assert g["growth"] == pytest.approx(4.5 / 200.225) and not g["passed"]
    with pytest.raises(ValueError, match="nothing after warmup"):
        rss_growth([1.0] * 5, warmup=5)


# (the stored peak and its resolution: tests/test_peak.py)


# ------------------------------------------------------------ end to end
TINY = ["--config", "configs/gpt_tiny.py", "--config.mock_data=True", "--config.vocab_size=128",
        "--config.num_layers=2", "--config.hidden_size=32", "--config.ffn_hidden_size=64",
        "--config.num_attention_heads=2", "--config.seq_length=16", "--config.max_position_embeddings=16",
        "--config.micro_batch_size=2", "--config.global_batch_size=4", "--config.lr_warmup_iters=2",
        "--config.lr_decay_iters=10",
        "--config.hidden_dropout=0", "--config.attention_dropout=0", "--config.peak_tflops=1.0",
        "--config.log_interval=5"]


def _bench(*args, devices=1, cache_dir=None):
    # the suite's compile flags (tests/conftest.py), without its device count: --devices sets it.
    # Unoptimized XLA:CPU code compiles ~2x faster; what the tests read (losses to 1e-4 of
    # torch's, compiled buffer sizes, RSS, step times) holds for it.
    env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0 "
                                     "--xla_cpu_enable_concurrency_optimized_scheduler=false")
    if cache_dir:
        # Test speed only: the commands compile the same train step many times (fixed
        # lr_decay_iters keeps its HLO equal across commands); JAX's persistent cache
        # reuses the executables. The full runs in docs/bench compile afresh.
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    proc = subprocess.run([sys.executable, "-m", "jmegatron.bench", "--devices", str(devices), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return proc


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")


@pytest.mark.slow
def test_precision_against_torch_reference(bench_dir, jax_cache):
    out = bench_dir / "precision"
    proc = _bench("precision", *TINY, "--train-iters", "10", "--reference", "torch", "--out", str(out),
                  cache_dir=jax_cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((out / "precision.json").read_text())
    assert r["passed"] and r["reference_kind"] == "torch" and r["iterations"] == list(range(1, 11))
    assert r["short_window"] and r["window"] == 10
    assert r["max_window_mean"] < 1e-4  # float32 vs float32: rounding only
    assert r["losses"][0] != r["losses"][-1]  # it trained
    ref = [json.loads(line) for line in (out / "reference" / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in ref] == list(range(1, 11)) and ref[0]["lr"] == 0.0  # Megatron: lr(0) first
    assert (out / "precision.png").stat().st_size > 0 and "PASS" in (out / "precision.md").read_text()


@pytest.mark.slow
def test_determinism(bench_dir, jax_cache):
    out = bench_dir / "determinism"
    # run B in this process to keep the test short (the full run in docs/bench uses a new process)
    proc = _bench("determinism", *TINY, "--train-iters", "4", "--same-process", "--out", str(out),
                  cache_dir=jax_cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((out / "determinism.json").read_text())
    assert r["passed"] and r["run_b"] == "same process" and r["resume"]["stopped_at"] == 2
    assert r["resume"]["resumed_iterations"] == [3, 4]
    assert len(set(r["params_sha256"].values())) == 1 and len(set(r["state_sha256"].values())) == 1
    assert r["losses"]["A"] == r["losses"]["B"] == r["losses"]["resumed"] and len(r["losses"]["A"]) == 4
    assert not (out / "checkpoints").exists()


@pytest.mark.slow
def test_memory(bench_dir, jax_cache):
    out = bench_dir / "memory"
    # tp2 x dp2 with ZeRO-1 compiled on 4 devices; the RSS and variable-length parts train on one.
    proc = _bench("memory", *TINY, "--layouts", "tp2-dp2-zero1", "--train-devices", "1",
                  "--steps", "30", "--warmup-steps", "10", "--window", "10", "--varlen-steps", "4",
                  "--min-seq", "24", "--max-seq", "64", "--out", str(out), devices=4, cache_dir=jax_cache)
    # Every check must pass: layouts compile, RSS stays flat, every length trains.
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((out / "memory.json").read_text())
    assert r["passed"] and "[bench memory] PASS" in proc.stdout
    assert [lr["layout"] for lr in r["layouts"]] == ["tp2-dp2-zero1"] and r["layout_errors"] == []
    for lr in r["layouts"]:
        c, t, state = lr["compiled"], lr["theoretical"], lr["state_bytes_per_device"]
        assert c["argument_size_in_bytes"] > 0 and c["temp_size_in_bytes"] > 0
        assert "generated_code_size_in_bytes" in c
        # The compiled arguments are the state shard plus the batch; the theory counts the state.
        assert c["argument_size_in_bytes"] - lr["batch_bytes_per_device"] == \
            pytest.approx(state["params"] + state["opt_state"], abs=64)
        assert state["params"] == t["weights"]
        assert state["opt_state"] == pytest.approx(t["optimizer_state"], rel=1e-3)
    # AdamW's two float32 moments per parameter, halved by ZeRO-1 over dp2: as many bytes as the weights.
    assert t["optimizer_state"] == pytest.approx(t["weights"])
    v = r["varlen"]
    assert v["error"] is None and len(v["steps"]) == 4 and v["passed"]
    assert {s["bucket"] for s in v["steps"]} == {32, 64} and 24 in v["lengths"] and 64 in v["lengths"]
    assert v["backend_compiles"] == v["buckets_used"] == 2 and v["jit_cache_size"] == 2
    rss = r["rss"]
    assert len(rss["rss_bytes"]) == 30 and rss["all_losses_finite"] and rss["live_arrays_constant"]
    assert rss["passed"] and rss["threshold"] == 0.01 and rss["warmup_steps"] == 10 and rss["window"] == 10
    # From the raw series, not the module's medians: after the 10 warm-up steps RSS never
    # rises 1 % above its value at step 11 (~5 MB of a ~500 MB baseline: a leaked copy of
    # this model's TrainState, 21,760 parameters and two AdamW moments = 0.26 MB, every
    # step would reach it in 20 steps).
    after = rss["rss_bytes"][10:]
    assert max(after) < 1.01 * after[0], (after[0], max(after))
    for png in ("memory_rss.png", "memory_seqlen.png", "memory_layouts.png"):
        assert (out / png).stat().st_size > 0


@pytest.mark.slow
def test_mfu_and_report(bench_dir, jax_cache):
    out = bench_dir / "mfu"
    t0 = time.perf_counter()
    proc = _bench("mfu", *TINY, "--warmup", "1", "--steps", "3", "--out", str(out), cache_dir=jax_cache)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((out / "mfu.json").read_text())
    assert r["peak_tflops"] == 1.0 and r["peak_source"] == "config.peak_tflops"
    # The model, counted by hand (TINY: L 2, h 32, ffn 64, 2 heads, seq 16, vocab 128 = its
    # padded size, learned positions, LayerNorm, biases, tied output layer).
    L, h, ffn, s, V, B = 2, 32, 64, 16, 128, 4
    per_layer = 2 * (2 * h) + (h * 3 * h + 3 * h) + (h * h + h) + (h * ffn + ffn) + (ffn * h + h)
    assert r["num_parameters"] == V * h + s * h + L * per_layer + 2 * h == 21_760
    # Megatron's model FLOPs: 2 FLOPs per multiply-accumulate, x3 for forward + backward.
    macs_per_token = L * (3 * h * h + h * h + 2 * h * ffn) + h * V  # QKV, proj, fc1 + fc2; logits
    causal_attention_macs = B * L * (s * s * h // 2) * 2  # QK^T and PV, half the square each
    hand_flops = 6 * (B * s * macs_per_token + causal_attention_macs)
    assert hand_flops == 8_257_536 and r["flops_per_step"] == hand_flops
    # Rates from the timings: the median of the recorded steps, tokens and FLOPs over it.
    times = r["step_seconds"]
    assert len(times) == 3 and all(t > 0 for t in times)
    assert r["median_step_seconds"] == pytest.approx(statistics.median(times))
    assert r["tokens_per_second"] == pytest.approx(B * s / statistics.median(times))
    assert r["tflops_per_device"] * 1e12 * statistics.median(times) == pytest.approx(hand_flops)
    # MFU against the configured 1 TFLOP/s: positive, below 1, and at least what the
    # subprocess's whole wall time (compilation included) would give.
    assert 0 < r["mfu"] < 1
    assert r["mfu"] * 1.0e12 * statistics.median(times) == pytest.approx(hand_flops)
    assert r["mfu"] >= hand_flops / (wall * 1.0e12)
    proc = _bench("report", "--bench-dir", str(bench_dir))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = (bench_dir / "report" / "report.md").read_text()
    assert "| efficiency |" in report
    summary = json.loads((bench_dir / "report" / "report.json").read_text())["summary"]
    assert summary["mfu"]["mfu"] == r["mfu"]


def test_bad_input_exits_2(tmp_path):
    proc = _bench("precision", *TINY, "--reference", str(tmp_path / "none.jsonl"), "--out", str(tmp_path))
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = _bench("memory", *TINY, "--layouts", "tp2-pp2", "--out", str(tmp_path))
    assert proc.returncode == 2 and "unknown part 'pp2'" in proc.stderr
    proc = _bench("mfu", "--config", "configs/gpt_tiny.py", "--config.mock_data=True", "--out", str(tmp_path))
    assert proc.returncode == 2 and "vocab_size" in proc.stderr


# ------------------------------------------------------------ memory_chart as ByteMLPerf runs it
def test_memory_chart_bytemlperf_flags(tmp_path, capsys):
    """ByteMLPerf's run_345M_memory.sh passes memory_chart.py -s 50 -t 0.002 (plain,
    --reserved, --fragment); both flags together judge reserved memory and fragmentation over
    the first 50 iterations both logs report per rank."""
    import re

    from jmegatron.bench.__main__ import main as bench_main
    from test_megatron_log import write_megatron_log

    its = {i: 10.0 for i in range(1, 61)}
    gpu = write_megatron_log(tmp_path / "gpu.log", its, ranks=2, memory_every=True)
    near = write_megatron_log(tmp_path / "near.log", its, ranks=2, memory_every=True, rank_scale={1: 1.001})
    flags = ["-s", "50", "-t", "0.002", "--reserved", "--fragment"]
    out = tmp_path / "near_out"
    assert bench_main(["memory_chart", "-b", str(gpu), "-i", str(near), "-o", str(out), *flags]) == 0
    r = json.loads((out / "memory_chart.json").read_text())
    assert r["metrics"] == ["reserved", "fragment"] and r["passed"] and r["metric"] == "reserved"
    for name, c in r["comparisons"].items():  # 50 iterations x 2 ranks, 51..60 left out by -s
        assert len(c["points"]) == 100 and max(p["iteration"] for p in c["points"]) == 50 and c["steps"] == 50
    assert r["comparisons"]["reserved"]["per_rank"]["1"]["max_difference"] == pytest.approx(0.001)
    assert r["comparisons"]["fragment"]["max_difference"] == pytest.approx(0.0, abs=1e-12)  # a uniform scale
    md = (out / "memory_chart.md").read_text()
    assert "## reserved: PASS" in md and "## fragment: PASS" in md and (out / "memory_chart.png").stat().st_size > 0

    # Rank 0 allocates 2 % less at the same reserved memory: reserved passes, fragmentation fails.
    def less_allocated(m):
        return f"[Rank 0] {m.group(1)} | allocated: {float(m.group(2)) * 0.98}"
    frag = tmp_path / "frag.log"
    frag.write_text(re.sub(r"\[Rank 0\] (.*?) \| allocated: ([0-9.]+)", less_allocated, gpu.read_text()))
    out = tmp_path / "frag_out"
    assert bench_main(["memory_chart", "-b", str(gpu), "-i", str(frag), "-o", str(out), *flags]) == 1
    r = json.loads((out / "memory_chart.json").read_text())
    assert r["comparisons"]["reserved"]["passed"] and not r["comparisons"]["fragment"]["passed"] and not r["passed"]
    assert r["comparisons"]["fragment"]["per_rank"]["0"]["max_difference"] > 0.01
    capsys.readouterr()

    # What cannot apply is refused, named: fewer shared iterations than -s; --max on --fragment alone.
    short = write_megatron_log(tmp_path / "short.log", {i: 10.0 for i in range(1, 41)}, ranks=2, memory_every=True)
    assert bench_main(["memory_chart", "-b", str(gpu), "-i", str(short), "-o", str(out), *flags]) == 2
    assert "share 40 iterations with a memory line, -s asks 50" in capsys.readouterr().err
    assert bench_main(["memory_chart", "-b", str(gpu), "-i", str(near), "-o", str(out), "--fragment", "--max"]) == 2
    assert "--max" in capsys.readouterr().err
