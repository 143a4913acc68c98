"""Shared fixtures.

Tests that need the real upstream read H3KIT_COMFY_SOURCE (a git URL or a local mirror holding the pin) and
skip, with the reason shown in the summary, where it is not set. Tests that run the pinned ComfyUI need
torch in this interpreter (or H3KIT_COMFY_PYTHON) and skip likewise. Under H3KIT_REQUIRE_UPSTREAM=1 (.ci/run)
those skips are failures; in make test's torch-free runs on other Pythons (H3KIT_TORCH_FREE_RUN=1) the tests
that need torch skip by design. The rules: tests/support/requires.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support import requires, service_helpers

ROOT = Path(__file__).resolve().parents[1]
# Test this checkout's h3kit, whichever checkout the environment's editable install points at, here and in
# every subprocess the tests start (`python -m h3kit`, ComfyUI workers importing h3kit.*).
sys.path.insert(0, str(ROOT / "toolkit"))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "toolkit"), os.environ.get("PYTHONPATH")) if p)
MANIFEST = json.loads((ROOT / "source_deps_info.json").read_text())
TEST_TREE_ENV = "H3KIT_TEST_TREE"  # an installed tree the installed_tree fixture returns instead of installing the pin
PIN = MANIFEST["upstream"]["commit"]


def _git(*args, cwd=None, check=True):
    return subprocess.run(["git", *args], cwd=cwd, check=check, capture_output=True, text=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "torch: needs torch (the ComfyUI environment); skipped by design in "
                                       "make test's torch-free runs on other Pythons")


# The files that take longest, longest first (each file alone, -n 0, after the runtime IV merge, 2026-12-02; the parity
# files after their runs were shared per worker, test_parity_process.py split off, same day; from
# test_service_standin.py on, the next tier as a timed .ci/run of 2026-12-03 measured it: 20-90 s each, which ended
# the run on one worker while the others had nothing left): make
# test's xdist workers take a file at a time (--dist loadfile --no-loadscope-reorder: in this order, not by test count), so a long file is never
# the last one started while the other workers have nothing left. Files not named keep their order, after these.
LONGEST_FIRST = ("test_multinpu_process.py", "test_multinpu_process_service.py", "test_multinpu_process_faults.py",
                 "test_parity_dit.py", "test_parity_process.py", "test_multinpu_process_hang.py",
                 "test_multinpu_clock_service.py", "test_int8.py",
                 "test_h3_node_matrix.py",
                 "test_service_real.py", "test_multinpu_shm.py", "test_demo.py", "test_parity_te_vae.py",
                 "test_model_cache.py", "test_multinpu_te_vae.py", "test_probes.py", "test_tiny_models.py",
                 "test_multinpu_node.py", "test_service_standin.py", "test_front.py", "test_patch_engine.py",
                 "test_patches_rebase.py",
                 "test_crash_safety.py", "test_patches_rebase_upstream.py", "test_multinpu_collectives.py",
                 "test_hostile_inputs.py", "test_multinpu_status.py", "test_front_postgres.py")


def pytest_collection_modifyitems(config, items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: each file keeps its own order


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    # free_port holds a port reserved by a module- or session-scoped fixture until the process ends
    service_helpers.FIXTURE_SCOPES.append(fixturedef.scope)
    try:
        yield
    finally:
        service_helpers.FIXTURE_SCOPES.pop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    service_helpers.release_test_ports()  # after the test's fixtures stopped what used them


def pytest_runtest_setup(item):
    # before any fixture runs: a test that needs torch gets one verdict, whichever fixture would have noticed
    if not requires.HAVE_TORCH and requires.needs_torch(item):
        requires.missing_torch()


@pytest.fixture
def runner():
    return CliRunner()


@pytest.fixture(scope="session")
def comfy_source():
    """Where the pinned upstream comes from; skips when H3KIT_COMFY_SOURCE is unset."""
    source = os.environ.get("H3KIT_COMFY_SOURCE")
    if not source:
        requires.skip_or_fail("H3KIT_COMFY_SOURCE is not set: point it at a mirror holding the ComfyUI pin "
                              f"{PIN[:12]} (README, 'Tests': git clone --mirror https://github.com/kat3ri/ComfyUI.git) "
                              "to run the upstream tests")
    if Path(source).exists():
        probe = _git("--git-dir" if (Path(source) / "objects").is_dir() else "-C", source,
                     "cat-file", "-e", f"{PIN}^{{commit}}", check=False)
        if probe.returncode != 0:
            pytest.fail(f"H3KIT_COMFY_SOURCE={source} does not hold the pin {PIN}")
    return source


@pytest.fixture(scope="session")
def comfy_python():
    """The interpreter that runs the pinned ComfyUI (needs torch)."""
    py = os.environ.get("H3KIT_COMFY_PYTHON")
    if py:
        return py
    if not requires.HAVE_TORCH:
        requires.missing_torch()
    return sys.executable


@pytest.fixture(scope="session")
def pin_tree(tmp_path_factory, comfy_source):
    """A plain, unpatched checkout of the pin (session-wide, read-only by convention)."""
    dest = tmp_path_factory.mktemp("pin") / "ComfyUI"
    _git("clone", "-q", "--no-checkout", comfy_source, str(dest))
    # the offline mirror lacks two large blobs H3 does not use: checkout reports them and still succeeds
    _git("-C", str(dest), "checkout", "-q", "--detach", PIN, check=False)
    head = _git("-C", str(dest), "rev-parse", "HEAD").stdout.strip()
    assert head == PIN
    return dest


@pytest.fixture(scope="session")
def templates_dir():
    """Upstream workflow templates (comfyui-workflow-templates-json, pinned in tools/ensure-venv.sh)."""
    env = os.environ.get("H3KIT_TEMPLATES_DIR")
    cache = Path(os.environ.get("H3KIT_CACHE") or Path.home() / ".cache" / "h3kit")
    candidates = [Path(env)] if env else sorted(cache.glob("testdata/workflow-templates-json-*"))
    for base in reversed(candidates):
        d = base / "comfyui_workflow_templates_json" / "templates"
        if d.is_dir():
            return d
    requires.skip_or_fail("upstream workflow templates not installed: run tools/ensure-venv.sh (make test does)")


@pytest.fixture(scope="session")
def installed_tree(tmp_path_factory, comfy_source, comfy_python):
    """The pinned ComfyUI after `h3kit install` (patches applied, files shipped); session-wide, read-only by
    convention: tests that run it give the server their own model, output and user folders."""
    if os.environ.get(TEST_TREE_ENV):  # tools/follow_upstream.py: a tree installed at another commit
        return Path(os.environ[TEST_TREE_ENV])
    dest = tmp_path_factory.mktemp("installed") / "ComfyUI"
    proc = subprocess.run([sys.executable, "-m", "h3kit", "install", "--comfy-home", str(dest),
                           "--source", comfy_source, "--python", comfy_python, "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dest


@pytest.fixture(scope="session")
def tiny_tree(tmp_path_factory, installed_tree, comfy_python):
    """installed_tree with the demo's tiny H3 checkpoints under models/, written once per test process; read-only by
    convention: a test that runs a server copies it (service_helpers.copy_tree) instead of writing them again."""
    from h3kit import demo
    dest = service_helpers.copy_tree(installed_tree, tmp_path_factory.mktemp("tiny_tree") / "ComfyUI")
    demo.write_tiny_checkpoints(dest, comfy_python)
    return dest


@pytest.fixture(scope="session")
def tiny_av_models(tmp_path_factory, installed_tree, comfy_python):
    """The four tiny H3 checkpoints (DiT, text encoder, video and audio VAE) the server-level tests load, written
    once per session: {component: path} (tests/support/av_pipeline.py)."""
    from tests.support import av_pipeline
    return av_pipeline.write_models(comfy_python, installed_tree, tmp_path_factory.mktemp("tiny_av"))
