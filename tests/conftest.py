"""Test set-up: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os
import pathlib

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
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
