"""The group contract is written twice, once per interpreter: toolkit/h3kit/group.py (h3kit's, which writes the
environment a server or agent starts with) and patches/src/comfy/multinpu_wire.py with multinpu_links.py (ComfyUI's, which read it; it
imports torch, so h3kit never imports it). This test reads the second without importing it and fails when the two
differ: environment names, the ranks file, the channel's port offset, the join
timeout, the modules a host runs, and the fields of the JSON h3kit writes."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from h3kit import group

ROOT = Path(__file__).resolve().parents[1]
WIRE = ROOT / "patches" / "src" / "comfy" / "multinpu_wire.py"
LINKS = ROOT / "patches" / "src" / "comfy" / "multinpu_links.py"  # the HCCL constants live beside their helpers
SAME = ("GROUP_ENV", "KEY_ENV", "RANKS_FILE", "WORKER_MODULE", "CHANNEL_PORT_OFFSET", "DEFAULT_JOIN_TIMEOUT",
        "HCCL_PORT_ENV", "HCCL_PORT_START", "HCCL_PORTS", "HCCL_PORT_SLOTS")


def _constants(tree) -> dict:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out


def _group_spec(tree) -> tuple:
    """(GroupSpec.FIELDS, {argument: default source} of GroupSpec.__init__)."""
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GroupSpec")
    fields = next(ast.literal_eval(n.value) for n in cls.body
                  if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "FIELDS")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args.args[-len(init.args.defaults):]
    return fields, {a.arg: ast.unparse(d) for a, d in zip(args, init.args.defaults)}


@pytest.fixture(scope="module")
def wire():
    tree = ast.parse(WIRE.read_text())
    fields, defaults = _group_spec(tree)
    constants = {**_constants(ast.parse(LINKS.read_text())), **_constants(tree)}
    return {"constants": constants, "fields": fields, "defaults": defaults}


@pytest.mark.parametrize("name", SAME)
def test_both_sides_agree(wire, name):
    assert wire["constants"][name] == getattr(group, name), f"{name} differs between group.py and multinpu_wire.py / multinpu_links.py"


def test_the_defaults_agree(wire):
    # a GroupSpec built without a join timeout gets the one `h3kit start` defaults to
    assert wire["defaults"]["join_timeout"] == "DEFAULT_JOIN_TIMEOUT"


def test_what_h3kit_writes_is_what_the_runtime_reads(wire, tmp_path):
    settings = group.resolve("cpu", transport="process")
    env = group.environment(settings, "cpu", [0, 1], tmp_path, "0" * 64, ["--cpu"])
    spec = json.loads(env[wire["constants"]["GROUP_ENV"]])
    assert set(spec) <= set(wire["fields"]), sorted(set(spec) - set(wire["fields"]))
    assert wire["constants"]["KEY_ENV"] in env
    # each server's HCCL band (issue 46): a start the runtime accepts, for every device of a 16-device host
    assert int(env[wire["constants"]["HCCL_PORT_ENV"]]) == wire["constants"]["HCCL_PORT_START"]
    for device in range(16):
        band = group.hccl_band([device])
        assert 1024 <= band <= 65535 - wire["constants"]["HCCL_PORTS"] * wire["constants"]["HCCL_PORT_SLOTS"], device


def test_the_modules_a_host_runs_exist():
    src = ROOT / "patches" / "src"
    assert (src / (group.WORKER_MODULE.replace(".", "/") + ".py")).is_file()
    # the fork server the launcher starts on the CPU: status accepts a worker whose command line is its
    zygote = (src / (group.ZYGOTE_MODULE.replace(".", "/") + ".py"))
    assert zygote.is_file() and "[sys.executable, \"-B\", \"-m\", __name__" in zygote.read_text()
    agent = ast.parse((src / (group.AGENT_MODULE.replace(".", "/") + ".py")).read_text())
    main = [n for n in agent.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert main and "agent_main()" in ast.unparse(main[0]), f"{group.AGENT_MODULE} does not run the agent"


def test_every_field_h3kit_writes_is_read_by_the_runtime(tmp_path):
    """Issue 40: a field of H3KIT_GROUP that no runtime module reads (`spec.<field>`) is a promise nobody keeps;
    GroupSpec.devices was one (the ranks find their device by local rank, through the visible-device variable)."""
    settings = group.resolve("cpu", transport="process")
    env = group.environment(settings, "cpu", [0, 1], tmp_path, "0" * 64, ["--cpu"])
    written = set(json.loads(env[group.GROUP_ENV]))
    runtime = "\n".join(p.read_text() for p in (ROOT / "patches" / "src").rglob("*.py"))
    unread = sorted(f for f in written if not re.search(rf"spec\.{f}\b", runtime))
    assert unread == [], unread
