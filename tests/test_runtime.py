"""jmegatron.runtime: the host allocator the CLIs restart with."""

import os
import subprocess
import sys

import pytest

from jmegatron import runtime

from conftest import REPO


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in (runtime.ALLOCATOR_ENV, runtime._REEXEC_MARK, "LD_PRELOAD", "MIMALLOC_PURGE_DELAY"):
        monkeypatch.delenv(var, raising=False)


def test_requested_defaults_to_mimalloc_and_refuses_unknown_names(monkeypatch):
    assert runtime.requested() == runtime.DEFAULT_ALLOCATOR == "mimalloc"
    monkeypatch.setenv(runtime.ALLOCATOR_ENV, "tcmaloc")
    with pytest.raises(runtime.AllocatorUnavailable, match="not one of"):
        runtime.requested()


def test_mimalloc_environment_preloads_the_pypi_library_first():
    env = runtime.allocator_env("mimalloc", {"LD_PRELOAD": "/other/libx.so", "PATH": "/bin"})
    lib, other = env["LD_PRELOAD"].split()
    assert lib.endswith("libmimalloc.so") and os.path.exists(lib) and other == "/other/libx.so"
    assert env["MIMALLOC_PURGE_DELAY"] == "-1" and env["PATH"] == "/bin"
    assert env[runtime.ALLOCATOR_ENV] == env[runtime._REEXEC_MARK] == "mimalloc"
    assert runtime.allocator_env("mimalloc", env)["LD_PRELOAD"] == env["LD_PRELOAD"]  # not added twice


def test_default_and_hugepages_environments():
    env = runtime.allocator_env("default", {"LD_PRELOAD": "/other/libx.so"})
    assert env["LD_PRELOAD"] == "/other/libx.so" and env[runtime.ALLOCATOR_ENV] == "default"
    if runtime.transparent_huge_pages() not in ("always", "madvise"):
        with pytest.raises(runtime.AllocatorUnavailable, match="huge pages"):
            runtime.allocator_env("hugepages", {})
        return
    env = runtime.allocator_env("hugepages", {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.trim_threshold=1:glibc.malloc.hugetlb=1"
    assert runtime.allocator_env("hugepages", env)["GLIBC_TUNABLES"] == env["GLIBC_TUNABLES"]


def test_missing_library_names_the_package(monkeypatch):
    monkeypatch.setattr(runtime.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(runtime.os.path, "exists", lambda path: False)
    with pytest.raises(runtime.AllocatorUnavailable, match="apt-get install libjemalloc2"):
        runtime.library_path("jemalloc")


def test_unavailable_allocator_falls_back_with_one_line(monkeypatch, capsys):
    def missing(name):
        raise runtime.AllocatorUnavailable(f"{name} is not installed")

    monkeypatch.setattr(runtime, "library_path", missing)
    monkeypatch.setenv(runtime.ALLOCATOR_ENV, "tcmalloc")
    runtime.reexec_with_host_allocator()  # returns: this test process keeps running
    assert runtime.active() == "default"
    assert "tcmalloc is not installed; using glibc's malloc" in capsys.readouterr().err


@pytest.mark.parametrize("name,loaded", [("mimalloc", True), ("default", False)])
def test_cli_restarts_with_the_allocator_loaded(name, loaded):
    code = ("from jmegatron.runtime import reexec_with_host_allocator\n"
            "reexec_with_host_allocator()\n"
            "import os; print('ACTIVE', os.environ.get('JMEGATRON_HOST_ALLOCATOR_SET'))\n"
            "print('MIMALLOC_MAPPED', 'libmimalloc' in open('/proc/self/maps').read())\n")
    env = {k: v for k, v in os.environ.items() if k not in (runtime._REEXEC_MARK, "LD_PRELOAD")}
    env[runtime.ALLOCATOR_ENV] = name
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("ACTIVE") == 1  # restarted at most once, printed once
    assert f"ACTIVE {name if loaded else None}" in out.stdout
    assert f"MIMALLOC_MAPPED {loaded}" in out.stdout
