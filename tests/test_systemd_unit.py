"""launch/h3kit-watch.service and the template launch/h3kit@.service (one instance per port, issue 46): systemd accepts
them, every h3kit command line in them is one h3kit parses, and a planned stop keeps the queue."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import click
import pytest

from h3kit.cli import main
from tests.support import requires

LAUNCH = Path(__file__).resolve().parents[1] / "launch"
UNIT = LAUNCH / "h3kit-watch.service"
TEMPLATE = LAUNCH / "h3kit@.service"
UNITS = pytest.mark.parametrize("unit", [UNIT, TEMPLATE], ids=["watch", "template"])


def unit_settings(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def _instance(unit: Path, folder: Path) -> Path:
    """The unit as systemd reads it: the template as its instance h3kit@8190.service."""
    path = folder / unit.name.replace("@.", "@8190.")
    path.write_text(unit.read_text())
    return path


@UNITS
def test_systemd_analyze_verify_accepts_the_unit(tmp_path, unit):
    if shutil.which("systemd-analyze") is None:
        requires.skip("systemd-analyze is not installed here (Debian: apt-get install systemd)")
    path = _instance(unit, tmp_path)
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert r.returncode == 0 and path.name not in r.stdout + r.stderr, r.stdout + r.stderr
    # and it is not a check that passes anything: a mistyped key and a missing binary are both reported
    bad = tmp_path / unit.name.replace("h3kit", "h3kit-bad").replace("@.", "@8190.")
    text = unit.read_text()
    assert "ExecStop=/usr/bin/env h3kit stop" in text
    bad.write_text(text.replace("TimeoutStopSec", "TimeoutStopSek")
                   .replace("ExecStop=/usr/bin/env h3kit stop", "ExecStop=/no/such/h3kit stop"))
    r = subprocess.run(["systemd-analyze", "verify", str(bad)], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert "TimeoutStopSek" in r.stderr and "/no/such/h3kit" in r.stderr and r.returncode != 0


@UNITS
def test_every_h3kit_command_line_in_the_unit_parses(unit):
    settings = unit_settings(unit.read_text())
    defaults = dict(pair.split("=", 1) for pair in shlex.split(settings["Environment"][0]))
    defaults.setdefault("NPU_DEVICES", "4,5,6,7")  # the template's come from /etc/h3kit/<port>.env
    lines = [v.replace("%i", "8190") for k in ("ExecStartPre", "ExecStart", "ExecStop") for v in settings[k]]
    assert len(lines) == 3
    port = "8190" if unit == TEMPLATE else defaults["COMFYUI_PORT"]
    for line in lines:
        argv = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], line))
        assert argv[:2] == ["/usr/bin/env", "h3kit"], argv
        with main.make_context("h3kit", argv[2:], resilient_parsing=False) as ctx:
            sub = main.get_command(ctx, argv[2])
            # the unit's environment gives --comfy-home (H3KIT_COMFY_HOME): parse as systemd would run it
            sub_ctx = sub.make_context(argv[2], argv[3:] + ["--comfy-home", "/srv/ComfyUI"])
            assert sub_ctx.params["comfy_home"] == "/srv/ComfyUI"
            # every command names the instance's server: the tree may run several
            assert sub_ctx.params["port"] == int(port), line
            if argv[2] == "stop":  # a planned stop (systemctl stop, restart, reboot) loses no prompt
                assert sub_ctx.params["keep_queue"] is True, line
    with pytest.raises(click.UsageError):  # a mistyped option would be caught here
        main.get_command(None, "start").make_context("start", ["--devices", "0", "--devcie-type", "npu"])


@UNITS
def test_the_unit_runs_as_its_own_account_and_is_hardened(tmp_path, unit):
    settings = unit_settings(unit.read_text())
    assert settings["User"] == ["h3kit"] and settings["Group"] == ["h3kit"]  # never root
    for key, value in (("NoNewPrivileges", "yes"), ("ProtectSystem", "full"), ("ProtectHome", "yes"),
                       ("PrivateTmp", "yes"), ("CapabilityBoundingSet", ""), ("ProtectKernelTunables", "yes"),
                       ("ProtectControlGroups", "yes"), ("RestrictSUIDSGID", "yes"), ("UMask", "0027")):
        assert settings.get(key) == [value], key
    if shutil.which("systemd-analyze") is None:
        requires.skip("systemd-analyze is not installed here (Debian: apt-get install systemd)")
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", str(_instance(unit, tmp_path))],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    if "--offline" in r.stderr and r.returncode != 0:
        requires.skip(f"this systemd-analyze cannot judge a unit file offline (systemd 250 or newer can): {r.stderr}")
    score = float(re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout).group(1))
    assert score <= 2.5, r.stdout  # README, systemd section: 2.0 OK with systemd 252 (9.6 UNSAFE before)
