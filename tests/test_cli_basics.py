import subprocess
import sys
from pathlib import Path

import pytest

from h3kit.cli import COMMANDS, main
from h3kit.devices import parse_device_list
from h3kit.errors import DeviceListError

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_every_command(runner):
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0
    rows = {ln.split()[0]: " ".join(ln.split()[1:]) for ln in result.output.splitlines()
            if ln.startswith("  ") and ln.split() and ln.split()[0] in COMMANDS}
    assert sorted(rows) == sorted(COMMANDS)
    for name, (_, _, summary) in COMMANDS.items():
        assert summary.startswith(rows[name]), (name, rows[name])


def test_every_registered_command_resolves_and_has_help(runner):
    for name in COMMANDS:
        result = runner.invoke(main, [name, "--help"])
        assert result.exit_code == 0, (name, result.output)
        assert "Usage: " in result.output and name in result.output


HEAVY = ('torch', 'git', 'numpy', 'websocket', 'requests', 'yaml', 'huggingface_hub')


@pytest.mark.parametrize("args", [["--help"], ["check-workflow", "--devices", "0,1,2,3", "--json",
                                               str(ROOT / "workflows" / "t2va_8steps_lora.json")]])
def test_help_and_check_workflow_import_no_heavy_module(args):
    """Both run to the end (exit 0: the shipped workflow passes its check) without importing a heavy module."""
    code = ("import sys; from h3kit.cli import main\n"
            f"try:\n    main({args!r})\n    code = 'returned'\nexcept SystemExit as e:\n    code = e.code\n"
            f"print('EXIT=' + repr(code) + ' HEAVY=' + ','.join(m for m in {HEAVY!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip().splitlines()[-1] == "EXIT=0 HEAVY=", proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("text, ids", [("0", [0]), ("0,1", [0, 1]), ("4,5,6,7", [4, 5, 6, 7]), ("1,3", [1, 3]),
                                       ("0,1,2,3,4,5,6,7", list(range(8)))])
def test_device_list_valid(text, ids):
    assert parse_device_list(text) == ids


@pytest.mark.parametrize("text, fragment", [
    ("", "empty"), ("1, 2,3", "not a non-negative integer"), ("0,0", "twice"), ("2,1", "ascending"),
    ("0,1,2", "3 devices"), ("-1", "not a non-negative"), ("0,1,2,3,4,5,6", "7 devices"), ("a", "not a"),
    ("0,,1", "not a"), ("０", "not a"),
])
def test_device_list_invalid(text, fragment):
    with pytest.raises(DeviceListError) as e:
        parse_device_list(text)
    assert fragment in e.value.message


def complete(runner, words: str) -> list[str]:
    """What click's bash completion (README, 'Shell completion') offers for `words`."""
    r = runner.invoke(main, [], prog_name="h3kit", env={"_H3KIT_COMPLETE": "bash_complete", "COMP_WORDS": words,
                                                        "COMP_CWORD": str(len(words.split(" ")) - 1)})
    assert r.exit_code == 0, r.output
    return r.output.splitlines()


def test_shell_completion_is_clicks_own_and_knows_paths(runner):
    r = runner.invoke(main, [], prog_name="h3kit", env={"_H3KIT_COMPLETE": "bash_source"})
    assert "_h3kit_completion" in r.output and "complete " in r.output
    assert complete(runner, "h3kit ins") == ["plain,install"]
    assert complete(runner, "h3kit patches st") == ["plain,status"]
    assert {"plain,npu", "plain,cpu"} <= set(complete(runner, "h3kit start --device-type "))
    # paths are click.Path: the shell completes folders or files for them
    assert complete(runner, "h3kit install --models-dir ") == ["dir,"]
    assert complete(runner, "h3kit install --python ") == ["file,"]
    assert complete(runner, "h3kit check-workflow ") == ["file,"]


def test_top_level_help_points_a_new_user_at_demo(runner):
    out = runner.invoke(main, ["--help"]).output
    assert "New here? `h3kit demo --comfy-home DIR`" in out


@pytest.mark.parametrize("typed, suggested", [("stauts", "'status'"), ("restrat", "'restart'"),
                                               ("chec", "'check-workflow'"), ("instal", "'install'")])
def test_a_mistyped_command_gets_a_did_you_mean(runner, typed, suggested):
    r = runner.invoke(main, [typed])
    assert r.exit_code == 2 and f"No such command '{typed}'. Did you mean {suggested}" in r.output


def test_an_unknown_command_with_nothing_close_gets_no_guess(runner):
    r = runner.invoke(main, ["xyzzy"])
    assert r.exit_code == 2 and "No such command 'xyzzy'." in r.output and "Did you mean" not in r.output
