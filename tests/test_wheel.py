"""h3kit as people install it: a wheel built from this checkout, installed into a fresh virtual environment
outside the checkout, with no PYTHONPATH or H3KIT_ROOT pointing back at it. It must carry its own data
(patches, shipped files, workflows, launch scripts, the manifest) and run install, verify and check-workflow
from there. Needs pip to reach the package index (setuptools and wheel to build; click, psutil, PyYAML,
websocket-client, packaging to install), as the rest of the environment does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PIN
from tests.support import jsondoc

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(cmd, cwd, timeout=600, env=None):
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """(the venv's h3kit command, the environment to run it with, a folder outside the checkout)."""
    base = tmp_path_factory.mktemp("wheel")
    # nothing may lead back to the checkout: with PYTHONPATH=toolkit, pip would even take the checkout's
    # h3kit.egg-info (from an editable install) for an installed h3kit and skip the wheel
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "H3KIT_ROOT", "H3KIT_COMFY_HOME")}
    src = base / "src"  # the checkout's files as git sees them (committed or not, ignored ones left out)
    files = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], ROOT).stdout.split("\0")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", base / "dist", src], base, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (wheel,) = (base / "dist").glob("h3kit-*.whl")
    venv = base / "venv"
    r = _run([sys.executable, "-m", "venv", venv], base, env=env)
    assert r.returncode == 0, r.stderr
    r = _run([venv / "bin" / "python", "-m", "pip", "install", "-q", wheel], base, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    work = base / "work"
    work.mkdir()
    return venv / "bin" / "h3kit", env, work


def test_the_wheel_carries_its_data_and_reads_it_from_the_package(wheel_env):
    h3kit, env, work = wheel_env
    r = _run([h3kit, "--help"], work, env=env)
    assert r.returncode == 0 and "h3kit demo --comfy-home DIR" in r.stdout
    where = _run([h3kit.parent / "python", "-c", "import h3kit.paths as p; print(p.repo_root())"], work, env=env)
    root = Path(where.stdout.strip())
    assert root.parts[-2:] == ("h3kit", "_data") and "site-packages" in root.parts, where.stdout + where.stderr
    for name in ("patches/series", "additional_files/extra_model_paths.h3kit.yaml.example",
                 "workflows/api/demo_t2va_tiny.json", "workflows/models/manifest.json", "launch/start-4npu.sh",
                 "launch/h3kit-watch.service", "source_deps_info.json"):
        assert (root / name).is_file(), name
    assert os.access(root / "launch" / "start-4npu.sh", os.X_OK)
    # the docs that help texts and fixes cite, and the licence the metadata names, travel with the wheel
    for name in ("docs/service.md", "docs/deployment.md", "README.md", "LICENSE"):
        assert (root / name).is_file(), name
    assert f"{root / 'docs'}" in r.stdout  # --help names where they are
    (dist_info,) = root.parents[1].glob("h3kit-*.dist-info")
    meta = (dist_info / "METADATA").read_text()
    assert "Provides-Extra: plot" in meta and "matplotlib" in meta and "1, 2, 4 or 8 Ascend NPUs" in meta
    assert any(p.name == "LICENSE" for p in dist_info.rglob("LICENSE")), "no LICENSE in the .dist-info"
    r = _run([h3kit, "patches", "check", "--json"], work, env=env)
    assert jsondoc.data(r.stdout, r.returncode)["problems"] == [], r.stderr
    r = _run([h3kit, "check-workflow", "--devices", "0,1,2,3", "--json", *sorted((root / "workflows").glob("*.json"))],
             work, env=env)
    assert jsondoc.data(r.stdout, r.returncode)["summary"]["errors"] == 0, r.stdout
    # the series is maintained in a checkout, never in site-packages
    r = _run([h3kit, "patches", "refresh"], work, env=env)
    assert r.returncode == 1 and "error [not_a_checkout]" in r.stderr, r.stderr


def test_install_verify_and_check_workflow_from_the_wheel(wheel_env, comfy_source, tmp_path):
    h3kit, env, work = wheel_env
    home = tmp_path / "ComfyUI"
    r = _run([h3kit, "install", "--comfy-home", home, "--source", comfy_source, "--python", h3kit.parent / "python",
              "--json"], work, env=env)
    rep = jsondoc.data(r.stdout, r.returncode)
    assert rep["pin"] == PIN and rep["cloned"] and all(p["state"] == "apply" for p in rep["patches"]), r.stderr
    assert "extra_model_paths.h3kit.yaml.example" in rep["files"]["installed"]
    assert (home / ".h3kit" / "run" / "start-4npu.sh").is_file()
    state = json.loads((home / ".h3kit" / "state.json").read_text())
    assert state["h3kit_root"].endswith("h3kit/_data") and "websocket-client==" in " ".join(state["python_packages"])
    r = _run([h3kit, "verify", "--comfy-home", home, "--json"], work, env=env)
    assert jsondoc.data(r.stdout, r.returncode)["problems"] == [] and r.returncode == 0, r.stdout + r.stderr
    shipped = sorted((home / "user" / "default" / "workflows" / "h3kit").glob("*.json"))
    assert len(shipped) == 3
    r = _run([h3kit, "check-workflow", "--devices", "0,1,2,3", "--json", *shipped], work, env=env)
    assert r.returncode == 0, r.stdout


def test_workers_get_h3kit_alone_on_their_path(wheel_env):
    """The parity and calibration workers run in ComfyUI's interpreter with h3kit on PYTHONPATH
    (runtime/worker.py). From a wheel that must be h3kit alone, not the site-packages it sits in (click,
    psutil, PyYAML... at h3kit's versions, ahead of ComfyUI's own): paths.import_root() is a private folder
    holding one link to the package. Checked with the checkout's interpreter, which has click too: it must
    import click from its own environment, and h3kit from the wheel's."""
    h3kit, env, work = wheel_env
    r = _run([h3kit.parent / "python", "-c", "import h3kit.paths as p; print(p.import_root()); print(p.package_dir())"],
             work, env=env)
    root, package = map(Path, r.stdout.split())
    assert sorted(e.name for e in root.iterdir()) == ["h3kit"] and (root / "h3kit").resolve() == package, r.stderr
    probe = "import click, h3kit; print(click.__file__); print(h3kit.__file__)"
    r = _run([sys.executable, "-c", probe], work, env=dict(env, PYTHONPATH=str(root)))
    click_file, h3kit_file = map(Path, r.stdout.split())
    assert h3kit_file.resolve().parent == package, r.stdout + r.stderr
    assert package.parent not in click_file.parents, f"click came from the wheel's site-packages: {click_file}"


def test_a_checkouts_import_root_is_its_toolkit_folder():
    from h3kit import paths
    assert paths.import_root() == ROOT / "toolkit"
