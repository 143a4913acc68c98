"""Drift seen early: the series moved onto the newest commit the mirror (H3KIT_COMFY_SOURCE) holds on master.

What is asserted is h3kit's machinery, never upstream's future: the rebase runs and reports every patch
(clean, merged or conflicting, per hunk), a clean result is a series `patches check` accepts, and install
off the pin with --force takes the commit (plainly or three-way) and verify passes. A conflict at that
commit is upstream having moved away from the series: reported as an xfail naming the commit and the hunks,
not a failure, so CI does not depend on what upstream does next. Upstream's own unit suite is not run here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest

from tests.conftest import MANIFEST, ROOT
from tests.support import jsondoc, requires

pytestmark = pytest.mark.upstream
SERIES = [p["name"] for p in MANIFEST["patches"]]


def h3kit(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "h3kit", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def newest_master(source: str) -> tuple[str, str]:
    git = ["git", "--git-dir", source] if os.path.isdir(os.path.join(source, "objects")) else ["git", "-C", source]
    proc = subprocess.run([*git, "log", "-1", "--format=%H %s", "master"], capture_output=True, text=True)
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
    assert merge["onto"] == commit and [m["patch"] for m in merge["patches"]] == SERIES
    assert {m["how"] for m in merge["patches"]} <= {"plain", "3-way"}
    assert json.loads((home / ".h3kit" / "state.json").read_text())["merge"] == merge
    r = h3kit("verify", "--comfy-home", home, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    shutil.rmtree(home, ignore_errors=True)
    assert ROOT.is_dir()
