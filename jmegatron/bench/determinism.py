"""``bench determinism``: repeated runs, and a run resumed from a checkpoint, are bit-exact.

Three trainings of the same config through the trainer (``jmegatron.training.loop.pretrain``):

1. run A, N iterations, in this process;
2. run B, the same, in a fresh Python process (``--same-process`` runs it here instead);
3. a resumed run: N/2 iterations saved to a checkpoint (``exit_interval``), then the same
   command again, which resumes from it and trains to N (the trainer's own resume path).

Passes when B and the resumed run have bit-identical losses at every iteration to A's
(float32 compared exactly) and the same sha256 of the final parameters (and of the whole
TrainState: step, params, optimizer state, rng). Outputs in ``--out``: ``determinism.json``,
``determinism.md``, ``determinism.png`` (the three curves and their absolute differences).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

from jmegatron.bench import common

# Modules that import JAX are imported inside the commands: `python -m jmegatron.bench
# --devices N` sets XLA_FLAGS after importing every command module and before JAX starts
# (jmegatron.bench.__main__._set_devices).


def register(sub) -> None:
    """Add the ``determinism`` subcommand to the bench CLI's subparsers."""
    p = common.add_command(sub, "determinism", "repeated and resumed runs must be bit-identical", __doc__)
    common.add_config_arguments(p)
    p.add_argument("--train-iters", type=int, default=None, metavar="N",
                   help="iterations per run (sets config.train_iters; >= 2; default the config's)")
    p.add_argument("--same-process", action="store_true", help="run B in this process (faster, weaker)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep the resume test's checkpoints")
    p.add_argument("--worker-result", default=None, help=argparse.SUPPRESS)  # run B's process writes here
    common.add_out_argument(p, "determinism")
    p.set_defaults(func=run)


def train_once(cfg) -> dict:
    """Run the trainer; returns ``losses`` ({iteration: loss}), ``params_sha256``,
    ``state_sha256``, ``seconds``."""
    from jmegatron.pretrain_gpt import pretrain

    t0 = time.perf_counter()
    summary = pretrain(cfg)
    state = summary["state"]
    return {"losses": {int(k): float(v) for k, v in summary["losses"].items()},
            "params_sha256": common.tree_digest(state.params), "state_sha256": common.tree_digest(state),
            "iteration": int(summary["iteration"]), "seconds": time.perf_counter() - t0}


def compare(a: dict, b: dict) -> dict:
    """Bitwise comparison of two :func:`train_once` results: ``identical_losses``,
    ``first_mismatch`` (iteration or None), ``max_abs_diff``, ``params_identical``,
    ``state_identical``, ``identical`` (all three)."""
    its = sorted(set(a["losses"]) | set(b["losses"]))
    first = next((i for i in its if a["losses"].get(i) != b["losses"].get(i)), None)
    diffs = [abs(a["losses"][i] - b["losses"][i]) for i in its if i in a["losses"] and i in b["losses"]]
    same_losses = first is None
    out = {"identical_losses": same_losses, "first_mismatch": first,
           "max_abs_diff": max(diffs) if diffs else None,
           "params_identical": a["params_sha256"] == b["params_sha256"],
           "state_identical": a["state_sha256"] == b["state_sha256"]}
    out["identical"] = out["identical_losses"] and out["params_identical"] and out["state_identical"]
    return out


def _run_b_subprocess(args, cfg, out) -> dict:
    path = out / "run_b.json"
    if path.exists():
        path.unlink()
    cmd = [sys.executable, "-m", "jmegatron.bench", "determinism", *common.config_argv(args),
           f"--config.train_iters={cfg.train_iters}", "--out", str(out), "--worker-result", str(path)]
    print(f"[bench determinism] run B in a new process: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, env=dict(os.environ))  # XLA_FLAGS (--devices) are inherited
    if proc.returncode != 0 or not path.exists():
        raise common.BenchError(f"run B failed (exit {proc.returncode}): {' '.join(cmd)}")
    result = common.read_json(path)
    path.unlink()
    result["losses"] = {int(k): v for k, v in result["losses"].items()}
    return result


def run(args) -> int:
    """Run ``bench determinism`` from parsed arguments; returns the exit status (0 pass, 1 a check failed, 2 bad input)."""
    overrides = {} if args.train_iters is None else {"train_iters": args.train_iters}
    cfg = common.load_config(args, **overrides)
    if cfg.train_iters < 2:
        raise common.BenchError(f"config.train_iters={cfg.train_iters}: determinism needs >= 2 iterations "
                                "(the resume test saves at N/2)")
    base = common.bench_config(cfg)
    if args.worker_result:
        common.write_json(args.worker_result, train_once(base))
        return 0
    out = common.out_dir(args)
    n, half = cfg.train_iters, cfg.train_iters // 2
    run_a = train_once(base)
    if args.same_process:
        run_b = train_once(base)
    else:
        run_b = _run_b_subprocess(args, cfg, out)
    ckpt = out / "checkpoints"
    shutil.rmtree(ckpt, ignore_errors=True)  # a stale checkpoint would be resumed
    first = train_once(common.bench_config(cfg, save=str(ckpt), exit_interval=half, save_interval=None))
    second = train_once(common.bench_config(cfg, save=str(ckpt), save_interval=None))
    if not args.keep_checkpoints:
        shutil.rmtree(ckpt, ignore_errors=True)
    resumed = dict(second, losses={**first["losses"], **second["losses"]})
    repeat_cmp, resume_cmp = compare(run_a, run_b), compare(run_a, resumed)
    resume_cmp["stopped_at"] = first["iteration"]
    resume_cmp["resumed_iterations"] = sorted(second["losses"])
    passed = repeat_cmp["identical"] and resume_cmp["identical"] and first["iteration"] == half \
        and second["iteration"] == n
    result = {
        "command": "determinism", "config": args.config, "config_overrides": args.config_overrides,
        "train_iters": n, "resume_at": half, "run_b": "same process" if args.same_process else "new process",
        "repeat": repeat_cmp, "resume": resume_cmp, "passed": passed,
        "params_sha256": {"A": run_a["params_sha256"], "B": run_b["params_sha256"],
                          "resumed": resumed["params_sha256"]},
        "state_sha256": {"A": run_a["state_sha256"], "B": run_b["state_sha256"], "resumed": resumed["state_sha256"]},
        "losses": {"A": _listed(run_a), "B": _listed(run_b), "resumed": _listed(resumed)},
        "seconds": {"A": run_a["seconds"], "B": run_b.get("seconds"),
                    "resumed": first["seconds"] + second["seconds"]},
        "environment": common.environment()}
    return common.finish(out, "determinism", result, _chart, markdown, passed,
                         f"repeat identical={repeat_cmp['identical']}, resume at {half} "
                         f"identical={resume_cmp['identical']}, params sha256 {run_a['params_sha256'][:16]}...")


def _listed(r: dict) -> list:
    return [[i, r["losses"][i]] for i in sorted(r["losses"])]


def markdown(r: dict) -> str:
    """The markdown summary of a ``bench determinism`` result (its JSON object)."""
    def row(name, c):
        return [name, c["identical_losses"], c["first_mismatch"] if c["first_mismatch"] is not None else "-",
                c["max_abs_diff"], c["params_identical"], c["state_identical"]]

    return "\n".join([
        "# Determinism", "",
        f"{common.verdict(r['passed'])}: {r['train_iters']} iterations of `{r['config']}` "
        f"{' '.join(r['config_overrides'])}; run B in a {r['run_b']}; the resumed run saved at iteration "
        f"{r['resume_at']} and a second launch continued from the checkpoint.", "",
        common.markdown_table(["vs run A", "losses bit-identical", "first mismatch", "max abs diff",
                               "params identical", "TrainState identical"],
                              [row("run B (repeat)", r["repeat"]), row("resumed run", r["resume"])]), "",
        f"Final params sha256: A `{r['params_sha256']['A']}`, B `{r['params_sha256']['B']}`, "
        f"resumed `{r['params_sha256']['resumed']}`.", "",
        "![losses and differences](determinism.png)"])


def _chart(r: dict, path) -> None:
    import numpy as np

    plt = common.pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    a = dict((i, v) for i, v in r["losses"]["A"])
    styles = {"A": dict(lw=3, alpha=0.4), "B": dict(lw=1.5, ls="--"), "resumed": dict(lw=1, ls=":")}
    for name, pts in r["losses"].items():
        top.plot([i for i, _ in pts], [v for _, v in pts], label=f"run {name}", **styles[name])
    top.axvline(r["resume_at"], color="gray", lw=0.8, ls="--", label="checkpoint / resume")
    top.set_ylabel("lm loss")
    top.set_title("Determinism: repeated and resumed runs")
    top.legend()
    top.grid(alpha=0.3)
    largest = 0.0
    for name in ("B", "resumed"):
        pts = [(i, abs(v - a[i])) for i, v in r["losses"][name] if i in a]
        diffs = np.asarray([d for _, d in pts])
        largest = max(largest, float(diffs.max(initial=0.0)))
        bottom.plot([i for i, _ in pts], diffs, "o-", ms=2, label=f"|{name} - A|")
    if largest == 0.0:
        bottom.set_ylim(-1.0, 1.0)
        bottom.text(0.5, 0.75, "every difference is exactly 0 (bit-identical)", transform=bottom.transAxes,
                    ha="center", fontsize=9)
    bottom.set_ylabel("|loss difference|")
    bottom.set_xlabel("iteration")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    common.save_figure(fig, path)
