"""The suite's own rules for what may skip (tests/support/requires.py), run on real tests of this suite.

Without the pinned upstream a developer's run skips the upstream tests with the reason and the fix; under
H3KIT_REQUIRE_UPSTREAM=1 (.ci/run) the same tests fail, so CI cannot go green on a checkout where they could
not run. In make test's torch-free runs (other Pythons, no torch) the tests that need torch skip by design,
before any fixture, and say so; the others still run or fail as anywhere else.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

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


# what skips behind CI's back: pytest's own skips do not know H3KIT_REQUIRE_UPSTREAM
DIRECT_SKIPS = re.compile(r"pytest\.skip\(|\bskipif\b|mark\.skip\b|importorskip\(|pytest\.xfail\(|mark\.xfail\b")


def test_every_skip_goes_through_the_one_helper():
    """pytest.skip, skipif, mark.skip, importorskip and xfail skip (or pass) under H3KIT_REQUIRE_UPSTREAM=1 too:
    a test skips only through requires.skip(), which fails in CI unless the skip is by design."""
    offenders = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in sorted((ROOT / "tests").rglob("*.py"))
                 if p.name != "test_test_policy.py" and p != ROOT / "tests" / "support" / "requires.py"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if DIRECT_SKIPS.search(line)]
    assert offenders == [], "\n".join(offenders)


def test_the_policy_catches_each_way_to_skip():
    for line in ("    pytest.skip('x')", "@pytest.mark.skipif(True, reason='x')", "@pytest.mark.skip(reason='x')",
                 "np = pytest.importorskip('numpy')", "    pytest.xfail('x')", "@pytest.mark.xfail"):
        assert DIRECT_SKIPS.search(line), line
    assert not DIRECT_SKIPS.search("    requires.skip('x', by_design=True)")


def test_only_a_skip_by_design_skips_in_ci(tmp_path):
    test = tmp_path / "test_skips.py"
    test.write_text("from tests.support import requires\n\n\n"
                    "def test_missing():\n    requires.skip('needs the frobnicator: apt-get install frob')\n\n\n"
                    "def test_designed():\n    requires.skip('the parent-death signal is Linux\\'s', by_design=True)\n")
    env = {"PYTHONPATH": str(ROOT)}
    rc, out = pytest_run(str(test), **env)
    assert rc == 0 and "2 skipped" in out and "needs the frobnicator" in out, out
    assert "by design: the parent-death signal is Linux's" in out, out
    rc, out = pytest_run(str(test), H3KIT_REQUIRE_UPSTREAM="1", **env)
    assert rc == 1 and "1 failed, 1 skipped" in out and "needs the frobnicator" in out, out
    assert "H3KIT_REQUIRE_UPSTREAM=1" in out and "by design: the parent-death signal" in out, out


def test_a_skip_says_why():
    import pytest
    for reason in ("", "   ", None):
        with pytest.raises(ValueError, match="needs the reason"):
            requires.skip(reason, by_design=True)


def test_ci_turns_a_missing_module_into_a_failure(tmp_path):
    test = tmp_path / "test_needs_module.py"
    test.write_text("from tests.support import requires\n\n\ndef test_it():\n"
                    "    requires.module('h3kit_no_such_module', 'needs h3kit_no_such_module')\n")
    env = {"PYTHONPATH": str(ROOT)}
    rc, out = pytest_run(str(test), **env)
    assert rc == 0 and "1 skipped" in out and "needs h3kit_no_such_module" in out, out
    rc, out = pytest_run(str(test), H3KIT_REQUIRE_UPSTREAM="1", **env)
    assert rc == 1 and "1 failed" in out and "H3KIT_REQUIRE_UPSTREAM=1" in out, out


# ---- ports: one allocator (tests/support/service_helpers.py free_port) -------------------------------------

# an address tuple with a literal port (a bind, a server's address), or a module constant PORT = 8603
FIXED_PORT = re.compile(r'\(\s*"(?:127\.0\.0\.1|0\.0\.0\.0|localhost|)",\s*[1-9]\d{2,4}\s*\)|^\s*[A-Z_]*PORT\s*=\s*\d{3,5}\b')
BAND = re.compile(r"free_port\(\s*(\d+)\s*,\s*(\d+)")


def test_no_test_uses_a_fixed_port_or_a_band_in_the_ephemeral_range():
    from tests.support import service_helpers
    first_ephemeral = min(service_helpers.ephemeral_range()[0], 32768)
    fixed, ephemeral = [], []
    for p in sorted((ROOT / "tests").rglob("*.py")):
        if p.name == "test_test_policy.py":
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if FIXED_PORT.search(line):
                fixed.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
            for lo, hi in BAND.findall(line):
                if int(hi) + 2 >= first_ephemeral:
                    ephemeral.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert fixed == [], "a fixed port (take one from free_port, or bind port 0):\n" + "\n".join(fixed)
    assert ephemeral == [], "a band in the ephemeral range:\n" + "\n".join(ephemeral)
    assert FIXED_PORT.search('    server = HTTPServer(("127.0.0.1", 8607), X)') and FIXED_PORT.search('s.bind(("", 8189))')
    assert FIXED_PORT.search("PORT = 8603 + PORT_OFFSET") and not FIXED_PORT.search('s.bind(("127.0.0.1", 0))')


def test_a_reserved_port_is_handed_out_once_across_processes_until_released(tmp_path, monkeypatch):
    from tests.support import service_helpers as sh
    monkeypatch.setattr(sh, "PORT_LOCKS", tmp_path / "locks")
    monkeypatch.setattr(sh, "_held", {})
    a = sh.free_port(21000, 21009)
    b = sh.free_port(21000, 21009)
    assert a != b  # this process holds a
    code = ("import sys; from pathlib import Path; from tests.support import service_helpers as sh\n"
            f"sh.PORT_LOCKS = Path({str(tmp_path / 'locks')!r})\n"
            "print(sh.free_port(21000, 21009, span=3))\n")
    other = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
    got = int(other.stdout.split()[-1])
    assert not {got, got + 1, got + 2} & {a, b}, (a, b, got)  # another process skips what this one holds
    with socket.socket() as taken:  # in use by someone outside the allocator: skipped too
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 21002))
        taken.listen(1)
        c = sh.free_port(21002, 21009)
        assert c not in (21002, a, b)
    sh.release_test_ports()
    assert sh._held == {} and sh.free_port(21000, 21009) == min(a, b)  # released at the test's end
    sh.release_test_ports()
    with pytest.raises(ValueError, match="ephemeral range"):
        sh.free_port(sh.ephemeral_range()[0], sh.ephemeral_range()[0] + 5)
    sh.FIXTURE_SCOPES.append("module")
    try:
        d = sh.free_port(21000, 21009)
    finally:
        sh.FIXTURE_SCOPES.pop()
    sh.release_test_ports()
    assert d in sh._held  # a module fixture's port is held until the process ends
    os.close(sh._held.pop(d)[0])
