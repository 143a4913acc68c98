"""install's small decisions without a clone: which interpreter a run records, and that it never bolts state
onto the options object."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from h3kit import install, manifest
from h3kit.gitutil import GitError


def test_a_rerun_keeps_the_recorded_interpreter_unless_python_is_given(tmp_path):
    opts = install.InstallOptions(comfy_home=tmp_path)
    assert install._interpreter(opts) == sys.executable  # nothing recorded yet: the one running h3kit
    install.state_path(tmp_path).parent.mkdir(parents=True)
    install.state_path(tmp_path).write_text(json.dumps({"python": "/opt/comfy/bin/python"}))
    assert install._interpreter(opts) == "/opt/comfy/bin/python"  # not h3kit's own (which may lack torch)
    given = install.InstallOptions(comfy_home=tmp_path, python="/usr/bin/python3.12")
    assert install._interpreter(given) == "/usr/bin/python3.12"
    assert install._interpreter(install.InstallOptions(comfy_home=tmp_path / "fresh")) == sys.executable


def test_the_target_commit_is_decided_once(tmp_path):
    data = manifest.load()
    pin = manifest.pin(data)
    assert install._target(install.InstallOptions(comfy_home=tmp_path), data) == install._Target(pin, pin)
    assert install._target(install.InstallOptions(comfy_home=tmp_path, commit=pin[:12]), data).is_pin
    other = "0123456789abcdef0123456789abcdef01234567"
    with pytest.raises(install.InstallRefused) as e:
        install._target(install.InstallOptions(comfy_home=tmp_path, commit=other), data)
    assert e.value.code == "not_the_pin"
    forced = install._target(install.InstallOptions(comfy_home=tmp_path, commit=other, force=True), data)
    assert forced.commit == other and not forced.is_pin


def test_a_failed_install_leaves_the_options_as_declared(tmp_path):
    opts = install.InstallOptions(comfy_home=tmp_path / "home", source=str(tmp_path / "no-such-mirror"))
    with pytest.raises(GitError, match="no-such-mirror does not exist") as e:
        install.install(opts)
    assert e.value.code == "no_source"
    assert set(vars(opts)) == {f.name for f in dataclasses.fields(install.InstallOptions)}
