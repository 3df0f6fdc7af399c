"""python -m jmegatron.tools.gpu_check: the same machinery on the CPU (--platform cpu,
tiny shapes, 3 steps); without an NVIDIA GPU the default platform says so and exits 0."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jmegatron.config import ConfigError
from jmegatron.tools import gpu_check


def test_without_a_gpu_it_says_so_and_exits_0(capsys):
    if gpu_check.nvidia_devices():
        pytest.skip("this machine has an NVIDIA GPU")
    assert gpu_check.main(["--steps", "2"]) == 0
    assert "no NVIDIA GPU found (jax.devices(): cpu:" in capsys.readouterr().out


def _table_rows(out):
    rows = {}
    for line in out.splitlines():
        for v in gpu_check.VARIANTS:
            if line.startswith(v.name + " ") and "precision" not in line:
                rows[v.name] = line
    return rows


def test_cpu_platform_compares_every_cpu_variant_with_the_xla_float32_curve(capsys, monkeypatch):
    seen = {}
    real = gpu_check.run_variant

    def spy(variant, *a, **kw):
        row = real(variant, *a, **kw)
        seen[variant.name] = row
        return row
    monkeypatch.setattr(gpu_check, "run_variant", spy)
    assert gpu_check.main(["--platform", "cpu", "--tiny", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    names = {v.name for v in gpu_check.VARIANTS if "cpu" in v.platforms}
    assert set(seen) == names and set(_table_rows(out)) == names  # every CPU variant has a row
    assert not any("cudnn" in n or "TE" in n for n in seen)  # GPU-only rows are not attempted
    ref = seen["xla float32 (reference)"]
    assert ref.status == "reference" and len(ref.losses) == 3 and ref.tokens_per_s > 0
    bf16 = seen["xla bf16"]
    assert bf16.status == "ok" and 0 < bf16.max_rel_diff <= gpu_check.TOLERANCES["bfloat16"]
    assert bf16.losses != ref.losses  # really another precision
    kern = seen["cpu kernels float32"]  # the CPU kernels compile here: the row runs and passes
    assert kern.status == "ok" and kern.max_rel_diff <= gpu_check.TOLERANCES["float32"]
    for row in seen.values():  # every row that applies on the CPU is built here and passes
        assert row.status in ("ok", "reference"), (row.name, row.status)


def test_a_loss_curve_outside_its_tolerance_fails_the_check(capsys, monkeypatch):
    # the curves are given (training itself is the test above's): bf16's second loss 10% off
    def curves(cfg, device, steps):
        return ([6.0, 5.5] if cfg.bf16 else [6.0, 5.0]), 1.0, 0, None
    monkeypatch.setattr(gpu_check, "train_losses", curves)
    assert gpu_check.main(["--platform", "cpu", "--tiny", "--steps", "2", "--only", "xla bf16"]) == 1
    captured = capsys.readouterr()
    assert "FAILED: xla bf16" in captured.err and "FAIL" in _table_rows(captured.out)["xla bf16"]


def test_a_compile_failure_fails_its_row_and_the_table_goes_on(capsys, monkeypatch):
    # a Triton-like compile error in one variant: its row says ERROR with the reason, the rows
    # after it still run, and the exit status is 1
    def curves(cfg, device, steps):
        if cfg.bf16:
            raise RuntimeError("INTERNAL: Failed to compile Triton kernel\nmore detail")
        return [6.0, 5.0], 1.0, 0, None
    monkeypatch.setattr(gpu_check, "train_losses", curves)
    assert gpu_check.main(["--platform", "cpu", "--tiny", "--steps", "2", "--only", "xla"]) == 1
    captured = capsys.readouterr()
    rows = _table_rows(captured.out)
    assert "ERROR: RuntimeError: INTERNAL: Failed to compile Triton kernel" in rows["xla bf16"]
    assert rows["xla fp16"].endswith("ok")  # listed after the failing row, still run
    assert "Traceback" in captured.err and "FAILED: xla bf16" in captured.err


@pytest.mark.parametrize("error", [ConfigError, ImportError, NotImplementedError])
def test_a_built_row_that_raises_fails_the_command(error, capsys, monkeypatch):
    """A set-up error in a row that applies here (a ConfigError, an ImportError, a
    NotImplementedError: the errors of a kernel or dtype that stopped working) is that row's
    ERROR and exit status 1, never a skip."""

    def curves(cfg, device, steps):
        if cfg.attention_impl == "cpu":
            raise error("planted: the CPU kernels did not build")
        return [6.0, 5.0], 1.0, 0, None
    monkeypatch.setattr(gpu_check, "train_losses", curves)
    assert gpu_check.main(["--platform", "cpu", "--tiny", "--steps", "2", "--only", "cpu kernels"]) == 1
    captured = capsys.readouterr()
    row = _table_rows(captured.out)["cpu kernels float32"]
    assert f"ERROR: {error.__name__}: planted: the CPU kernels did not build" in row
    assert "FAILED: cpu kernels float32" in captured.err


def test_a_row_computing_in_the_wrong_dtype_fails(capsys, monkeypatch):
    """An fp16 row whose model computes in float32 would match the reference trivially: ERROR."""
    real = gpu_check.ModelConfig.from_config

    def float32_model(cfg, *a, **kw):
        return dataclasses.replace(real(cfg, *a, **kw), dtype=jnp.float32)
    monkeypatch.setattr(gpu_check.ModelConfig, "from_config", staticmethod(float32_model))
    monkeypatch.setattr(gpu_check, "train_losses", lambda cfg, device, steps: ([6.0, 5.0], 1.0, 0, None))
    assert gpu_check.main(["--platform", "cpu", "--tiny", "--steps", "2", "--only", "xla fp16"]) == 1
    row = _table_rows(capsys.readouterr().out)["xla fp16"]
    assert "ERROR: RuntimeError: the model computes in float32, not float16" in row


def test_a_row_this_machine_cannot_run_is_not_applicable_before_it_runs(monkeypatch):
    """The Transformer Engine row without TE: "not applicable" with the reason, decided
    before anything of the row is prepared; not a failure of the command."""
    def never(*a, **kw):
        raise AssertionError("a row that does not apply was run")
    monkeypatch.setattr(gpu_check, "train_losses", never)
    monkeypatch.setattr(gpu_check, "load_config_file", never)
    monkeypatch.setattr(gpu_check.te, "te_available", lambda: (False, "No module named 'transformer_engine'"))
    te_row = next(v for v in gpu_check.VARIANTS if "TE" in v.name)
    row = gpu_check.run_variant(te_row, {}, jax.devices("cpu")[0], 2, [6.0, 5.0])
    assert row.status == "not applicable: Transformer Engine unavailable: No module named 'transformer_engine'"
    assert all(v.not_applicable is None for v in gpu_check.VARIANTS if v is not te_row)


def test_steps_the_optimizer_skipped_fail_the_row(capsys, monkeypatch):
    # an fp16 curve that matches only because nothing trained: every step skipped on overflow
    def curves(cfg, device, steps):
        assert not cfg.fp16 or cfg.initial_loss_scale == gpu_check.FP16["initial_loss_scale"]
        return [6.0, 5.0], 1.0, (steps if cfg.fp16 else 0), None
    monkeypatch.setattr(gpu_check, "train_losses", curves)
    assert gpu_check.main(["--platform", "cpu", "--tiny", "--steps", "2", "--only", "xla fp16"]) == 1
    row = _table_rows(capsys.readouterr().out)["xla fp16"]
    assert "FAIL (2 of 2 steps skipped by the optimizer)" in row


def test_float32_rows_state_tf32_and_take_its_peak():
    """A float32 row on a Hopper GPU computes its dots in TF32 under JAX's default precision
    (MFU against TF32's tensor-core peak) and in float32 under HIGHEST (the SIMT peak); the
    CPU computes float32."""
    class H100:
        platform, device_kind, compute_capability = "gpu", "NVIDIA H100 80GB HBM3", "9.0"

    gpu = H100()
    assert gpu_check.dot_precision(gpu, "float32") == "TF32"
    assert gpu_check.dot_precision(gpu, "float32", "highest") == "float32"
    assert gpu_check.dot_precision(gpu, "bfloat16") == "bf16"
    assert gpu_check._peak_tflops(gpu, "float32", "TF32")[0] == 494.7
    assert gpu_check._peak_tflops(gpu, "float32", "float32")[0] == 67.0
    import jax
    cpu = jax.devices("cpu")[0]
    assert gpu_check.dot_precision(cpu, "float32") == "float32"
    assert gpu_check.allocator_memory(cpu) is None  # the CPU keeps no allocator statistics
    highest = [v for v in gpu_check.VARIANTS if v.matmul_precision == "highest"]
    assert highest and all(v.platforms == ("gpu",) for v in highest)
