"""Drift seen early: the series moved onto the newest commit the mirror (H3KIT_COMFY_SOURCE) holds on master.

What is asserted is h3kit's machinery, never upstream's future: the rebase runs and reports every patch
(clean, merged or conflicting, per hunk), a clean result is a series `patches check` accepts, and install
off the pin with --force takes the commit (plainly or three-way) and verify passes. A conflict at that
commit is upstream having moved away from the series: reported as an xfail naming the commit and the hunks,
not a failure, so CI does not depend on what upstream does next.

The second test runs, on the tree installed at that commit (the series with --force), what a user would
notice: `h3kit parity --component dit --npu-count 2 --device-type cpu` (the DiT split must stay exact), and
upstream's own unit tests, compared with the plain tree at the same commit. Upstream's tests-unit fails
about a hundred tests here even unpatched (no aiohttp_client fixture, no network, CUDA probes at import), so
a failure counts only when it happens with the series and not without it. The subset run is the test files
of tests-unit that import a module the series modifies (comfy.model_management, comfy.ops, comfy.sd, nodes,
... : `git diff --diff-filter=M` of the installed tree, so the subset follows the series); the whole of
tests-unit takes minutes here; at master 0f1fa67a the subset is 10 files, 47 tests (the seedvr2, VAE tiled
decode and mixed-precision tests), about 35 s per tree, the two trees side by side with the parity (about
20 s): the test adds about 65 s to CI on the 2-core machine.
Drift (a parity row off its gate or a parity worker failing on upstream's code, a test id failing only when
patched) is reported like a conflict, through requires.upstream_moved, naming the commit and what broke;
an h3kit error of its own (exit 2 or 3) and a plain tree whose tests cannot run fail the test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.conftest import MANIFEST, ROOT
from tests.support import jsondoc, requires

pytestmark = pytest.mark.upstream
SERIES = [p["name"] for p in MANIFEST["patches"]]
UNIT_TIMEOUT = 600     # one tree's subset of tests-unit; about 35 s on the 2-core CI machine
PARITY_TIMEOUT = 600   # the dit parity on 2 simulated devices; about 20 s there


def h3kit(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "h3kit", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def newest_master(source: str) -> tuple[str, str]:
    git = ["git", "--git-dir", source] if os.path.isdir(os.path.join(source, "objects")) else ["git", "-C", source]
    rev = os.environ.get("H3KIT_FOLLOW_REV", "master")  # tools/follow_upstream.py looks ahead on any branch
    proc = subprocess.run([*git, "log", "-1", "--format=%H %s", rev], capture_output=True, text=True)
    if proc.returncode != 0:
        requires.skip(f"{source} has no master branch to look ahead on: point H3KIT_COMFY_SOURCE at a mirror of kat3ri/ComfyUI")
    commit, _, subject = proc.stdout.strip().partition(" ")
    return commit, subject


def test_the_series_rebases_onto_the_newest_master_the_mirror_holds(comfy_source, comfy_python, tmp_path):
    commit, subject = newest_master(comfy_source)
    out = tmp_path / "out"
    r = h3kit("patches", "rebase", "--onto", commit, "--source", comfy_source, "--out", out, "--json")
    assert r.returncode in (0, 1), r.stdout + r.stderr
    doc = jsondoc.document(r.stdout, r.returncode)["data"]
    assert doc["onto"] == commit and [p["patch"] for p in doc["patches"]] == SERIES
    assert sum(doc["counts"].values()) == len(SERIES)
    assert (out / "report.txt").read_text().startswith("h3kit patches rebase")
    summary = f"upstream master {commit[:12]} ({subject}): " + ", ".join(f"{v} {k}" for k, v in doc["counts"].items())
    print(summary)
    if r.returncode == 1:
        assert doc["conflicts"] and all(c["patch"] in SERIES and c["file"] for c in doc["conflicts"])
        for c in doc["conflicts"]:
            marked = out / "conflicts" / c["patch"] / c["file"]
            assert "<<<<<<< upstream" in marked.read_text()
        requires.upstream_moved(summary + "; conflicts: " + "; ".join(f"{c['patch']}: {c['file']} {c['hunk']}"
                                                          for c in doc["conflicts"]))
    if doc["counts"]["merged"]:
        warnings.warn(f"{summary}: the series needs a rebase to apply plainly (h3kit patches rebase --onto {commit[:12]})")
    # the refreshed series is one `patches check` accepts, on that commit
    assert json.loads((out / "source_deps_info.json").read_text())["upstream"]["commit"] == commit
    r = h3kit("patches", "check", "--source", comfy_source, "--json", env=dict(os.environ, H3KIT_ROOT=str(out)))
    assert r.returncode == 0, r.stdout + r.stderr
    # and the series as it is installs there with --force (plainly or three-way) and verifies
    home = tmp_path / "ComfyUI"
    r = h3kit("install", "--comfy-home", home, "--source", comfy_source, "--python", comfy_python,
              "--commit", commit, "--force", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    merge = jsondoc.data(r.stdout, r.returncode)["merge"]
    state = json.loads((home / ".h3kit" / "state.json").read_text())
    if commit == MANIFEST["upstream"]["commit"]:  # the pin itself (master when the pin has just moved)
        assert merge is None and state["pin_verified"] is True and state["commit_requested"] == commit
    else:
        assert merge["onto"] == commit and [m["patch"] for m in merge["patches"]] == SERIES
        assert {m["how"] for m in merge["patches"]} <= {"plain", "3-way"}
        assert state["merge"] == merge
    r = h3kit("verify", "--comfy-home", home, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    shutil.rmtree(home, ignore_errors=True)
    assert ROOT.is_dir()


def patched_modules(home) -> list[str]:
    """The upstream modules the series modifies in the installed tree (new files of the series excluded)."""
    proc = subprocess.run(["git", "-C", str(home), "diff", "--name-only", "--diff-filter=M"], capture_output=True,
                          text=True, check=True)
    return [f[:-3].replace("/", ".") for f in proc.stdout.split() if f.endswith(".py")]


def unit_subset(tree, modules: list[str]) -> list[str]:
    """The test files of tree's tests-unit that import one of `modules` (`import a.b`, `from a.b import`,
    `from a import b`, or a patch("a.b.x") target), relative to the tree, sorted."""
    pats = []
    for m in modules:
        pats.append(r"\b" + re.escape(m) + r"\b" if "." in m else r"^\s*(?:import|from)\s+" + re.escape(m) + r"\b")
        pkg, _, leaf = m.rpartition(".")
        if pkg:
            pats.append(r"^\s*from\s+" + re.escape(pkg) + r"\s+import\s+[^\n]*\b" + re.escape(leaf) + r"\b")
    found = re.compile("|".join(pats), re.M)
    root = Path(tree)
    return sorted(str(p.relative_to(root)) for p in (root / "tests-unit").rglob("*.py")
                  if p.name != "conftest.py" and found.search(p.read_text(errors="replace")))


def start_unit(python, tree, tests: list[str]) -> subprocess.Popen:
    """Upstream's pytest on `tests` with the tree as cwd (its pytest.ini: pythonpath=.), the short summary of
    failures and errors only; collection errors do not stop the other files."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    return subprocess.Popen([python, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-q", "--tb=no",
                             "-rfE", "--continue-on-collection-errors", *tests], cwd=tree, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def failing_ids(output: str) -> set[str]:
    """The test ids pytest's short summary (-rfE) names as FAILED or ERROR (a collection error names the file)."""
    return {m.group(2) for m in re.finditer(r"^(FAILED|ERROR) (\S+)", output, re.M)}


def unit_outcome(proc: subprocess.Popen, what: str) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=UNIT_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return -1, out + f"\n[{what}: tests-unit subset still running after {UNIT_TIMEOUT} s, killed]"
    return proc.returncode, out


def parity_drift(rc: int, doc: dict) -> str | None:
    """What the dit parity broke on the tree, or None when it passed. exit 1 is a verdict about the tree (rows
    off the gate, or the worker failing in upstream's code); anything else is h3kit's own error and fails."""
    assert rc in (0, 1), f"h3kit parity exited {rc}: h3kit's own error, not upstream's\n{json.dumps(doc)[-3000:]}"
    if rc == 0:
        assert doc["ok"] and doc["data"] and all(r["pass"] for r in doc["data"])
        return None
    if not doc["ok"] and "error" in doc:
        e = doc["error"]
        return f"dit parity does not run: [{e['code']}] {e['message']}"
    failed = [r for r in doc["data"] if not r["pass"]]
    assert failed, "h3kit parity exited 1 with every row passing"
    return f"dit parity: {len(failed)} of {len(doc['data'])} row(s) off the gate: " + "; ".join(
        f"{r.get('layout')}/{r.get('dtype')}{'+lora' if r.get('lora') else ''}/{r.get('attention')} "
        f"max_abs={r.get('max_abs')} max_rel={r.get('max_rel')} (gate {r.get('gate')})" for r in failed[:6])


def unit_drift(patched: set[str], plain: set[str]) -> list[str]:
    """Test ids failing with the series and not on the plain tree at the same commit: the series' drift."""
    return sorted(patched - plain)


def drift_verdict(commit: str, subject: str, parity: str | None, drifted: list[str]) -> str | None:
    """The upstream_moved reason naming the commit and what broke, or None when nothing drifted."""
    broke = ([parity] if parity else []) + (
        [f"upstream tests failing only with the series: {', '.join(drifted)}"] if drifted else [])
    return f"upstream master {commit[:12]} ({subject}): " + "; ".join(broke) if broke else None


def test_upstream_unit_tests_and_dit_parity_on_the_newest_master(comfy_source, comfy_python, tmp_path):
    commit, subject = newest_master(comfy_source)
    home = tmp_path / "ComfyUI"
    r = h3kit("install", "--comfy-home", home, "--source", comfy_source, "--python", comfy_python,
              "--commit", commit, "--force", "--json")
    assert r.returncode in (0, 1), r.stdout + r.stderr
    if r.returncode == 1:
        doc = jsondoc.document(r.stdout, r.returncode)
        requires.upstream_moved(f"upstream master {commit[:12]} ({subject}): the series does not install there "
                                f"({doc['error']['message']}); the rebase test names the hunks")
    # the plain tree at the same commit, from the installed clone (no checkout of the mirror's master)
    plain = tmp_path / "plain"
    for cmd in (["git", "clone", "-q", "--no-checkout", "--shared", str(home / ".git"), str(plain)],
                ["git", "-C", str(plain), "checkout", "-q", "--detach", commit]):
        subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # two blobs absent from the mirror
    assert (plain / "nodes.py").is_file() and not (plain / "comfy" / "multinpu.py").exists()
    modules = patched_modules(home)
    assert "comfy.model_management" in modules and "nodes" in modules, modules
    tests = unit_subset(plain, modules)
    assert tests, f"no test of tests-unit at {commit[:12]} imports {modules}"
    assert unit_subset(home, modules) == tests
    runs = {"patched": start_unit(comfy_python, home, tests), "plain": start_unit(comfy_python, plain, tests)}
    par = h3kit("parity", "--comfy-home", home, "--component", "dit", "--npu-count", 2, "--device-type", "cpu",
                "--json", timeout=PARITY_TIMEOUT)
    assert par.returncode in (0, 1), f"h3kit parity exited {par.returncode}: h3kit's own error\n{par.stdout}{par.stderr}"
    parity = parity_drift(par.returncode, jsondoc.document(par.stdout, par.returncode))
    (rc_patched, out_patched), (rc_plain, out_plain) = (unit_outcome(runs[k], k) for k in ("patched", "plain"))
    # pytest: 0 all passed, 1 some failed; anything else on the plain tree means the subset did not run
    assert rc_plain in (0, 1), f"upstream's tests-unit does not run on the plain tree at {commit[:12]}:\n{out_plain[-3000:]}"
    ran = re.search(r"(\d+) passed", out_plain)
    assert ran, f"no upstream test passed on the plain tree:\n{out_plain[-3000:]}"
    drifted = unit_drift(failing_ids(out_patched), failing_ids(out_plain))
    if rc_patched not in (0, 1):
        drifted.append(f"(the whole run: pytest exited {rc_patched}: {out_patched.strip().splitlines()[-1:]})")
    print(f"upstream master {commit[:12]}: {len(tests)} tests-unit file(s) of {modules}; plain: "
          f"{out_plain.strip().splitlines()[-1]}; patched: {out_patched.strip().splitlines()[-1]}; parity: "
          f"{parity or 'passed'}")
    verdict = drift_verdict(commit, subject, parity, drifted)
    if verdict:
        requires.upstream_moved(verdict)


PLAIN_OUT = """\
FAILED tests-unit/comfy_test/test_a.py::test_network - OSError: no network
ERROR tests-unit/comfy_extras_test/compositor_node_test.py - RuntimeError: Found no NVIDIA driver
1 failed, 40 passed, 1 error in 9.1s
"""
PATCHED_OUT = """\
FAILED tests-unit/comfy_test/test_a.py::test_network - OSError: no network
FAILED tests-unit/comfy_test/test_seedvr2_dtype.py::test_cast[bf16] - AssertionError: dtype
ERROR tests-unit/comfy_extras_test/compositor_node_test.py - RuntimeError: Found no NVIDIA driver
ERROR tests-unit/comfy_quant/test_mixed_precision.py - ImportError: cannot import name 'QuantizedTensor'
2 failed, 39 passed, 2 errors in 9.3s
"""


def test_the_drift_report_names_the_commit_and_the_tests_failing_only_with_the_series():
    drifted = unit_drift(failing_ids(PATCHED_OUT), failing_ids(PLAIN_OUT))
    assert drifted == ["tests-unit/comfy_quant/test_mixed_precision.py",
                       "tests-unit/comfy_test/test_seedvr2_dtype.py::test_cast[bf16]"]
    verdict = drift_verdict("0f1fa67ad8a68b62c65ebc97a7bf485df2459c3a", "a subject", None, drifted)
    assert verdict.startswith("upstream master 0f1fa67ad8a6 (a subject): ") and all(t in verdict for t in drifted)
    assert "test_network" not in verdict and "compositor" not in verdict   # failing unpatched too: not drift
    assert drift_verdict("0f1fa67ad8a6", "s", None, unit_drift(failing_ids(PLAIN_OUT), failing_ids(PLAIN_OUT))) is None


def test_a_parity_off_its_gate_or_not_running_is_drift_and_an_h3kit_error_is_not():
    rows = [{"pass": True, "layout": "t2va", "dtype": "fp32", "attention": "ulysses", "max_abs": 0.0},
            {"pass": False, "layout": "fl2va", "dtype": "bf16", "lora": True, "attention": "gather",
             "max_abs": 0.0625, "max_rel": 0.01, "gate": "max_abs == 0"}]
    assert parity_drift(0, {"ok": True, "data": rows[:1]}) is None
    off = parity_drift(1, {"ok": False, "data": rows})
    assert "1 of 2" in off and "fl2va/bf16+lora/gather max_abs=0.0625" in off
    broken = parity_drift(1, {"ok": False, "error": {"code": "worker_failed", "message": "parity worker: TypeError: x"}})
    assert "worker_failed" in broken and "TypeError: x" in broken
    verdict = drift_verdict("0f1fa67ad8a68b62c65ebc97a7bf485df2459c3a", "s", off, [])
    assert verdict.startswith("upstream master 0f1fa67ad8a6") and "max_abs=0.0625" in verdict
    for rc in (2, 3):
        with pytest.raises(AssertionError, match="h3kit's own error"):
            parity_drift(rc, {"ok": False, "error": {"code": "internal", "message": "Traceback"}})
