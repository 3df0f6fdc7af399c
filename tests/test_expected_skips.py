"""The suite's skip check (tests/conftest.py, EXPECTED_SKIPS): a skip outside the expected
set (a package of the [test] extra that does not import, above all) fails the run, under
pytest-xdist too; the expected skips (Transformer Engine, cuDNN, the TensorRT-LLM engine) do not."""

import subprocess
import sys
import textwrap
import types

import pytest

from conftest import EXPECTED_SKIPS, REPO, ExpectedSkips, subprocess_env


def _report(reason, nodeid="tests/test_x.py::test_y", **kw):
    return types.SimpleNamespace(skipped=True, longrepr=("tests/test_x.py", 3, reason), nodeid=nodeid, **kw)


def test_an_unexpected_skip_fails_the_session():
    check = ExpectedSkips()
    check.pytest_runtest_logreport(_report("Transformer Engine unavailable: No module named 'transformer_engine'"))
    check.pytest_runtest_logreport(_report("cuDNN attention needs an NVIDIA GPU (jax.default_backend() != 'gpu')"))
    check.pytest_runtest_logreport(_report("xfail", wasxfail=""))  # an xfail is no skip
    check.pytest_runtest_logreport(types.SimpleNamespace(skipped=False, longrepr=None, nodeid="p"))
    session = types.SimpleNamespace(exitstatus=pytest.ExitCode.OK)
    check.pytest_sessionfinish(session)
    assert session.exitstatus == pytest.ExitCode.OK and not check.unexpected
    assert check.expected == {"Transformer Engine": 1, "cuDNN": 1}

    check.pytest_collectreport(_report("Skipped: could not import 'torch': No module named 'torch'",
                                       nodeid="tests/test_export_hf.py"))
    check.pytest_sessionfinish(session)
    assert session.exitstatus == pytest.ExitCode.TESTS_FAILED
    assert check.unexpected == [("tests/test_export_hf.py",
                                 "Skipped: could not import 'torch': No module named 'torch'")]
    assert set(EXPECTED_SKIPS) >= {"Transformer Engine", "cuDNN", "the TensorRT-LLM engine"}


def test_a_missing_extra_fails_an_xdist_run(tmp_path):
    """End to end: two workers, one module skipped at collection (``importorskip`` of a
    package that is not installed), one expected skip: exit status 1, the module named."""
    (tmp_path / "test_needs_extra.py").write_text(textwrap.dedent("""
        import pytest
        pytest.importorskip("jmegatron_no_such_package")
        def test_a():
            pass
    """))
    (tmp_path / "test_expected.py").write_text(textwrap.dedent("""
        import pytest
        @pytest.mark.skipif(True, reason="tensorrt_llm is not importable here (planted)")
        def test_engine():
            pass
        def test_b():
            pass
    """))
    env = dict(subprocess_env(1, cache=False), PYTHONPATH=str(REPO / "tests"))
    cmd = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-n", "2", "-q",
           "--rootdir", str(tmp_path), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "unexpected skips" in out and "test_needs_extra.py" in out and "jmegatron_no_such_package" in out
    assert "expected skips: the TensorRT-LLM engine (1)" in out and "1 passed, 2 skipped" in out
