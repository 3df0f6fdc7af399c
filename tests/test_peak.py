"""The MFU peak: theoretical peak from (fake) /proc/cpuinfo and the spec-sheet table, the
stored record keyed by CPU model + flags, the resolution order config > stored >
theoretical, and a trainer start-up that times nothing."""

import dataclasses
import json
import subprocess
import sys

import pytest

from jmegatron.config import base_config, from_configdict
from jmegatron.reporting import peak

from conftest import REPO


def fake_cpuinfo(vendor, family, model, flags, cores, threads_per_core=1, mhz=None, name="Fake CPU"):
    """A /proc/cpuinfo of ``cores`` x ``threads_per_core`` logical CPUs (SMT siblings share a core id)."""
    blocks, proc = [], 0
    for t in range(threads_per_core):
        for c in range(cores):
            lines = [f"processor\t: {proc}", f"vendor_id\t: {vendor}", f"cpu family\t: {family}",
                     f"model\t\t: {model}", f"model name\t: {name}", "physical id\t: 0", f"core id\t\t: {c}"]
            if mhz is not None:
                lines.append(f"cpu MHz\t\t: {mhz}")
            lines.append(f"flags\t\t: {' '.join(flags)}")
            blocks.append("\n".join(lines))
            proc += 1
    return "\n\n".join(blocks) + "\n"


def sysfs_with_max_freq(tmp_path, khz):
    d = tmp_path / "sys" / "cpu0" / "cpufreq"
    d.mkdir(parents=True)
    (d / "cpuinfo_max_freq").write_text(f"{khz}\n")
    return str(tmp_path / "sys")


X86 = ["fpu", "sse", "sse2", "avx", "fma", "avx2"]


@pytest.fixture(autouse=True)
def no_overrides(monkeypatch):
    for var in (peak.CLOCK_ENV, peak.FLOP_PER_CYCLE_ENV, peak.PEAK_FILE_ENV):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("vendor,family,model,flags,fp32,bf16,arch", [
    ("GenuineIntel", 6, 85, X86 + ["avx512f"], 64, 64, "AVX-512"),                        # Skylake-SP: 2 x 512-bit
    ("GenuineIntel", 6, 143, X86 + ["avx512f", "avx512_bf16", "amx_bf16"], 64, 1024, "AVX-512"),  # Sapphire Rapids
    ("GenuineIntel", 6, 63, X86, 32, 32, "AVX2"),                                          # Haswell: 2 x 256-bit
    ("AuthenticAMD", 25, 17, X86 + ["avx512f", "avx512_bf16"], 32, 64, "Zen 4"),          # 512-bit ops in 2 passes
    ("AuthenticAMD", 25, 1, X86, 32, 32, "Zen 3"),
    ("AuthenticAMD", 23, 1, X86, 16, 16, "Zen / Zen+"),                                    # 2 x 128-bit
    ("AuthenticAMD", 23, 49, X86, 32, 32, "Zen 2"),
    ("AuthenticAMD", 26, 2, X86 + ["avx512f", "avx512_bf16"], 64, 128, "Zen 5"),
    ("HygonGenuine", 24, 1, ["sse", "sse2"], 16, 16, "unknown"),  # default: 2 pipes x ISA width
])
def test_flop_per_cycle_from_flags(vendor, family, model, flags, fp32, bf16, arch):
    cpu = peak.cpu_info(fake_cpuinfo(vendor, family, model, flags, cores=1, mhz=1000.0), sysfs_root="/nonexistent",
                        affinity=[0])
    fpc = peak.flop_per_cycle(cpu)
    assert (fpc["float32"], fpc["bfloat16"]) == (fp32, bf16)
    assert arch in fpc["microarchitecture"]


def test_theoretical_cpu_peak_cores_clock_and_overrides(tmp_path, monkeypatch):
    # 4 cores x 2 SMT threads, sysfs max clock 3.0 GHz, AVX-512 Intel: 64 FLOP/cycle.
    text = fake_cpuinfo("GenuineIntel", 6, 106, X86 + ["avx512f"], cores=4, threads_per_core=2, mhz=2100.0)
    sysfs = sysfs_with_max_freq(tmp_path, 3000000)
    cpu = peak.cpu_info(text, sysfs_root=sysfs, affinity=range(8))
    assert (cpu.cores, cpu.logical_cpus, cpu.clock_ghz) == (4, 8, 3.0) and "cpuinfo_max_freq" in cpu.clock_source
    theo = peak.theoretical_cpu_peak(cpu)
    assert theo.tflops["float32"] == pytest.approx(4 * 3.0e9 * 64 / 1e12)
    assert "4 cores x 3.000 GHz x 64 float32" in theo.summary and theo.per == "host"
    # Affinity to two SMT siblings of one core (processors 0 and 4): one core.
    assert peak.cpu_info(text, sysfs_root=sysfs, affinity=[0, 4]).cores == 1
    # No cpufreq in sysfs: /proc/cpuinfo's cpu MHz, and the description says so.
    cpu = peak.cpu_info(text, sysfs_root="/nonexistent", affinity=range(8))
    assert cpu.clock_ghz == pytest.approx(2.1) and "cpu MHz" in cpu.clock_source
    # The user overrides the clock and the FLOP/cycle (e.g. a part with one 512-bit FMA unit).
    monkeypatch.setenv(peak.CLOCK_ENV, "2.5")
    monkeypatch.setenv(peak.FLOP_PER_CYCLE_ENV, "32")
    theo = peak.theoretical_cpu_peak(peak.cpu_info(text, sysfs_root=sysfs, affinity=range(8)))
    assert theo.tflops["float32"] == pytest.approx(4 * 2.5e9 * 32 / 1e12)
    assert peak.CLOCK_ENV in theo.description and peak.FLOP_PER_CYCLE_ENV in theo.description
    monkeypatch.setenv(peak.FLOP_PER_CYCLE_ENV, "many")
    with pytest.raises(peak.PeakUnavailable, match=peak.FLOP_PER_CYCLE_ENV):
        peak.theoretical_cpu_peak(cpu)


def test_missing_clock_is_a_clear_error():
    text = fake_cpuinfo("GenuineIntel", 6, 85, X86 + ["avx512f"], cores=2, mhz=None)
    cpu = peak.cpu_info(text, sysfs_root="/nonexistent", affinity=[0, 1])
    assert cpu.clock_ghz is None
    with pytest.raises(peak.PeakUnavailable, match=r"cpuinfo_max_freq.*JMEGATRON_CPU_CLOCK_GHZ"):
        peak.theoretical_cpu_peak(cpu)


def test_no_core_ids_counts_logical_cpus():
    text = "processor\t: 0\nFeatures\t: fp asimd\n\nprocessor\t: 1\nFeatures\t: fp asimd\n"
    cpu = peak.cpu_info(text, sysfs_root="/nonexistent", affinity=[0, 1])
    assert cpu.cores == 2 and "logical CPUs" in cpu.cores_note and cpu.flags == frozenset({"fp", "asimd"})


def test_accelerator_spec_sheet_table():
    def res(kind, dtype, n=8):
        return peak.resolve_peak(dtype, platform_name="gpu", device_kind=kind, num_local_devices=n,
                                 path="/nonexistent/peak.json")

    h100 = res("NVIDIA H100 80GB HBM3", "bfloat16")
    assert h100.tflops == h100.theoretical_tflops == 989.4 and h100.source.startswith("theoretical")
    assert res("NVIDIA H100 80GB HBM3", "float32").tflops == 494.7  # TF32: JAX's default f32 dot precision
    assert res("NVIDIA H200", "bfloat16").tflops == 989.4
    assert res("NVIDIA H100 PCIe", "bfloat16").tflops == 756.0
    assert res("NVIDIA A100-SXM4-80GB", "bfloat16").tflops == 312.0
    unknown = res("Some NPU", "bfloat16")
    assert unknown.tflops is None and unknown.theoretical_tflops is None
    assert "config.peak_tflops" in unknown.source and "not in jmegatron's table" in unknown.theoretical_source
    # no peak: a few words and the command that measures one, not the reasons (those stay in source)
    line = unknown.describe()
    assert line.startswith("bfloat16 peak for MFU: none") and "python -m jmegatron.bench peak" in line, line
    assert len(line) < 160 and "not in jmegatron's table" not in line, line


def _record(key, fp32=0.125, bf16=0.375):
    return {"format_version": peak.PEAK_FORMAT_VERSION, "key": key, "platform": "cpu", "device_kind": "cpu",
            "measured_at": "2026-01-01T00:00:00Z",
            "dtypes": {"float32": {"peak_tflops": fp32, "library": "torch", "best_size": 2048},
                       "bfloat16": {"peak_tflops": bf16, "library": "xla", "best_size": 1024}}}


def test_resolution_order_and_machine_key(tmp_path, monkeypatch):
    path = str(tmp_path / "peak.json")
    monkeypatch.setenv(peak.CLOCK_ENV, "2.0")  # so a theoretical peak exists on any test machine
    theo = peak.theoretical_cpu_peak().tflops

    def res(dtype="float32", config=None, n=1):
        return peak.resolve_peak(dtype, config, path, num_local_devices=n, platform_name="cpu", device_kind="cpu")

    # Nothing stored: the theoretical peak, said so.
    r = res()
    assert r.tflops == r.theoretical_tflops == pytest.approx(theo["float32"]) and r.source.startswith("theoretical")
    # A record of this CPU (model name + flags hash): the measured peak.
    peak.save_peak(_record(peak.machine_key("cpu", "cpu")), path)
    r = res()
    assert r.tflops == 0.125 and r.source.startswith("measured by bench peak (torch, n=2048")
    assert r.theoretical_tflops == pytest.approx(theo["float32"])
    assert res("bfloat16").tflops == 0.375
    # Host figures are shared by the process's CPU devices.
    r = res(n=4)
    assert r.tflops == pytest.approx(0.125 / 4) and r.theoretical_tflops == pytest.approx(theo["float32"] / 4)
    # A configured peak wins over both (per device, not divided).
    r = res(config=7.0, n=4)
    assert (r.tflops, r.source) == (7.0, "config.peak_tflops")
    assert "config.peak_tflops" in r.describe() and "theoretical peak" in r.describe()
    # Same model name, one more feature flag: another machine's record, ignored.
    cpu = peak.cpu_info()
    other = dataclasses.replace(cpu, flags=cpu.flags | {"amx_bf16"})
    assert other.key != cpu.key and other.model_name == cpu.model_name
    peak.save_peak(_record(other.key), path)
    assert res().source.startswith("theoretical")
    # Measured with another CPU affinity (core count): not this run's peak either.
    peak.save_peak(_record(dataclasses.replace(cpu, cores=cpu.cores + 1).key), path)
    assert res().source.startswith("theoretical")
    # The config helper takes the compute dtype from bf16.
    peak.save_peak(_record(peak.machine_key("cpu", "cpu")), path)
    cfg = from_configdict(_tiny())
    monkeypatch.setenv(peak.PEAK_FILE_ENV, path)
    assert peak.resolve_peak_for_config(cfg, num_local_devices=1).tflops == 0.125
    assert peak.resolve_peak_for_config(cfg.replace(bf16=True), num_local_devices=1).tflops == 0.375


def test_load_peak_rejects_other_files(tmp_path):
    (tmp_path / "junk.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a jmegatron peak record"):
        peak.load_peak(str(tmp_path / "junk.json"))
    # A format-1 record (keyed by device kind only) is refused, not trusted.
    (tmp_path / "v1.json").write_text(json.dumps({"format_version": 1, "platform": "cpu", "device_kind": "cpu",
                                                  "dtypes": {"float32": {"peak_tflops": 1.0}}}))
    with pytest.raises(ValueError, match="rerun python -m jmegatron.bench peak"):
        peak.load_peak(str(tmp_path / "v1.json"))
    assert peak.load_peak(str(tmp_path / "absent.json")) is None


def _tiny():
    c = base_config()
    c.mock_data, c.vocab_size = True, 128
    c.num_layers, c.hidden_size, c.num_attention_heads, c.ffn_hidden_size = 1, 32, 2, 64
    c.seq_length = c.max_position_embeddings = 16
    c.micro_batch_size, c.global_batch_size = 2, 2
    c.train_iters, c.log_interval, c.eval_interval, c.eval_iters = 4, 2, 0, 1
    c.lr, c.lr_warmup_iters, c.lr_decay_style = 1e-3, 1, "constant"
    return c


@pytest.mark.slow
def test_trainer_startup_times_nothing(tmp_path, monkeypatch, capsys):
    import jax

    from jmegatron.parallel.mesh import create_mesh
    from jmegatron.training.loop import pretrain

    def refuse(*a, **k):
        raise AssertionError("the trainer must not time a peak")

    for name in ("gemm_tflops_samples", "matmul_tflops_samples", "measure_matmul_tflops", "measure_peak"):
        monkeypatch.setattr(peak, name, refuse)
    monkeypatch.setattr(peak, "RUNNERS", {k: refuse for k in peak.RUNNERS})
    monkeypatch.setenv(peak.CLOCK_ENV, "2.0")
    path = tmp_path / "peak.json"
    monkeypatch.setenv(peak.PEAK_FILE_ENV, str(path))
    theo = peak.theoretical_cpu_peak().tflops["float32"]
    peak.save_peak(_record(peak.machine_key(), fp32=theo / 4), str(path))  # stored: a quarter of theoretical

    c = _tiny()
    c.save, c.global_batch_size = str(tmp_path / "run"), 4
    cfg = from_configdict(c)
    out = pretrain(cfg, create_mesh(cfg, jax.devices()[:2]))  # dp 2: two CPU devices share the host
    assert out["iteration"] == 4
    text = capsys.readouterr().out
    line = next(l for l in text.splitlines() if "peak for MFU" in l)
    assert f"{theo / 4 / 2:.4g} TFLOP/s/device (measured by bench peak" in line, line
    assert f"theoretical peak: {theo / 2:.4g} TFLOP/s/device" in line and "/ 2 CPU devices" in line, line
    rows = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl") if '"mfu"' in l]
    assert len(rows) == 2
    # The logger got both denominators: the stored one and the theoretical one (4x larger).
    for r in rows:
        assert r["mfu_theoretical"] > 0 and r["mfu"] / r["mfu_theoretical"] == pytest.approx(4.0)


@pytest.mark.slow
def test_bench_peak_stores_a_record_the_trainer_uses(tmp_path):
    """``bench peak`` end to end at tiny sizes: a record keyed by this machine, the table with
    each library and the theoretical peak, and resolve_peak picking it up."""
    store, out = tmp_path / "peak.json", tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "jmegatron.bench", "peak", "--sizes", "32,64", "--repeats", "2",
                           "--chain", "1", "--libraries", "xla,torch", "--peak-file", str(store), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = peak.load_peak(str(store))
    assert record["key"] == peak.machine_key("cpu", "cpu")
    assert set(record["libraries"]) == {"xla", "torch"} and set(record["dtypes"]) == {"float32", "bfloat16"}
    for name, best in record["dtypes"].items():
        assert best["peak_tflops"] == max(record["libraries"][lib][name]["peak_tflops"] for lib in ("xla", "torch"))
    assert "| xla | float32 | 32" in proc.stdout and "| torch | bfloat16 | 64" in proc.stdout
    assert "measured / theoretical" in proc.stdout and (out / "peak.md").is_file() and (out / "peak.png").is_file()
    r = peak.resolve_peak("float32", path=str(store), num_local_devices=1, platform_name="cpu", device_kind="cpu")
    assert r.tflops == record["dtypes"]["float32"]["peak_tflops"] and r.source.startswith("measured")


def test_bench_peak_warns_when_a_run_beats_the_theoretical_peak():
    from jmegatron.bench import peak as bench_peak

    def record(samples):
        by_size = {"64": {"median_tflops": sorted(samples)[len(samples) // 2], "samples_tflops": samples}}
        med = by_size["64"]["median_tflops"]
        return {"theoretical": {"float32": 1.0, "summary": "1 core x 1 GHz x 1000 FLOP/cycle"},
                "libraries": {"xla": {"float32": {"peak_tflops": med, "best_size": 64, "by_size": by_size}}},
                "dtypes": {"float32": {"peak_tflops": med, "library": "xla", "best_size": 64}}}

    assert bench_peak.warnings(record([0.5, 0.6, 0.9])) == []
    (line,) = bench_peak.warnings(record([0.5, 0.6, 1.2]))  # one run above: the assumptions are wrong
    assert "1.2 TFLOP/s, 1.20x the theoretical" in line and "JMEGATRON_CPU_FP32_FLOP_PER_CYCLE" in line
    (line,) = bench_peak.warnings(record([1.1, 1.2, 1.3]))  # the median above
    assert "measured peak 1.2 TFLOP/s is 1.20x" in line and bench_peak.ratio(record([1.1, 1.2, 1.3]), "float32") == 1.2


def test_measured_core_clock_replaces_a_nominal_cpuinfo_clock(tmp_path, monkeypatch):
    """bench peak's measured core clock lifts a /proc/cpuinfo 'cpu MHz' clock (a hypervisor's
    nominal one) in the theoretical peak; cpufreq's maximum and the override are kept."""
    text = fake_cpuinfo("AuthenticAMD", 25, 17, X86 + ["avx512f"], cores=2, mhz=2596.0)
    cpu = peak.cpu_info(text, sysfs_root="/nonexistent", affinity=[0, 1])
    theo = peak.theoretical_cpu_peak(cpu, measured_clock_ghz=3.675)
    assert theo.tflops["float32"] == pytest.approx(2 * 3.675e9 * 32 / 1e12)
    assert "measured by bench peak" in theo.description and "2.596 GHz" in theo.description
    assert peak.theoretical_cpu_peak(cpu, measured_clock_ghz=2.0).tflops["float32"] == \
        pytest.approx(2 * 2.596e9 * 32 / 1e12)  # a slower measurement (a loaded core) never lowers it
    sysfs = sysfs_with_max_freq(tmp_path, 3000000)
    cpu = peak.cpu_info(text, sysfs_root=sysfs, affinity=[0, 1])
    assert peak.theoretical_cpu_peak(cpu, measured_clock_ghz=3.675).tflops["float32"] == \
        pytest.approx(2 * 3.0e9 * 32 / 1e12)


def test_resolve_peak_uses_the_stored_clock_of_this_machine_only(tmp_path, monkeypatch):
    path = str(tmp_path / "peak.json")
    cpu = peak.cpu_info()
    if cpu.clock_ghz is None or "cpu MHz" not in cpu.clock_source:
        pytest.skip(f"this machine's clock does not come from /proc/cpuinfo's cpu MHz: {cpu.clock_source}")
    lifted = cpu.clock_ghz * 1.5
    record = dict(_record(peak.machine_key("cpu", "cpu")), cpu={"measured_clock_ghz": lifted})
    peak.save_peak(record, path)
    r = peak.resolve_peak("float32", None, path, num_local_devices=1, platform_name="cpu", device_kind="cpu")
    assert r.theoretical_tflops == pytest.approx(peak.theoretical_cpu_peak(cpu).tflops["float32"] * 1.5)
    assert f"{lifted:.3f} GHz" in r.theoretical_source
    peak.save_peak(dict(record, key="cpu|Other CPU|2 cores|flags-sha256:0"), path)
    r = peak.resolve_peak("float32", None, path, num_local_devices=1, platform_name="cpu", device_kind="cpu")
    if "hypervisor" in cpu.flags:  # a guest's nominal clock states no peak (MFU above 100% otherwise)
        assert r.theoretical_tflops is None and r.tflops is None
        assert "bench peak" in r.theoretical_source and "bench peak" in r.describe()
    else:
        assert r.theoretical_tflops == pytest.approx(peak.theoretical_cpu_peak(cpu).tflops["float32"])


def test_a_hypervisors_nominal_clock_is_not_a_stated_peak():
    """Under a hypervisor /proc/cpuinfo's cpu MHz is the nominal clock (this VM: 2.596 GHz,
    cores at 3.675): resolve_peak's theoretical peak refuses it until bench peak measured
    the clock; bare metal, cpufreq's maximum or a measured clock are used."""
    guest = peak.cpu_info(fake_cpuinfo("AuthenticAMD", 25, 17, X86 + ["avx512f", "hypervisor"], cores=2,
                                       mhz=2596.0), sysfs_root="/nonexistent", affinity=[0, 1])
    with pytest.raises(peak.PeakUnavailable, match="nominal.*python -m jmegatron.bench peak"):
        peak.theoretical_cpu_peak(guest, trust_nominal_clock=False)
    assert peak.theoretical_cpu_peak(guest).tflops["float32"] == pytest.approx(2 * 2.596e9 * 32 / 1e12)
    measured = peak.theoretical_cpu_peak(guest, measured_clock_ghz=3.675, trust_nominal_clock=False)
    assert measured.tflops["float32"] == pytest.approx(2 * 3.675e9 * 32 / 1e12)
    metal = peak.cpu_info(fake_cpuinfo("AuthenticAMD", 25, 17, X86 + ["avx512f"], cores=2, mhz=2596.0),
                          sysfs_root="/nonexistent", affinity=[0, 1])
    assert peak.theoretical_cpu_peak(metal, trust_nominal_clock=False).tflops["float32"] == \
        pytest.approx(2 * 2.596e9 * 32 / 1e12)


def test_core_clock_is_measured():
    from jmegatron.reporting import core_clock

    try:
        c = core_clock.measure_core_clock_ghz(samples=20, iterations=2_000_000)
    except core_clock.ClockUnavailable as e:
        pytest.skip(str(e))
    assert 0.3 < c["median_ghz"] <= c["ghz"] < 8.0  # no CPU core runs outside this
    with pytest.raises(ValueError, match="samples"):
        core_clock.measure_core_clock_ghz(samples=0)
