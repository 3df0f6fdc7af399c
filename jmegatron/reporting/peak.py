"""The peak (TFLOP/s per device) that MFU divides by: theoretical, measured, or configured.

Every MFU in jmegatron (the trainer's log line, ``bench mfu``, ``bench report``) takes its
denominator from :func:`resolve_peak`, which never times anything:

1. ``config.peak_tflops`` when set (source ``"config.peak_tflops"``);
2. else the record ``python -m jmegatron.bench peak`` stored for *this* machine (default
   ``runs/bench/peak.json`` relative to the working directory, or ``$JMEGATRON_PEAK_FILE``):
   the best sustained GEMM median over the libraries it measured (XLA's dot, the
   project's OpenBLAS kernel, ``torch.matmul``). A record is used only when its key
   matches: on a CPU the model name, the usable physical cores and a hash of the feature
   flags, elsewhere the platform and ``device_kind``, so a record from another machine
   is ignored;
3. else the theoretical peak (:func:`theoretical_peak`).

The theoretical peak is reported beside every MFU as well (``mfu_theoretical``).

CPU theoretical peak = physical cores usable by this process x clock x FLOP/cycle/core:

* cores: distinct (``physical id``, ``core id``) pairs of ``/proc/cpuinfo`` among the
  logical CPUs in ``os.sched_getaffinity(0)`` (SMT siblings share their core's FMA units);
  the logical CPU count when ``core id`` is absent (said in the description).
* clock: ``/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq`` (the maximum boost
  clock: an upper bound, sustained all-core vector clocks are lower), else
  ``/proc/cpuinfo``'s ``cpu MHz`` (the current clock; under a hypervisor without cpufreq,
  usually the nominal one); ``$JMEGATRON_CPU_CLOCK_GHZ`` overrides both. A ``cpu MHz``
  clock is replaced by the core clock ``bench peak`` measured and stored for this machine
  when that is higher (:mod:`jmegatron.reporting.core_clock`: a hypervisor may report a nominal
  2.6 GHz for cores that run at 3.7). Under a hypervisor (``hypervisor`` in the flags) a ``cpu MHz``
  clock with no measured one is not trusted: :func:`resolve_peak` then states no
  theoretical peak and names ``bench peak`` (a nominal clock can give MFUs above 100%;
  docs/PERFORMANCE.md). No clock at all raises :class:`PeakUnavailable` (the trainer then uses no
  peak and says so).
* float32 FLOP/cycle = FMA pipes x (vector width / 32 bits) x 2 (a multiply and an add).
  The vector width is the narrower of the widest ISA in the flags (``avx512f`` 512,
  ``avx2``/``fma``/``avx`` 256, ``sse2``/``asimd`` 128) and the pipes' own width. The number
  of FMA pipes and their width are *not* in cpuinfo: :data:`MICROARCHITECTURES` gives them
  for the cores whose vendor and family identify them (AMD Zen 1-5 from the software
  optimization guides; Intel cores with AVX-512 assumed to have two 512-bit FMA units, as
  Xeon Gold 6xxx/Platinum do, while some Xeon Silver/Bronze and client parts have one),
  else the stated default of two pipes as wide as the widest ISA. Without ``fma`` a
  separate multiply and add pipe give the same count as one FMA pipe.
  ``$JMEGATRON_CPU_FP32_FLOP_PER_CYCLE`` overrides the float32 figure (e.g. 64 for two
  512-bit FMA pipes). Under a hypervisor (``hypervisor`` flag) the guest's CPUID may name an
  older core than the host's (a generic model name such as "AMD EPYC" is a sign): when
  ``bench peak`` measures more than the theoretical peak, the table's assumption is wrong
  for this machine and it says so.
* bfloat16 FLOP/cycle: ``amx_bf16`` 1024 (Intel AMX TDPBF16PS, Intel's figure for
  Sapphire Rapids per core), else ``avx512_bf16`` twice float32's (VDPBF16PS: two bf16
  products per float32 lane), else float32's (bf16 is converted to float32 to multiply).

Accelerators: :data:`ACCELERATOR_DENSE_PEAK_TFLOPS`, dense (no sparsity) spec-sheet
figures keyed by ``jax.devices()[0].device_kind``. float32 on a GPU with tensor cores
uses the TF32 figure, as JAX's default matmul precision computes float32 dots in TF32
there (docs.jax.dev "Matmul precision").

CPU devices of one process share the host's cores: with ``N`` local CPU devices
(``--xla_force_host_platform_device_count``) the per-device peak is the host's / ``N``.

Stored record (``PEAK_FORMAT_VERSION`` 2)::

    {"format_version": 2, "key": "cpu|AMD EPYC|2 cores|flags-sha256:6a93...", "platform": "cpu",
     "device_kind": "cpu", "cpu": {"model_name": ..., "flags_sha256": ..., ...},
     "hostname": ..., "measured_at": "2026-...Z", "sizes": [...], "repeats": 5, "chain": 4,
     "theoretical": {"float32": 0.33, "bfloat16": 0.66, "description": ...},
     "libraries": {"xla": {"float32": {"peak_tflops": .., "best_size": 1024,
                                       "by_size": {"256": {"median_tflops": .., "samples_tflops": [..]}}}},
                   "openblas": {...}, "torch": {...}},
     "skipped": {"openblas": {"bfloat16": "float32 only"}},
     "dtypes": {"float32": {"peak_tflops": .., "library": "torch", "best_size": 2048}, "bfloat16": {...}}}
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import re
import time
from typing import Callable, Optional, Sequence

import numpy as np

from jmegatron.kernels import cpu as kernels_cpu
from jmegatron.kernels.cpu import ops
from jmegatron.reporting import core_clock

PEAK_FORMAT_VERSION = 2
PEAK_FILE_ENV = "JMEGATRON_PEAK_FILE"
CLOCK_ENV = "JMEGATRON_CPU_CLOCK_GHZ"
FLOP_PER_CYCLE_ENV = "JMEGATRON_CPU_FP32_FLOP_PER_CYCLE"
DEFAULT_PEAK_FILE = os.path.join("runs", "bench", "peak.json")
DTYPES = ("float32", "bfloat16")
LIBRARIES = ("xla", "openblas", "torch")
SYSFS_CPU = "/sys/devices/system/cpu"


class PeakUnavailable(ValueError):
    """No theoretical peak can be stated for this device (unknown accelerator, no CPU
    clock); the message names what is missing and the fix."""


# ------------------------------------------------------------------ CPU description
@dataclasses.dataclass(frozen=True)
class CpuInfo:
    """What /proc/cpuinfo and sysfs say about this process's CPU.

    ``flags``: the feature flags of the first processor (x86 ``flags``, Arm ``Features``);
    ``cores``: physical cores among the usable logical CPUs (``cores_note`` says how they
    were counted); ``clock_ghz`` / ``clock_source``: None / the reason when unknown."""
    model_name: str
    vendor_id: str
    family: Optional[int]
    model: Optional[int]
    flags: frozenset
    logical_cpus: int
    cores: int
    cores_note: str
    clock_ghz: Optional[float]
    clock_source: str

    @property
    def flags_sha256(self) -> str:
        return hashlib.sha256(" ".join(sorted(self.flags)).encode()).hexdigest()

    @property
    def key(self) -> str:
        """The stored-record key: model name, usable physical cores (a measurement with
        another CPU affinity does not apply) and a hash of the sorted feature flags."""
        return f"cpu|{self.model_name}|{self.cores} cores|flags-sha256:{self.flags_sha256[:16]}"


def _parse_cpuinfo(text: str) -> list[dict]:
    blocks, cur = [], {}
    for line in text.splitlines():
        if not line.strip():
            if cur:
                blocks.append(cur)
            cur = {}
            continue
        if ":" in line:
            k, v = line.split(":", 1)
            cur.setdefault(k.strip(), v.strip())
    if cur:
        blocks.append(cur)
    return blocks


def _int(text: Optional[str]) -> Optional[int]:
    try:
        return int(text, 0) if text is not None else None
    except ValueError:
        return None


def cpu_info(cpuinfo_text: Optional[str] = None, sysfs_root: str = SYSFS_CPU,
             affinity: Optional[Sequence[int]] = None) -> CpuInfo:
    """Describe the CPU from ``cpuinfo_text`` (default: read ``/proc/cpuinfo``), the cpufreq
    files under ``sysfs_root`` and the logical CPUs ``affinity`` (default
    ``os.sched_getaffinity(0)``, else all). ``$JMEGATRON_CPU_CLOCK_GHZ`` overrides the clock.
    Never raises for missing pieces: unknown fields are empty / None and say why."""
    if cpuinfo_text is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo_text = f.read()
        except OSError:
            cpuinfo_text = ""
    blocks = [b for b in _parse_cpuinfo(cpuinfo_text) if "processor" in b] or _parse_cpuinfo(cpuinfo_text) or [{}]
    first = blocks[0]
    if affinity is None:
        try:
            affinity = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            affinity = [i for i in range(os.cpu_count() or 1)]
    usable = set(int(a) for a in affinity)
    mine = [b for b in blocks if _int(b.get("processor")) in usable] or blocks
    if all("core id" in b for b in mine):
        cores = len({(b.get("physical id", "0"), b["core id"]) for b in mine})
        note = "physical cores (distinct physical id/core id of the usable CPUs)"
    else:
        cores = len(usable) or 1
        note = "logical CPUs (no 'core id' in /proc/cpuinfo: SMT siblings, if any, counted as cores)"
    flags = frozenset((first.get("flags") or first.get("Features") or "").split())
    model_name = (first.get("model name") or first.get("Processor") or first.get("CPU part")
                  or platform.machine() or "unknown")
    clock, source = None, ""
    env = os.environ.get(CLOCK_ENV)
    if env:
        try:
            clock, source = float(env), f"${CLOCK_ENV}"
        except ValueError:
            raise PeakUnavailable(f"${CLOCK_ENV}={env!r} must be a number of GHz") from None
    if clock is None:
        path = os.path.join(sysfs_root, "cpu0", "cpufreq", "cpuinfo_max_freq")
        try:
            with open(path) as f:
                clock, source = int(f.read().strip()) / 1e6, f"max clock from {path}"
        except (OSError, ValueError):
            pass
    if clock is None and first.get("cpu MHz"):
        try:
            clock = float(first["cpu MHz"]) / 1e3
            source = ("current clock from /proc/cpuinfo 'cpu MHz' (no cpufreq in sysfs; under a "
                      "hypervisor usually the nominal clock, boost not counted)")
        except ValueError:
            pass
    if clock is None:
        source = (f"no clock: neither {sysfs_root}/cpu0/cpufreq/cpuinfo_max_freq nor 'cpu MHz' in "
                  f"/proc/cpuinfo; set ${CLOCK_ENV}")
    return CpuInfo(model_name=model_name, vendor_id=first.get("vendor_id", ""),
                   family=_int(first.get("cpu family")), model=_int(first.get("model")), flags=flags,
                   logical_cpus=len(mine), cores=cores, cores_note=note, clock_ghz=clock, clock_source=source)


# ------------------------------------------------------------------ FLOP per cycle
@dataclasses.dataclass(frozen=True)
class Microarchitecture:
    """FMA pipes per core and their width in bits, with where the figure comes from."""
    name: str
    fma_pipes: int
    pipe_bits: int
    reference: str


# (vendor_id, family, predicate on (model, flags)) -> microarchitecture. First match wins.
MICROARCHITECTURES: tuple = (
    ("AuthenticAMD", 0x17, lambda m, f: m is not None and m < 0x30,
     Microarchitecture("AMD Zen / Zen+", 2, 128, "AMD Software Optimization Guide (SOG) for family 17h: "
                                                 "two 128-bit FMA pipes")),
    ("AuthenticAMD", 0x17, lambda m, f: True,
     Microarchitecture("AMD Zen 2", 2, 256, "AMD SOG family 17h models 30h+: two 256-bit FMA pipes")),
    ("AuthenticAMD", 0x19, lambda m, f: "avx512f" in f,
     Microarchitecture("AMD Zen 4", 2, 256, "AMD SOG family 19h models 10h+ (Zen 4): two 256-bit FMA pipes; "
                                            "512-bit instructions take two passes")),
    ("AuthenticAMD", 0x19, lambda m, f: True,
     Microarchitecture("AMD Zen 3", 2, 256, "AMD SOG family 19h (Zen 3): two 256-bit FMA pipes")),
    ("AuthenticAMD", 0x1A, lambda m, f: True,
     Microarchitecture("AMD Zen 5", 2, 512, "AMD SOG family 1Ah (Zen 5): two 512-bit FMA pipes "
                                            "(some mobile parts: 256-bit; override)")),
    ("GenuineIntel", 6, lambda m, f: "avx512f" in f,
     Microarchitecture("Intel core with AVX-512", 2, 512,
                       "assumed two 512-bit FMA units (Xeon Gold 6xxx/Platinum, Sapphire Rapids); some Xeon "
                       "Silver/Bronze and client cores have one: set $JMEGATRON_CPU_FP32_FLOP_PER_CYCLE=32")),
    ("GenuineIntel", 6, lambda m, f: "fma" in f,
     Microarchitecture("Intel core with AVX2/FMA", 2, 256, "Intel optimization manual: two 256-bit FMA units "
                                                           "(Haswell and later client/server cores)")),
)


def _isa_bits(flags: frozenset) -> int:
    if "avx512f" in flags:
        return 512
    if flags & {"avx2", "fma", "avx"}:
        return 256
    return 128  # sse2 (every x86-64) or Arm asimd/neon


def microarchitecture(cpu: CpuInfo) -> Microarchitecture:
    """The table entry of :data:`MICROARCHITECTURES` that fits ``cpu``, else the default:
    two FMA pipes as wide as the widest vector ISA in the flags (stated as an assumption)."""
    for vendor, family, pred, arch in MICROARCHITECTURES:
        if cpu.vendor_id == vendor and cpu.family == family and pred(cpu.model, cpu.flags):
            return arch
    bits = _isa_bits(cpu.flags)
    return Microarchitecture(f"unknown ({cpu.vendor_id or platform.machine()} family {cpu.family} model {cpu.model})",
                             2, bits, f"not in jmegatron's table: assumed two {bits}-bit FMA pipes "
                                      f"(set ${FLOP_PER_CYCLE_ENV} if wrong)")


def flop_per_cycle(cpu: CpuInfo, fp32_flop_per_cycle: Optional[int] = None) -> dict:
    """FLOP per cycle per core: ``{"float32": .., "bfloat16": .., "microarchitecture": name,
    "assumption": text}`` from the flags and :func:`microarchitecture` (see the module
    docstring). ``fp32_flop_per_cycle`` (else ``$JMEGATRON_CPU_FP32_FLOP_PER_CYCLE``)
    overrides the float32 figure; bfloat16 follows it by the flags' rule. Raises
    PeakUnavailable for a non-positive or non-numeric override."""
    arch = microarchitecture(cpu)
    env = os.environ.get(FLOP_PER_CYCLE_ENV)
    if fp32_flop_per_cycle is None and env:
        try:
            fp32_flop_per_cycle = int(env)
        except ValueError:
            raise PeakUnavailable(f"${FLOP_PER_CYCLE_ENV}={env!r} must be an integer") from None
    lanes = min(_isa_bits(cpu.flags), arch.pipe_bits) // 32
    fp32, note = arch.fma_pipes * lanes * 2, (f"{arch.fma_pipes} FMA pipes x {lanes} float32 lanes x 2: "
                                              f"{arch.reference}")
    if fp32_flop_per_cycle is not None:
        if fp32_flop_per_cycle <= 0:
            raise PeakUnavailable(f"float32 FLOP/cycle={fp32_flop_per_cycle} must be >= 1")
        fp32 = int(fp32_flop_per_cycle)
        note = f"float32 FLOP/cycle {fp32} as given (${FLOP_PER_CYCLE_ENV} or fp32_flop_per_cycle=)"
    if "hypervisor" in cpu.flags:
        note += "; under a hypervisor the CPUID may name an older core than the host's"
    if "amx_bf16" in cpu.flags:
        bf16, bf16_note = 1024, "amx_bf16: 1024 (Intel AMX TDPBF16PS per core)"
    elif "avx512_bf16" in cpu.flags:
        bf16, bf16_note = 2 * fp32, "avx512_bf16: 2 x float32 (VDPBF16PS)"
    else:
        bf16, bf16_note = fp32, "no bf16 arithmetic in the flags: as float32"
    return {"float32": fp32, "bfloat16": bf16, "microarchitecture": arch.name,
            "assumption": f"{note}; bfloat16 {bf16_note}"}


# ------------------------------------------------------------------ accelerators
# Dense (no structured sparsity) peak TFLOP/s from the vendors' datasheets; float32 on
# tensor-core GPUs is the TF32 figure (JAX's default matmul precision there), "float32_simt"
# the non-tensor one. First pattern (regex on device_kind) that matches wins.
ACCELERATOR_DENSE_PEAK_TFLOPS: tuple = (
    (r"H100.*PCIe", "NVIDIA H100 PCIe", {"float32": 378.0, "float32_simt": 51.0, "bfloat16": 756.0, "float8": 1513.0},
     "NVIDIA H100 Tensor Core GPU datasheet (sparse figures halved)"),
    (r"H100.*NVL", "NVIDIA H100 NVL", {"float32": 417.5, "float32_simt": 60.0, "bfloat16": 835.5, "float8": 1670.5},
     "NVIDIA H100 Tensor Core GPU datasheet (sparse figures halved)"),
    (r"H200.*NVL", "NVIDIA H200 NVL", {"float32": 417.5, "float32_simt": 60.0, "bfloat16": 835.5, "float8": 1670.5},
     "NVIDIA H200 Tensor Core GPU datasheet (sparse figures halved)"),
    (r"GH200|H200|H100", "NVIDIA H100/H200 SXM", {"float32": 494.7, "float32_simt": 67.0, "bfloat16": 989.4,
                                                  "float8": 1978.9},
     "NVIDIA H100 / H200 Tensor Core GPU datasheets, SXM (sparse figures halved)"),
    (r"A100", "NVIDIA A100", {"float32": 156.0, "float32_simt": 19.5, "bfloat16": 312.0},
     "NVIDIA A100 Tensor Core GPU datasheet (dense)"),
    (r"L40S", "NVIDIA L40S", {"float32": 183.0, "float32_simt": 91.6, "bfloat16": 362.05, "float8": 733.0},
     "NVIDIA L40S datasheet (sparse figures halved)"),
    (r"\bL4\b", "NVIDIA L4", {"float32": 60.0, "float32_simt": 30.3, "bfloat16": 121.0, "float8": 242.5},
     "NVIDIA L4 datasheet (sparse figures halved)"),
    (r"TPU v4", "Google TPU v4", {"float32": 275.0, "bfloat16": 275.0},
     "Google Cloud TPU v4 documentation (float32 dots run as bf16 passes by default)"),
    (r"TPU v5 ?lite|TPU v5e", "Google TPU v5e", {"float32": 197.0, "bfloat16": 197.0},
     "Google Cloud TPU v5e documentation"),
    (r"TPU v5", "Google TPU v5p", {"float32": 459.0, "bfloat16": 459.0}, "Google Cloud TPU v5p documentation"),
    (r"TPU v6", "Google TPU v6e (Trillium)", {"float32": 918.0, "bfloat16": 918.0},
     "Google Cloud TPU v6e documentation"),
)


def _accelerator_entry(device_kind: str):
    for pattern, name, peaks, ref in ACCELERATOR_DENSE_PEAK_TFLOPS:
        if re.search(pattern, device_kind):
            return name, peaks, ref
    raise PeakUnavailable(f"device kind {device_kind!r} is not in jmegatron's table of spec-sheet peaks "
                          "(reporting/peak.py ACCELERATOR_DENSE_PEAK_TFLOPS); set config.peak_tflops")


def accelerator_peak(device_kind: str, dtype: str) -> tuple[float, str]:
    """(dense spec-sheet TFLOP/s, description) of one accelerator for ``dtype``. Raises
    PeakUnavailable for a device kind or dtype not in :data:`ACCELERATOR_DENSE_PEAK_TFLOPS`."""
    name, peaks, ref = _accelerator_entry(device_kind)
    if dtype not in peaks:
        raise PeakUnavailable(f"{name} has no {dtype} figure in jmegatron's table; set config.peak_tflops")
    return peaks[dtype], f"{name} {dtype} dense spec-sheet peak ({ref})"


# ------------------------------------------------------------------ theoretical peak
@dataclasses.dataclass(frozen=True)
class TheoreticalPeak:
    """The host's (CPU) or one device's (accelerator) theoretical peak per dtype in TFLOP/s;
    ``summary``: a short account (start-up line), ``description``: every source and assumption."""
    tflops: dict
    summary: str
    description: str
    per: str  # "host" (shared by the process's CPU devices) or "device"


def theoretical_cpu_peak(cpu: Optional[CpuInfo] = None, fp32_flop_per_cycle: Optional[int] = None,
                         measured_clock_ghz: Optional[float] = None,
                         trust_nominal_clock: bool = True) -> TheoreticalPeak:
    """cores x clock x FLOP/cycle of ``cpu`` (default :func:`cpu_info`) for float32 and
    bfloat16, for the whole host. ``measured_clock_ghz`` (the core clock ``bench peak``
    measured, :mod:`jmegatron.reporting.core_clock`) replaces a clock read from
    ``/proc/cpuinfo``'s ``cpu MHz`` when it is higher (a hypervisor shows the nominal clock
    while the core boosts); a clock from ``$JMEGATRON_CPU_CLOCK_GHZ`` or cpufreq's maximum
    is kept. Raises PeakUnavailable when no clock is known, and (``trust_nominal_clock``
    False) when the clock is a hypervisor guest's ``cpu MHz`` with no measured one."""
    cpu = cpu or cpu_info()
    clock, clock_source = cpu.clock_ghz, cpu.clock_source
    if measured_clock_ghz and (clock is None or ("cpu MHz" in clock_source and measured_clock_ghz > clock)):
        clock = measured_clock_ghz
        clock_source = "core clock measured by bench peak (dependent-add chain, jmegatron.reporting.core_clock)"
        if cpu.clock_ghz:
            clock_source += f", above the {cpu.clock_ghz:.3f} GHz that /proc/cpuinfo reports"
    if clock is None:
        raise PeakUnavailable(f"the CPU's theoretical peak needs its clock: {cpu.clock_source} "
                              "(or set config.peak_tflops)")
    if not trust_nominal_clock and "cpu MHz" in clock_source and "hypervisor" in cpu.flags:
        raise PeakUnavailable(
            f"not stated: /proc/cpuinfo's cpu MHz ({clock:.3f} GHz) under a hypervisor is usually the nominal "
            f"clock, below the core's boost clock (a peak from it can give an MFU above 100%); run "
            f"python -m jmegatron.bench peak on this machine to measure the clock and the best GEMM, or set "
            f"${CLOCK_ENV} / config.peak_tflops")
    fpc = flop_per_cycle(cpu, fp32_flop_per_cycle)
    tflops = {d: cpu.cores * clock * 1e9 * fpc[d] / 1e12 for d in DTYPES}
    summary = (f"{cpu.cores} cores x {clock:.3f} GHz x {fpc['float32']} float32 / {fpc['bfloat16']} "
               f"bfloat16 FLOP/cycle, {cpu.model_name} as {fpc['microarchitecture']}")
    desc = f"{summary}; cores: {cpu.cores_note}; clock: {clock_source}; FLOP/cycle: {fpc['assumption']}"
    return TheoreticalPeak(tflops, summary, desc, "host")


def theoretical_peak(platform_name: Optional[str] = None, device_kind: Optional[str] = None,
                     measured_clock_ghz: Optional[float] = None, trust_nominal_clock: bool = True) -> TheoreticalPeak:
    """The theoretical peak of this process's first device (or of ``platform_name`` /
    ``device_kind`` given): the CPU's from its ISA (``measured_clock_ghz`` as in
    :func:`theoretical_cpu_peak`), an accelerator's from the spec-sheet table. Raises
    PeakUnavailable when none can be stated."""
    if platform_name is None or device_kind is None:
        import jax

        dev = jax.local_devices()[0]
        platform_name, device_kind = dev.platform, dev.device_kind
    if platform_name == "cpu":
        return theoretical_cpu_peak(measured_clock_ghz=measured_clock_ghz, trust_nominal_clock=trust_nominal_clock)
    name, peaks, ref = _accelerator_entry(device_kind)
    tflops = {d: peaks[d] for d in DTYPES if d in peaks}
    summary = f"{name} dense spec-sheet peak" + (", float32 as TF32" if "float32_simt" in peaks else "")
    return TheoreticalPeak(tflops, summary, f"{summary} ({ref})", "device")


# ------------------------------------------------------------------ the stored record
def machine_key(platform_name: Optional[str] = None, device_kind: Optional[str] = None,
                cpu: Optional[CpuInfo] = None) -> str:
    """The key a stored measurement must carry to be used here: on a CPU
    :attr:`CpuInfo.key` (model name + flags hash), else ``"<platform>|<device_kind>"``."""
    if platform_name is None or device_kind is None:
        import jax

        dev = jax.local_devices()[0]
        platform_name, device_kind = dev.platform, dev.device_kind
    if platform_name == "cpu":
        return (cpu or cpu_info()).key
    return f"{platform_name}|{device_kind}"


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
    file that is not a peak record of this format version (names the path and the fix)."""
    path = peak_file(path)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"peak file {path} is unreadable ({e}); rerun python -m jmegatron.bench peak") from e
    if not isinstance(record, dict) or record.get("format_version") != PEAK_FORMAT_VERSION \
            or not isinstance(record.get("dtypes"), dict) or "key" not in record:
        raise ValueError(f"peak file {path} is not a jmegatron peak record (format_version "
                         f"{PEAK_FORMAT_VERSION}); rerun python -m jmegatron.bench peak")
    return record


def stored_peak(dtype: str = "float32", path: Optional[str] = None,
                key: Optional[str] = None) -> Optional[tuple[float, str]]:
    """(host TFLOP/s, description) stored for ``dtype`` if the record's key is this
    machine's (``key``, default :func:`machine_key`), else None: a record measured on
    another CPU model, with other feature flags, or on another device, is ignored."""
    record = load_peak(path)
    if record is None or record["key"] != (key or machine_key()):
        return None
    entry = record["dtypes"].get(dtype)
    if not entry:
        return None
    return float(entry["peak_tflops"]), (f"measured by bench peak ({entry['library']}, n={entry['best_size']}, "
                                         f"{record.get('measured_at', '?')}; {peak_file(path)})")


def stored_clock_ghz(path: Optional[str] = None, key: Optional[str] = None) -> Optional[float]:
    """The core clock (GHz) ``bench peak`` measured and stored for this machine (``key``,
    default :func:`machine_key`), or None (no record, another machine, not measured)."""
    record = load_peak(path)
    if record is None or record["key"] != (key or machine_key()):
        return None
    value = (record.get("cpu") or {}).get("measured_clock_ghz")
    return float(value) if value else None


# ------------------------------------------------------------------ resolution
@dataclasses.dataclass(frozen=True)
class PeakChoice:
    """The MFU denominators of a run, per device, in TFLOP/s.

    ``tflops`` / ``source``: the peak MFU uses (None when none is known) and where it came
    from (``"config.peak_tflops"``, ``"measured ..."``, ``"theoretical ..."``, ``"none ..."``);
    ``theoretical_tflops`` / ``theoretical_source``: the theoretical peak (None and the
    reason when it cannot be stated)."""
    tflops: Optional[float]
    source: str
    theoretical_tflops: Optional[float]
    theoretical_source: str
    dtype: str

    def describe(self) -> str:
        """One line for the trainer's start-up: the peak, its source, and the theoretical one.
        A peak that is not known is said in a few words with the command that measures one
        (``python -m jmegatron.bench peak``, which also explains why none is stated); the
        reasons stay in :attr:`source` / :attr:`theoretical_source`."""
        measure = "python -m jmegatron.bench peak measures one, or set config.peak_tflops"
        theo = (f"{self.theoretical_tflops:.4g} TFLOP/s/device ({self.theoretical_source})"
                if self.theoretical_tflops else "unknown")
        if not self.tflops:
            return f"{self.dtype} peak for MFU: none, theoretical peak: {theo}: no MFU column ({measure})"
        return (f"{self.dtype} peak for MFU: {self.tflops:.4g} TFLOP/s/device ({self.source}); theoretical peak: "
                f"{theo}" + ("" if self.theoretical_tflops else " (python -m jmegatron.bench peak states it)"))

    def mfu_warning(self, mfu: float) -> str:
        """The text of the warning for an MFU above 100% of this peak."""
        return (f"MFU {100 * mfu:.1f}% is above 100%: the peak ({self.tflops:.4g} TFLOP/s/device, {self.source}) "
                "is too low. Set config.peak_tflops, or rerun python -m jmegatron.bench peak on a quiet machine.")


def resolve_peak(dtype: str = "float32", config_peak_tflops: Optional[float] = None, path: Optional[str] = None,
                 num_local_devices: Optional[int] = None, platform_name: Optional[str] = None,
                 device_kind: Optional[str] = None) -> PeakChoice:
    """The per-device peak for MFU in the order ``config_peak_tflops`` > the stored
    measurement for this machine > the theoretical peak, and the theoretical peak beside it.
    Never times anything. Host-wide CPU figures are divided by ``num_local_devices`` (default
    ``jax.local_device_count()``). Raises ValueError for a dtype not in :data:`DTYPES`; a
    malformed peak file raises ValueError naming it."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {DTYPES}")
    if platform_name is None or device_kind is None or num_local_devices is None:
        import jax

        dev = jax.local_devices()[0]
        platform_name = platform_name or dev.platform
        device_kind = device_kind or dev.device_kind
        num_local_devices = num_local_devices or jax.local_device_count()
    share = num_local_devices if platform_name == "cpu" else 1
    per = f" / {share} CPU devices" if share > 1 else ""
    key = machine_key(platform_name, device_kind)
    try:
        clock = stored_clock_ghz(path, key) if platform_name == "cpu" else None
        theo = theoretical_peak(platform_name, device_kind, clock, trust_nominal_clock=False)
        if dtype not in theo.tflops:
            raise PeakUnavailable(f"no {dtype} figure for {device_kind!r} in jmegatron's table")
        theo_tflops, theo_source = theo.tflops[dtype] / share, theo.summary + per
    except PeakUnavailable as e:
        theo_tflops, theo_source = None, str(e)
    if config_peak_tflops:
        return PeakChoice(float(config_peak_tflops), "config.peak_tflops", theo_tflops, theo_source, dtype)
    stored = stored_peak(dtype, path, key)
    if stored is not None:
        return PeakChoice(stored[0] / share, stored[1] + per, theo_tflops, theo_source, dtype)
    if theo_tflops is not None:
        return PeakChoice(theo_tflops, "theoretical (no bench peak record for this machine in "
                                       f"{peak_file(path)})", theo_tflops, theo_source, dtype)
    return PeakChoice(None, f"none: no bench peak record for this machine in {peak_file(path)} and no "
                            f"theoretical peak; set config.peak_tflops", None, theo_source, dtype)


def resolve_peak_for_config(cfg, path: Optional[str] = None, num_local_devices: Optional[int] = None) -> PeakChoice:
    """:func:`resolve_peak` for a :class:`JMegatronConfig`: its ``peak_tflops`` and its
    compute dtype (bfloat16 with ``bf16``, else float32)."""
    return resolve_peak("bfloat16" if cfg.bf16 else "float32", cfg.peak_tflops, path, num_local_devices)


# ------------------------------------------------------------------ measuring (bench peak only)
def _xla_runner(n: int, dtype: str, chain: int, platform_name: str) -> Callable[[], None]:
    import jax
    import jax.numpy as jnp

    a = jax.device_put(jnp.ones((n, n), getattr(jnp, dtype)) / n, jax.local_devices()[0])

    @jax.jit
    def f(x):
        for _ in range(chain):
            x = x @ a
        return x

    return lambda: f(a).block_until_ready()


def _openblas_runner(n: int, dtype: str, chain: int, platform_name: str) -> Callable[[], None]:
    if dtype != "float32":
        raise PeakUnavailable("the OpenBLAS kernel (jmegatron_sgemm) is float32 only")
    if platform_name != "cpu":
        raise PeakUnavailable("the OpenBLAS kernel runs on the CPU backend only")
    import jax
    import jax.numpy as jnp

    kernels_cpu.load()  # KernelUnavailable (a RuntimeError) names the missing piece
    a = jnp.ones((n, n), jnp.float32) / n

    @jax.jit
    def f(x):
        for _ in range(chain):
            x = ops.sgemm(x, a)
        return x

    return lambda: f(a).block_until_ready()


def _torch_runner(n: int, dtype: str, chain: int, platform_name: str) -> Callable[[], None]:
    import torch

    # torch on the devices JAX trains on: the CPU, or CUDA beside a JAX GPU backend.
    device = {"cpu": "cpu", "gpu": "cuda" if torch.cuda.is_available() else None}.get(platform_name)
    if device is None:
        raise PeakUnavailable(f"torch has no device here for JAX's {platform_name} platform")
    a = torch.ones((n, n), dtype=getattr(torch, dtype), device=device) / n

    def f():
        with torch.no_grad():
            x = a
            for _ in range(chain):
                x = torch.matmul(x, a)
        if device == "cuda":
            torch.cuda.synchronize()
        return x

    return f


RUNNERS = {"xla": _xla_runner, "openblas": _openblas_runner, "torch": _torch_runner}


def gemm_tflops_samples(library: str, n: int, dtype: str = "float32", repeats: int = 5,
                        chain: int = 4, platform_name: str = "cpu") -> list[float]:
    """TFLOP/s of each of ``repeats`` timed runs (after one untimed warm-up run, which
    compiles under XLA) of ``chain`` dependent ``[n, n] @ [n, n]`` products (``2 n^3`` FLOPs
    each) in ``dtype`` through ``library`` (:data:`LIBRARIES`) on the device of JAX's
    ``platform_name`` (for torch: "cpu" or "gpu" = CUDA). Raises ValueError for
    non-positive sizes or an unknown library; PeakUnavailable / ImportError /
    KernelUnavailable when the library cannot run it here."""
    if n <= 0 or repeats <= 0 or chain <= 0:
        raise ValueError(f"n={n}, repeats={repeats} and chain={chain} must be > 0.")
    if library not in RUNNERS or dtype not in DTYPES:
        raise ValueError(f"library={library!r} must be one of {LIBRARIES} and dtype={dtype!r} one of {DTYPES}")
    run = RUNNERS[library](n, dtype, chain, platform_name)
    run()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        samples.append(2.0 * n ** 3 * chain / (time.perf_counter() - t0) / 1e12)
    return samples


def matmul_tflops_samples(n: int, dtype="float32", repeats: int = 5, chain: int = 4) -> list[float]:
    """:func:`gemm_tflops_samples` through XLA's dot (``dtype`` a name or a jnp dtype)."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    return gemm_tflops_samples("xla", n, name, repeats, chain)  # XLA: JAX's first device, any platform


def measure_matmul_tflops(n: int = 1024, dtype="float32", repeats: int = 5, chain: int = 4) -> float:
    """Median TFLOP/s of XLA's dot at one size (benchmarks/step_time.py's reference figure;
    the trainer never calls it)."""
    return float(np.median(matmul_tflops_samples(n, dtype, repeats, chain)))


def _measure_library(library: str, sizes: Sequence[int], dtypes: Sequence[str], repeats: int, chain: int,
                     verbose: bool, platform_name: str) -> tuple[dict, dict]:
    """({dtype: entry}, {dtype: reason skipped}) of one library (runs in its own process)."""
    entries, skipped = {}, {}
    for name in dtypes:
        by_size = {}
        try:
            for n in sizes:
                samples = gemm_tflops_samples(library, int(n), name, repeats, chain, platform_name)
                by_size[str(n)] = {"median_tflops": float(np.median(samples)), "samples_tflops": samples}
                if verbose:
                    print(f"[bench peak] {library} {name} n={n}: median {by_size[str(n)]['median_tflops']:.4g} "
                          "TFLOP/s", flush=True)
        except (ImportError, RuntimeError, PeakUnavailable) as e:  # not installed / not built / unsupported
            skipped[name] = f"{type(e).__name__}: {e}"
            if verbose:
                print(f"[bench peak] {library} {name}: skipped ({e})", flush=True)
            continue
        best = max(by_size, key=lambda k: by_size[k]["median_tflops"])
        entries[name] = {"peak_tflops": by_size[best]["median_tflops"], "best_size": int(best), "by_size": by_size}
    return entries, skipped


def measure_peak(sizes: Sequence[int] = (256, 512, 1024, 2048), dtypes: Sequence[str] = DTYPES,
                 repeats: int = 5, chain: int = 4, libraries: Sequence[str] = LIBRARIES,
                 separate_processes: bool = True, verbose: bool = False) -> dict:
    """Measure every library x dtype x size that runs here; returns the record described in
    the module docstring: per library and dtype the best size's median, and per dtype the
    best library's (the stored measured peak). With ``separate_processes`` each library runs
    alone in a fresh spawned process, so one library's thread pool (XLA's spinning Eigen
    threads, torch's OpenMP team) does not compete with another's. A library that cannot
    run (not installed, kernel not built, dtype unsupported) is listed under ``skipped``
    with the reason. Raises ValueError for unknown dtypes/libraries, an empty size list,
    or when nothing ran."""
    import jax

    bad = [d for d in dtypes if d not in DTYPES] + [lib for lib in libraries if lib not in LIBRARIES]
    if bad or not sizes or not dtypes or not libraries:
        raise ValueError(f"dtypes must be among {DTYPES}, libraries among {LIBRARIES} (got {list(dtypes)}, "
                         f"{list(libraries)}) and sizes non-empty (got {list(sizes)}).")
    dev = jax.local_devices()[0]
    cpu = cpu_info() if dev.platform == "cpu" else None
    clock = None
    if cpu is not None:  # first, before the GEMMs warm anything up or throttle the core
        try:
            clock = core_clock.measure_core_clock_ghz()
            if verbose:
                print(f"[bench peak] core clock {clock['ghz']:.3f} GHz ({clock['method']}; median "
                      f"{clock['median_ghz']:.3f}); /proc/cpuinfo: {cpu.clock_ghz} GHz", flush=True)
        except core_clock.ClockUnavailable as e:
            clock = {"error": str(e)}
            if verbose:
                print(f"[bench peak] core clock not measured: {e}", flush=True)
    try:
        theo = theoretical_peak(dev.platform, dev.device_kind, (clock or {}).get("ghz"))
        theoretical = {**theo.tflops, "summary": theo.summary, "description": theo.description, "per": theo.per}
    except PeakUnavailable as e:
        theoretical = {"error": str(e)}
    record = {"format_version": PEAK_FORMAT_VERSION, "key": machine_key(dev.platform, dev.device_kind, cpu),
              "platform": dev.platform, "device_kind": dev.device_kind,
              "num_local_devices": jax.local_device_count(),
              "cpu": None if cpu is None else {
                  "model_name": cpu.model_name, "vendor_id": cpu.vendor_id, "family": cpu.family,
                  "model": cpu.model, "flags_sha256": cpu.flags_sha256, "cores": cpu.cores,
                  "logical_cpus": cpu.logical_cpus, "clock_ghz": cpu.clock_ghz, "clock_source": cpu.clock_source,
                  "measured_clock_ghz": (clock or {}).get("ghz"), "measured_clock": clock},
              "hostname": platform.node(), "cpu_count": os.cpu_count(), "jax_version": jax.__version__,
              "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "sizes": [int(n) for n in sizes], "repeats": int(repeats), "chain": int(chain),
              "separate_processes": bool(separate_processes),
              "theoretical": theoretical, "libraries": {}, "skipped": {}, "dtypes": {}}
    args = ([int(n) for n in sizes], list(dtypes), int(repeats), int(chain), verbose, dev.platform)
    for lib in libraries:
        if separate_processes:
            import concurrent.futures
            import multiprocessing

            with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                entries, skipped = pool.submit(_measure_library, lib, *args).result()
        else:
            entries, skipped = _measure_library(lib, *args)
        if entries:
            record["libraries"][lib] = entries
        if skipped:
            record["skipped"][lib] = skipped
    for name in dtypes:
        ran = [(lib, e[name]) for lib, e in record["libraries"].items() if name in e]
        if ran:
            lib, entry = max(ran, key=lambda t: t[1]["peak_tflops"])
            record["dtypes"][name] = {"peak_tflops": entry["peak_tflops"], "library": lib,
                                      "best_size": entry["best_size"]}
    if not record["dtypes"]:
        raise ValueError(f"no library could run a GEMM here: {record['skipped']}")
    return record
