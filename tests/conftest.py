"""Test set-up: 8 simulated CPU devices, set before JAX is imported anywhere."""

import json
import os
import pathlib
import re

# --xla_backend_optimization_level=0: XLA:CPU's LLVM back end without its optimization passes.
# The suite's models are tiny, so compiling dominates its time and running barely matters:
# this cuts the suite's time by ~40% (test_parallel_equivalence, test_fp8, test_mixed_precision,
# test_layout_equivalence: 949 s -> 585 s). The HLO is the same and every assertion holds (the
# golden losses of test_layout_equivalence included); subprocesses inherit the flag.
_flags = os.environ.get("XLA_FLAGS", "").split()
_flags.append("--xla_force_host_platform_device_count=8")
if not any(f.startswith("--xla_backend_optimization_level") for f in _flags):
    _flags.append("--xla_backend_optimization_level=0")
# JAX's persistent compilation cache, for this test session only (one folder shared by the
# xdist workers, removed at the end): the suite compiles the same programs again and again
# (every resumed run, every one-device reference), and a hit skips XLA's compile. XLA:CPU's
# concurrency-optimized scheduler is off: with it, a multi-device program read back from the
# cache deadlocks in its all-reduces on jaxlib 0.10.2 (devices reach them in different orders;
# a fresh compile does not). The cache is set in this process's jax.config, not in the
# environment, so subprocesses (which set their own XLA_FLAGS) never read it.
if not any(f.startswith("--xla_cpu_enable_concurrency_optimized_scheduler") for f in _flags):
    _flags.append("--xla_cpu_enable_concurrency_optimized_scheduler=false")
os.environ["XLA_FLAGS"] = " ".join(_flags)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import shutil  # noqa: E402
import tempfile  # noqa: E402
import uuid  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# the controller sets the run's name before it starts the xdist workers, which inherit it
_RUN = os.environ.setdefault("JMEGATRON_TEST_RUN", uuid.uuid4().hex)
JAX_CACHE = pathlib.Path(tempfile.gettempdir()) / f"jmegatron-test-jax-cache-{_RUN}"
if not os.environ.get("JMEGATRON_TEST_NO_JAX_CACHE"):  # set it to compare timings or debug without
    jax.config.update("jax_compilation_cache_dir", str(JAX_CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def subprocess_env(devices: int, cache: bool = True) -> dict:
    """``os.environ`` for a one-process JAX subprocess of a test: ``devices`` simulated CPU
    devices with this suite's compile flags (above), and this run's compilation cache unless
    ``cache=False`` (never for multi-process runs: their collectives are not this process's)."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                                     "--xla_backend_optimization_level=0 "
                                     "--xla_cpu_enable_concurrency_optimized_scheduler=false")
    if cache and not os.environ.get("JMEGATRON_TEST_NO_JAX_CACHE"):
        env.update(JAX_COMPILATION_CACHE_DIR=str(JAX_CACHE), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
    return env


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist)
        shutil.rmtree(JAX_CACHE, ignore_errors=True)


REPO = pathlib.Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "shakespeare"


_DURATIONS = pathlib.Path(__file__).with_name("durations.json")


def pytest_collection_modifyitems(config, items):
    """Heaviest test files first (tests/durations.json, written by tests/update_durations.py;
    a file not in it counts as the median), tests kept in file order: with ``make test``'s
    ``--dist loadfile --no-loadscope-reorder`` each worker takes the next-longest file, so the
    two finish close together instead of one running a long file alone at the end."""
    weights = json.loads(_DURATIONS.read_text()) if _DURATIONS.is_file() else {}
    default = sorted(weights.values())[len(weights) // 2] if weights else 0.0
    items.sort(key=lambda item: -weights.get(item.nodeid.split("::")[0], default))


@pytest.fixture(scope="session")
def shakespeare_dir() -> pathlib.Path:
    if not SHAKESPEARE.is_dir():
        pytest.skip(f"Shakespeare corpus not found at {SHAKESPEARE} (see shared/data/shakespeare/SOURCE.md)")
    return SHAKESPEARE


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch's OpenMP threads spin-wait on a shared 2-core machine: one thread is ~20x faster
    for the small models of the export tests. Use as ``pytestmark =
    pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def mcore():
    """megatron-core on the CPU for a test module (one process, gloo): its parallel state
    initialised (``export.megatron.init_megatron_core_cpu``) and the three CUDA assumptions
    of its forward pass made CPU no-ops (RoPE's ``inv_freq`` moved to
    ``torch.cuda.current_device()``, the dropout RNG tracker's fork, the router's
    ``te_general_gemm`` name without Transformer Engine)."""
    import contextlib

    import torch
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    from jmegatron.export import megatron as M

    M.init_megatron_core_cpu()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "current_device", lambda: "cpu")
        mp.setattr(tp_random.CudaRNGStatesTracker, "fork", lambda self, name=None: contextlib.nullcontext())
        mp.setattr(moe_utils, "te_general_gemm", None, raising=False)
        yield


# ------------------------------------------------------------------------------- expected skips
# The [test] extra (pyproject.toml) is imported by the tests that need it, never skipped: a
# missing package fails its tests. What may skip is only what needs hardware or software this
# machine does not have, listed here; any other skip fails the run (exit status 1) and is
# listed under "unexpected skips". The check runs in the xdist controller, which sees every
# worker's reports (a module skipped at collection included).
EXPECTED_SKIPS = {
    "Transformer Engine": re.compile(r"Transformer Engine unavailable: |Transformer Engine's kernels need an NVIDIA GPU"),
    "cuDNN": re.compile(r"cuDNN attention needs an NVIDIA GPU"),
    "the TensorRT-LLM engine": re.compile(r"tensorrt_llm is not importable here"),
    "the no-GPU message of gpu_check (on a GPU machine)": re.compile(r"this machine has an NVIDIA GPU"),
}


class ExpectedSkips:
    """Sorts each skip report by EXPECTED_SKIPS; an unmatched one fails the session."""

    def __init__(self):
        self.expected: dict[str, int] = {}
        self.unexpected: list[tuple[str, str]] = []  # (node id, reason)

    def _record(self, report):
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        longrepr = report.longrepr
        reason = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)
        for name, pattern in EXPECTED_SKIPS.items():
            if pattern.search(reason):
                self.expected[name] = self.expected.get(name, 0) + 1
                return
        self.unexpected.append((report.nodeid, reason))

    def pytest_runtest_logreport(self, report):
        self._record(report)

    def pytest_collectreport(self, report):
        self._record(report)

    def pytest_sessionfinish(self, session):
        if self.unexpected and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if self.expected:
            terminalreporter.write_line("expected skips: " + ", ".join(f"{n} ({k})" for n, k in self.expected.items()))
        if self.unexpected:
            terminalreporter.section("unexpected skips", sep="=", red=True, bold=True)
            for nodeid, reason in self.unexpected:
                terminalreporter.write_line(f"{nodeid}: {reason}")
            terminalreporter.write_line(
                f"{len(self.unexpected)} skip(s) outside the expected set ({', '.join(EXPECTED_SKIPS)}) fail "
                "the run: install the [test] extra (pip install -e '.[test]') or fix what the reason names "
                "(tests/conftest.py, EXPECTED_SKIPS)", red=True)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        config.pluginmanager.register(ExpectedSkips(), "jmegatron-expected-skips")
