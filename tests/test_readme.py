"""The README a newcomer reads (issue 31): it names every runtime dependency of the wheel exactly as setup.cfg
declares them, keeps the two commands CI and new users run, and stays short enough to read in five minutes."""

from __future__ import annotations

import configparser
import re

from tests.conftest import ROOT

README = ROOT / "README.md"
MARKER = "<!-- dependencies: setup.cfg install_requires, checked by tests/test_readme.py -->"


def install_requires() -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return [line.strip() for line in cfg["options"]["install_requires"].splitlines()
            if line.strip() and not line.strip().startswith("#")]


def readme_dependencies() -> list[str]:
    lines = README.read_text().splitlines()
    assert MARKER in lines, "the README's dependency list lost its marker"
    out = []
    for line in lines[lines.index(MARKER) + 1:]:
        m = re.fullmatch(r"- `([^`]+)`", line.strip())
        if not m:
            break
        out.append(m.group(1))
    return out


def test_the_readme_names_every_runtime_dependency_of_the_wheel():
    assert readme_dependencies() == install_requires()


def test_the_readme_keeps_the_two_commands_and_stays_short():
    text = README.read_text()
    assert "make demo" in text and "\nmake test\n" in text  # .ci/run runs the README's test command
    assert len(text.splitlines()) <= 300
