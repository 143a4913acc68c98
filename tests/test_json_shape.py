"""Every command that takes --json prints one document of one shape (h3kit.cliutil), whether it succeeds, fails
or is called wrongly: {"schema": "h3kit/1", "command", "ok", "data" | "error": {"code", "message", "fix"}},
"ok" true exactly when the exit code is 0, nothing else on stdout.

The table below names, per command, a run that succeeds, one that fails and one that click refuses. A command
that gains --json without a row here fails test_every_json_command_has_a_case. The succeeding runs of demo,
bench, parity and calibrate need the real pinned ComfyUI and minutes: their documents are checked the same way
(tests/support/jsondoc.py, with the exit code) in test_demo.py, test_parity_dit.py, test_parity_te_vae.py,
test_int8.py and test_calibrate.py.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from h3kit.cli import COMMANDS, main
from tests.support import jsondoc
from tests.support.fakekit import A_PY, git, kit, refreshed, upstream  # noqa: F401
from tests.support.service_helpers import StandinHome, free_port, h3kit, kill_started_under

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_WF = ROOT / "workflows" / "t2va_8steps_lora.json"
ELSEWHERE = ("demo", "bench", "parity", "calibrate")  # success checked in the real-upstream tests


def json_commands() -> list[str]:
    """Every command (and group subcommand) whose options include --json."""
    import click

    names = []
    for name in COMMANDS:
        cmd = main.get_command(None, name)
        subs = cmd.commands.items() if isinstance(cmd, click.Group) else [(None, cmd)]
        for sub, c in subs:
            if any(p.name == "as_json" for p in c.params):
                names.append(f"{name} {sub}" if sub else name)
    return names


def invoke(runner, *args):
    r = runner.invoke(main, [str(a) for a in args], catch_exceptions=False)
    return r.exit_code, r.stdout, r.stderr


def check(command: str, rc: int, stdout: str, kind: str) -> dict:
    """kind: "ok" (exit 0, data), "fail" (exit 1 or 2: data with ok false, or an error), "usage" (exit 2,
    an error from click's own checks)."""
    doc = jsondoc.document(stdout, rc)
    assert doc["command"] == command, (command, doc)
    if kind == "ok":
        assert rc == 0 and "data" in doc, doc
    elif kind == "fail":
        assert rc in (1, 2), (rc, doc)
    else:
        assert rc == 2 and doc["error"]["code"] == "usage" and doc["error"]["fix"].startswith("see h3kit"), doc
    return doc


@pytest.fixture
def installed_fake(refreshed, upstream, runner, tmp_path):
    up, _ = upstream
    home = tmp_path / "ComfyUI"
    rc, out, err = invoke(runner, "install", "--comfy-home", home, "--source", up, "--python", sys.executable, "--json")
    check("install", rc, out, "ok")
    return home, up


def test_every_json_command_has_a_case():
    assert sorted(json_commands()) == sorted(CASES), "add the command to CASES (and its runs below)"


# command: (a failing run, a run click refuses); paths are relative to a scratch folder
CASES = {
    "install": (["install", "--comfy-home", "home", "--source", "no-such-mirror", "--json"], ["install", "--json"]),
    "verify": (["verify", "--comfy-home", "empty", "--json"], ["verify", "--json", "--bogus"]),
    "revert": (["revert", "--comfy-home", "empty", "--json"], ["revert", "--json"]),
    "patches check": (None, ["patches", "check", "--json", "--bogus"]),
    "patches status": (["patches", "status", "--comfy-home", "empty", "--json"], ["patches", "status", "--json"]),
    "patches rebase": (["patches", "rebase", "--onto", "master", "--source", "no-such-mirror", "--out", "o", "--json"],
                       ["patches", "rebase", "--json"]),
    "check-workflow": (["check-workflow", "missing.json", "--json"], ["check-workflow", "--json"]),
    "models list": (["models", "list", "missing.json", "--json"], ["models", "list", "--json"]),
    "models fetch": (["models", "fetch", "wf.json", "--comfy-home", "empty", "--json"],
                     ["models", "fetch", "wf.json", "--json"]),
    "plan": (["plan", "--width", "1000", "--height", "768", "--frames", "121", "--npu-count", "1", "--json"],
             ["plan", "--width", "1344", "--json"]),
    "doctor": (["doctor", "--devices", "0,0", "--json"], ["doctor", "--device-type", "tpu", "--json"]),
    "start": (["start", "--comfy-home", "empty", "--devices", "0,0", "--json"], ["start", "--comfy-home", "empty", "--json"]),
    "stop": (["stop", "--runtime-root", "a-file", "--json"], ["stop", "--grace", "-1", "--json"]),
    "restart": (["restart", "--comfy-home", "empty", "--json"], ["restart", "--grace", "soon", "--json"]),
    "status": (["status", "--comfy-home", "empty", "--json"], ["status", "--json", "extra"]),
    "watch": (["watch", "--comfy-home", "empty", "--json"], ["watch", "--interval", "0", "--json"]),
    "demo": (["demo", "--comfy-home", "a-file", "--json"], ["demo", "--comfy-home", "empty", "--npu-count", "3", "--json"]),
    "bench": (["bench", "wf.json", "--comfy-home", "empty", "--json"], ["bench", "--json"]),
    "parity": (["parity", "--comfy-home", "empty", "--device-type", "cpu", "--npu-count", "2", "--json"],
               ["parity", "--comfy-home", "empty", "--json"]),
    "calibrate": (["calibrate", "--comfy-home", "empty", "--device-type", "cpu", "--npu-count", "2", "--json"],
                  ["calibrate", "--comfy-home", "empty", "--json"]),
}


def test_failures_and_usage_errors_of_every_command(runner, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("H3KIT_COMFY_HOME", raising=False)
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("not a folder\n")
    (tmp_path / "wf.json").write_text(json.dumps({"1": {"class_type": "EmptyImage", "inputs": {}}}))
    for command, (fail, usage) in CASES.items():
        if fail is not None:
            rc, out, err = invoke(runner, *fail)
            doc = check(command, rc, out, "fail")
            assert "Traceback" not in err, (command, err)
            if "error" in doc:  # the same words on stderr, for people
                assert f"error [{doc['error']['code']}]" in err, (command, err)
        rc, out, err = invoke(runner, *usage)
        check(command, rc, out, "usage")
        assert "Usage:" in err and "Error:" in err, (command, err)  # click's own message stays on stderr
        # without --json a usage error prints nothing on stdout
        plain = [a for a in usage if a != "--json"]
        rc2, out2, _ = invoke(runner, *plain)
        assert rc2 == 2 and out2 == "", (command, out2)


def test_unknown_command_with_json(runner):
    rc, out, err = invoke(runner, "no-such-command", "--json")
    doc = jsondoc.document(out, rc)
    assert rc == 2 and doc["command"] is None and "No such command" in doc["error"]["message"]
    # --json after `--` belongs to ComfyUI's arguments, not to h3kit
    rc, out, err = invoke(runner, "start", "--comfy-home", "x", "--", "--json")
    assert rc == 2 and out == "" and "Missing option '--devices'" in err


def test_install_verify_revert_and_patches_succeed_and_judge(installed_fake, runner):
    home, up = installed_fake
    check("verify", *invoke(runner, "verify", "--comfy-home", home, "--json")[:2], "ok")
    doc = check("patches status", *invoke(runner, "patches", "status", "--comfy-home", home, "--json")[:2], "ok")
    assert {p["state"] for p in doc["data"]["patches"]} == {"applied"}
    doc = check("patches check", *invoke(runner, "patches", "check", "--json")[:2], "ok")
    assert doc["data"]["problems"] == [] and "ok" not in doc["data"]  # "ok" lives at the top level only
    # a negative verdict is data with ok false, exit 1: verify of an edited patched file
    (home / "comfy" / "a.py").write_text(A_PY + "# edited\n")
    rc, out, _ = invoke(runner, "verify", "--comfy-home", home, "--json")
    doc = check("verify", rc, out, "fail")
    assert rc == 1 and doc["ok"] is False and any("comfy/a.py" in p for p in doc["data"]["problems"])
    rc, out, _ = invoke(runner, "revert", "--comfy-home", home, "--force", "--json")
    check("revert", rc, out, "ok")


def test_check_workflow_plan_and_doctor_succeed(runner, tmp_path):
    check("check-workflow", *invoke(runner, "check-workflow", SHIPPED_WF, "--devices", "0,1,2,3", "--json")[:2], "ok")
    doc = check("models list", *invoke(runner, "models", "list", SHIPPED_WF, "--json")[:2], "ok")
    assert len(doc["data"]["files"]) == 5  # models fetch succeeding: tests/test_models_fetch.py
    doc = check("plan", *invoke(runner, "plan", "--width", "1344", "--height", "768", "--frames", "121",
                                "--npu-count", "2", "--json")[:2], "ok")
    assert doc["data"]["plans"][0]["npu_count"] == 2
    # doctor judges this host: exit 0 or 1 by what it finds, the document says the same
    rc, out, _ = invoke(runner, "doctor", "--device-type", "cpu", "--devices", "0", "--json")
    doc = jsondoc.document(out, rc)
    assert doc["command"] == "doctor" and "data" in doc and doc["data"]["findings"]


def test_service_commands_succeed(tmp_path):
    home = StandinHome(tmp_path / "home", free_port(8640, 8660))
    try:
        r = home.start("--json")
        doc = check("start", r.returncode, r.stdout, "ok")
        assert doc["data"]["pid"] > 0
        r = home.run("status", "--json")
        check("status", r.returncode, r.stdout, "ok")
        r = home.run("restart", "--json")
        check("restart", r.returncode, r.stdout, "ok")
        r = home.run("watch", "--interval", "0.1", "--max-seconds", "0.5", "--json")
        check("watch", r.returncode, r.stdout, "ok")
        r = home.run("stop", "--json")
        check("stop", r.returncode, r.stdout, "ok")
        r = home.run("status", "--json")  # not running: a verdict (exit 1), not an error
        doc = check("status", r.returncode, r.stdout, "fail")
        assert r.returncode == 1 and doc["data"]["running"] is False
    finally:
        h3kit("stop", "--comfy-home", home.path, "--runtime-root", home.root)
        kill_started_under(home.path)
        shutil.rmtree(home.path, ignore_errors=True)
