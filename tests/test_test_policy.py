"""The suite's own rules for what may skip (tests/support/requires.py), run on real tests of this suite.

Without the pinned upstream a developer's run skips the upstream tests with the reason and the fix; under
H3KIT_REQUIRE_UPSTREAM=1 (.ci/run) the same tests fail, so CI cannot go green on a checkout where they could
not run. In make test's torch-free runs (other Pythons, no torch) the tests that need torch skip by design,
before any fixture, and say so; the others still run or fail as anywhere else.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support import requires

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ONLY = "tests/test_install_upstream.py::test_the_series_checks_against_the_pin"  # needs the source, no torch
NEEDS_TORCH = "tests/test_multinpu_patches.py::test_series_applied_to_the_pin"         # runs the pinned ComfyUI


def pytest_run(test, **env):
    clean = {k: v for k, v in os.environ.items()
             if k not in ("H3KIT_COMFY_SOURCE", "H3KIT_REQUIRE_UPSTREAM", "H3KIT_COMFY_PYTHON", "H3KIT_TORCH_FREE_RUN")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test],
                          cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def test_without_the_source_upstream_tests_skip_with_the_fix():
    rc, out = pytest_run(SOURCE_ONLY)
    assert rc == 0 and "1 skipped" in out, out
    assert "H3KIT_COMFY_SOURCE is not set" in out and "git clone --mirror" in out


def test_ci_turns_a_missing_source_into_a_failure():
    rc, out = pytest_run(SOURCE_ONLY, H3KIT_REQUIRE_UPSTREAM="1")
    assert rc == 1 and "1 error" in out, out  # an error at setup, before the test body
    assert "H3KIT_COMFY_SOURCE is not set" in out and "H3KIT_REQUIRE_UPSTREAM=1" in out


def test_tests_that_need_torch_follow_the_interpreter():
    rc, out = pytest_run(NEEDS_TORCH, H3KIT_REQUIRE_UPSTREAM="1", H3KIT_TORCH_FREE_RUN="1")
    if requires.HAVE_TORCH:
        # the main run: torch is here, so only the missing source decides, and CI fails on it
        assert rc == 1 and "H3KIT_COMFY_SOURCE is not set" in out, out
    else:
        # a torch-free run: skipped by design, before its fixtures could ask for the source
        assert rc == 0 and "1 skipped" in out and "needs torch: this is make test's torch-free run" in out, out
        rc, out = pytest_run(NEEDS_TORCH, H3KIT_REQUIRE_UPSTREAM="1")  # not a torch-free run: torch is missing
        assert rc == 1 and "1 error" in out and "torch is not installed" in out, out


def test_no_test_skips_on_a_missing_module_behind_ci_s_back():
    """pytest.importorskip skips under H3KIT_REQUIRE_UPSTREAM=1 too: a test asks requires.module() instead."""
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")
                 if p.name != "test_test_policy.py" and "importorskip(" in p.read_text()]
    assert offenders == []


def test_ci_turns_a_missing_module_into_a_failure(tmp_path):
    test = tmp_path / "test_needs_module.py"
    test.write_text("from tests.support import requires\n\n\ndef test_it():\n"
                    "    requires.module('h3kit_no_such_module', 'needs h3kit_no_such_module')\n")
    env = {"PYTHONPATH": str(ROOT)}
    rc, out = pytest_run(str(test), **env)
    assert rc == 0 and "1 skipped" in out and "needs h3kit_no_such_module" in out, out
    rc, out = pytest_run(str(test), H3KIT_REQUIRE_UPSTREAM="1", **env)
    assert rc == 1 and "1 failed" in out and "H3KIT_REQUIRE_UPSTREAM=1" in out, out
