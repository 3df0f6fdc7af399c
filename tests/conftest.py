"""Test set-up: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os
import pathlib

# --xla_backend_optimization_level=0: XLA:CPU's LLVM back end without its optimization passes.
# The suite's models are tiny, so compiling dominates its time and running barely matters:
# this cuts the suite's time by ~40% (test_parallel_equivalence, test_fp8, test_mixed_precision,
# test_layout_equivalence: 949 s -> 585 s). The HLO is the same and every assertion holds (the
# golden losses of test_layout_equivalence included); subprocesses inherit the flag.
_flags = os.environ.get("XLA_FLAGS", "").split()
_flags.append("--xla_force_host_platform_device_count=8")
if not any(f.startswith("--xla_backend_optimization_level") for f in _flags):
    _flags.append("--xla_backend_optimization_level=0")
os.environ["XLA_FLAGS"] = " ".join(_flags)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "shakespeare"


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
