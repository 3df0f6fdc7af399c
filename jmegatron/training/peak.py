"""This device's matrix-multiply peak (TFLOP/s), measured and stored, for MFU.

MFU needs a peak. Accelerator vendors publish one; a CPU (or an unknown device) has
none, so ``python -m jmegatron.bench peak`` measures it: chains of square matmuls in
float32 and bfloat16 at several sizes, the median of a few repeats per size, and the
best size's median is the peak of that dtype. The record is stored as JSON (default
``runs/bench/peak.json`` relative to the working directory, or ``$JMEGATRON_PEAK_FILE``).
Every MFU in jmegatron (the trainer's log line via ``loop.default_peak_tflops``, ``bench
mfu``, the reports) uses ``config.peak_tflops`` when set, else the stored peak of this
device kind, else a quick one-size measurement made on the spot (:func:`device_peak_tflops`).

Stored record (``PEAK_FORMAT_VERSION`` 1)::

    {"format_version": 1, "platform": "cpu", "device_kind": "cpu", "num_local_devices": 1,
     "hostname": ..., "cpu_count": 2, "jax_version": ..., "measured_at": "2026-...Z",
     "sizes": [256, 512, 1024, 2048], "repeats": 5, "chain": 4,
     "dtypes": {"float32": {"peak_tflops": 0.1, "best_size": 1024,
                            "by_size": {"256": {"median_tflops": .., "samples_tflops": [..]}, ...}},
                "bfloat16": {...}}}
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

PEAK_FORMAT_VERSION = 1
PEAK_FILE_ENV = "JMEGATRON_PEAK_FILE"
DEFAULT_PEAK_FILE = os.path.join("runs", "bench", "peak.json")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def measure_matmul_tflops(n: int = 1024, dtype=jnp.float32, repeats: int = 5, chain: int = 4) -> float:
    """Median TFLOP/s of ``chain`` back-to-back ``[n, n] @ [n, n]`` products on this process's first device."""
    return float(np.median(matmul_tflops_samples(n, dtype, repeats, chain)))


def matmul_tflops_samples(n: int, dtype=jnp.float32, repeats: int = 5, chain: int = 4) -> list[float]:
    """TFLOP/s of each of ``repeats`` timed runs (after one compile-and-warm-up run) of
    ``chain`` dependent ``[n, n] @ [n, n]`` products in ``dtype`` on the first local device
    (``2 n^3`` FLOPs each). Raises ValueError for non-positive sizes."""
    if n <= 0 or repeats <= 0 or chain <= 0:
        raise ValueError(f"n={n}, repeats={repeats} and chain={chain} must be > 0.")
    a = jax.device_put(jnp.ones((n, n), dtype) / n, jax.local_devices()[0])

    @jax.jit
    def f(x):
        for _ in range(chain):
            x = x @ a
        return x

    f(a).block_until_ready()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        samples.append(2.0 * n ** 3 * chain / (time.perf_counter() - t0) / 1e12)
    return samples


def _device_identity() -> dict:
    dev = jax.local_devices()[0]
    return {"platform": dev.platform, "device_kind": dev.device_kind,
            "num_local_devices": jax.local_device_count()}


def measure_peak(sizes: Sequence[int] = (256, 512, 1024, 2048), dtypes: Sequence[str] = ("float32", "bfloat16"),
                 repeats: int = 5, chain: int = 4) -> dict:
    """Measure every size in every dtype (names from :data:`DTYPES`); returns the record
    described in the module docstring (``peak_tflops`` per dtype = the best size's median).
    Raises ValueError for an unknown dtype name or an empty size list."""
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or not sizes:
        raise ValueError(f"dtypes must be among {sorted(DTYPES)} (got {list(dtypes)}) and sizes non-empty "
                         f"(got {list(sizes)}).")
    record = {"format_version": PEAK_FORMAT_VERSION, **_device_identity(),
              "hostname": platform.node(), "cpu_count": os.cpu_count(), "jax_version": jax.__version__,
              "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "sizes": [int(n) for n in sizes], "repeats": int(repeats), "chain": int(chain), "dtypes": {}}
    for name in dtypes:
        by_size = {}
        for n in sizes:
            samples = matmul_tflops_samples(int(n), DTYPES[name], repeats, chain)
            by_size[str(n)] = {"median_tflops": float(np.median(samples)), "samples_tflops": samples}
        best = max(by_size, key=lambda k: by_size[k]["median_tflops"])
        record["dtypes"][name] = {"peak_tflops": by_size[best]["median_tflops"], "best_size": int(best),
                                  "by_size": by_size}
    return record


def peak_file(path: Optional[str] = None) -> str:
    """Where the measured peak lives: ``path``, else ``$JMEGATRON_PEAK_FILE``, else
    ``runs/bench/peak.json`` (relative to the working directory)."""
    return path or os.environ.get(PEAK_FILE_ENV) or DEFAULT_PEAK_FILE


def save_peak(record: dict, path: Optional[str] = None) -> str:
    """Write ``record`` (from :func:`measure_peak`) as JSON; returns the path written."""
    path = peak_file(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return path


def load_peak(path: Optional[str] = None) -> Optional[dict]:
    """The stored record, or None when the file does not exist. Raises ValueError for a
    file that is not a peak record of this format version (names the path)."""
    path = peak_file(path)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"peak file {path} is unreadable ({e}); rerun python -m jmegatron.bench peak") from e
    if not isinstance(record, dict) or record.get("format_version") != PEAK_FORMAT_VERSION or "dtypes" not in record:
        raise ValueError(f"peak file {path} is not a jmegatron peak record (format_version "
                         f"{PEAK_FORMAT_VERSION}); rerun python -m jmegatron.bench peak")
    return record


def stored_peak_tflops(dtype: str = "float32", path: Optional[str] = None) -> Optional[float]:
    """The stored peak (TFLOP/s) of ``dtype`` ("float32" / "bfloat16") if the record was
    measured on this platform and device kind, else None (a record of another device is
    ignored, not trusted)."""
    record = load_peak(path)
    if record is None:
        return None
    me = _device_identity()
    if (record.get("platform"), record.get("device_kind")) != (me["platform"], me["device_kind"]):
        return None
    entry = record["dtypes"].get(dtype)
    return float(entry["peak_tflops"]) if entry else None


def device_peak_tflops(dtype: str = "float32", path: Optional[str] = None) -> tuple[float, str]:
    """(peak TFLOP/s per device, where it came from) for ``dtype``: the stored measurement
    (source = the file path) or, when none fits this device, a quick 1024-size measurement
    now (source ``"measured now"``)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(DTYPES)}")
    stored = stored_peak_tflops(dtype, path)
    if stored is not None:
        return stored, peak_file(path)
    return measure_matmul_tflops(dtype=DTYPES[dtype]), "measured now"
