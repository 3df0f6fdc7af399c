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
