"""jmegatron.runtime: the opt-in huge-page malloc setting of the CLIs."""

import os
import subprocess
import sys

from jmegatron import runtime

from conftest import REPO


def test_tunables_are_added_not_replaced():
    env = runtime.host_tunables_env({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.trim_threshold=1:glibc.malloc.hugetlb=1"
    assert runtime.host_tunables_env(env)["GLIBC_TUNABLES"] == env["GLIBC_TUNABLES"]
    assert runtime.host_tunables_env({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv("JMEGATRON_HOST_ALLOCATOR", raising=False)
    assert not runtime.wanted()
    runtime.reexec_with_host_tunables()  # a no-op: this test process keeps running
    monkeypatch.setenv("JMEGATRON_HOST_ALLOCATOR", "hugepages")
    assert runtime.wanted() == (runtime.transparent_huge_pages() in ("always", "madvise")
                                and sys.platform.startswith("linux"))


def test_cli_restarts_with_the_tunable_when_asked():
    code = ("from jmegatron.runtime import reexec_with_host_tunables\n"
            "reexec_with_host_tunables()\n"
            "import os; print('TUNABLES', os.environ.get('GLIBC_TUNABLES', ''))\n")
    env = dict(os.environ, JMEGATRON_HOST_ALLOCATOR="hugepages")
    env.pop("GLIBC_TUNABLES", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    expected = "glibc.malloc.hugetlb=1" if runtime.wanted() or runtime.transparent_huge_pages() in (
        "always", "madvise") else ""
    assert out.stdout.count("TUNABLES") == 1 and f"TUNABLES {expected}" in out.stdout
