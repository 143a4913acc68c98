"""The full install / verify / re-run / revert cycle against the real pinned upstream (H3KIT_COMFY_SOURCE)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import MANIFEST, PIN
from tests.support import jsondoc

ABSENT = MANIFEST["upstream"]["absent_from_mirrors"]
pytestmark = pytest.mark.upstream


def h3kit(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "h3kit", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def status(tree):
    out = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=all"],
                         capture_output=True, text=True, check=True).stdout
    return sorted(ln for ln in out.splitlines() if ln)


def test_install_verify_rerun_revert_cycle(comfy_source, comfy_python, tmp_path):
    home = tmp_path / "ComfyUI"
    r = h3kit("install", "--comfy-home", home, "--source", comfy_source, "--python", comfy_python, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = jsondoc.data(r.stdout, r.returncode)
    assert rep["cloned"] and rep["pin"] == PIN
    assert all(p["state"] == "apply" for p in rep["patches"])
    # the offline mirror lacks two blobs H3 does not use: each one the source lacks is a warning, not a failure
    lacking = [a for a in ABSENT if subprocess.run(["git", "-C", comfy_source, "cat-file", "-e", f"{PIN}:{a}"],
                                                   capture_output=True).returncode != 0]
    assert [a for a in ABSENT if a in " ".join(rep["warnings"])] == lacking
    head = subprocess.run(["git", "-C", str(home), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert head == PIN

    touched = {f["path"]: f["status"] for p in MANIFEST["patches"] for f in p["files"]}
    expected = {f" M {p}" if s == "modified" else f"?? {p}" for p, s in touched.items()}
    assert expected <= set(status(home))

    r = h3kit("verify", "--comfy-home", home)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK:" in r.stdout

    r = h3kit("install", "--comfy-home", home, "--source", comfy_source, "--python", comfy_python, "--json")
    assert r.returncode == 0
    rep = jsondoc.data(r.stdout, r.returncode)
    assert rep["changed"] == [] and all(p["state"] == "applied" for p in rep["patches"])

    # a re-run without --python keeps the interpreter the tree was installed with (here a link to it, so the
    # path differs from the one running h3kit), rather than recording h3kit's own (which may lack torch)
    link = tmp_path / "comfy-python"
    link.symlink_to(comfy_python)
    r = h3kit("install", "--comfy-home", home, "--source", comfy_source, "--python", link, "--json")
    assert r.returncode == 0 and jsondoc.data(r.stdout, r.returncode)["changed"] == [".h3kit/state.json"]
    r = h3kit("install", "--comfy-home", home, "--source", comfy_source, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert jsondoc.data(r.stdout, r.returncode)["changed"] == []
    assert json.loads((home / ".h3kit" / "state.json").read_text())["python"] == str(link)

    r = h3kit("revert", "--comfy-home", home)
    assert r.returncode == 0, r.stdout + r.stderr
    assert status(home) == sorted(f" D {a}" for a in lacking)  # clean but for the blobs the source lacks
    r = h3kit("verify", "--comfy-home", home, "--json")
    assert r.returncode == 1
    assert any("not applied" in p for p in jsondoc.data(r.stdout, r.returncode)["problems"])


def test_the_series_checks_against_the_pin(comfy_source):
    r = h3kit("patches", "check", "--source", comfy_source, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = jsondoc.data(r.stdout, r.returncode)
    assert rep["applies_to_pin"] is True and rep["problems"] == []
    assert rep["patches"][0] == "global-model-cache.patch"


def test_installed_tree_fixture_is_verified(installed_tree):
    r = h3kit("verify", "--comfy-home", installed_tree, "--json")
    assert r.returncode == 0, r.stdout
