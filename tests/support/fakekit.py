"""A fake ComfyUI upstream and a fake h3kit checkout (H3KIT_ROOT) for the patch-engine and crash-safety tests.

The fake upstream is a small git repository standing in for ComfyUI; the fake h3kit checkout holds a
two-patch series, a new-file source under patches/src, and shipped files, so every edge case runs in
milliseconds and needs no network and no upstream mirror.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from h3kit.cli import main
from tests.support import jsondoc

REAL_ROOT = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parent
A_PY = "".join(f"line {i}\n" for i in range(1, 21))
NODES_PY = "import os\n\nNODES = ['a', 'b']\n\n\ndef load():\n    return NODES\n"

P1 = """Description: Change a.py and add new.py
 long text
Origin: vendor, h3kit
Forwarded: not-needed
Last-Update: 2026-11-30
---
diff --git a/comfy/a.py b/comfy/a.py
--- a/comfy/a.py
+++ b/comfy/a.py
@@ -4,7 +4,7 @@
 line 4
 line 5
 line 6
-line 7
+line seven
 line 8
 line 9
 line 10
"""
P2 = """Description: Change nodes.py
Origin: vendor, h3kit
Forwarded: not-needed
Last-Update: 2026-11-30
---
diff --git a/nodes.py b/nodes.py
--- a/nodes.py
+++ b/nodes.py
@@ -1,6 +1,6 @@
 import os
 
-NODES = ['a', 'b']
+NODES = ['a', 'b', 'multinpu']
 
 
 def load():
"""
NEW_PY = "def hello():\n    return 'new'\n"


def git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.rstrip("\n")


def snapshot(tree: Path) -> dict:
    """Every file under the tree (but .git) with its bytes and mtime: 'byte-identical' made checkable."""
    out = {}
    for p in sorted(tree.rglob("*")):
        if ".git" in p.relative_to(tree).parts or not p.is_file():
            continue
        out[p.relative_to(tree).as_posix()] = (p.read_bytes(), p.stat().st_mtime_ns)
    return out


@pytest.fixture
def upstream(tmp_path):
    up = tmp_path / "upstream"
    (up / "comfy").mkdir(parents=True)
    (up / "comfy" / "a.py").write_text(A_PY)
    (up / "nodes.py").write_text(NODES_PY)
    # the test stand-in as main.py, with its option table, so `h3kit start` runs on an installed fake tree
    shutil.copy(SUPPORT / "standin_server.py", up / "main.py")
    shutil.copy(SUPPORT / "standin_cli_args.py", up / "comfy" / "cli_args.py")
    git("init", "-q", "-b", "master", cwd=up)
    git("-c", "user.name=t", "-c", "user.email=t@t", "add", "-A", cwd=up)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "pin", cwd=up)
    return up, git("rev-parse", "HEAD", cwd=up)


def commit_change(up: Path, rel: str, text: str) -> str:
    (up / rel).write_text(text)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "later", cwd=up)
    return git("rev-parse", "HEAD", cwd=up)


@pytest.fixture
def kit(tmp_path, upstream, monkeypatch):
    """A fake h3kit checkout whose manifest pins the fake upstream."""
    up, pin = upstream
    root = tmp_path / "kit"
    (root / "patches" / "src" / "comfy").mkdir(parents=True)
    (root / "patches" / "p1-change-a.patch").write_text(P1)
    (root / "patches" / "p2-change-nodes.patch").write_text(P2)
    (root / "patches" / "series").write_text("# test series\np1-change-a.patch\np2-change-nodes.patch\n")
    (root / "patches" / "src" / "comfy" / "new.py").write_text(NEW_PY)
    (root / "additional_files" / "custom_nodes" / "h3kit_test").mkdir(parents=True)
    (root / "additional_files" / "custom_nodes" / "h3kit_test" / "__init__.py").write_text("NODE = 1\n")
    (root / "workflows").mkdir()
    (root / "workflows" / "w.json").write_text('{"nodes": []}\n')
    (root / "launch").mkdir()
    (root / "launch" / "start.sh").write_text("#!/bin/sh\necho start\n")
    os.chmod(root / "launch" / "start.sh", 0o755)
    data = json.loads((REAL_ROOT / "source_deps_info.json").read_text())
    data["upstream"].update(url=str(up), commit=pin)
    data["patches"] = []
    (root / "source_deps_info.json").write_text(json.dumps(data))
    monkeypatch.setenv("H3KIT_ROOT", str(root))
    monkeypatch.delenv("H3KIT_COMFY_SOURCE", raising=False)
    monkeypatch.delenv("H3KIT_COMFY_HOME", raising=False)
    return root


def h3(runner, *args):
    return runner.invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def refreshed(kit, upstream, runner):
    up, _ = upstream
    r = h3(runner, "patches", "refresh", "--source", up, "--add", "p1-change-a.patch:comfy/new.py")
    assert r.exit_code == 0, r.output
    return kit


def install(runner, home, *extra):
    return h3(runner, "install", "--comfy-home", home, "--python", sys.executable, "--json", *extra)


def payload(result):
    """The command's "data", or {"error": ...} when it could not do its work (the document's shape checked)."""
    doc = jsondoc.document(result.stdout, result.exit_code)
    return doc["data"] if "data" in doc else {"error": doc["error"]}


