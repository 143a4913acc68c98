"""Failures a rank reports itself are no crash loop (issue 45, item 7): seven OOM commands in a row (well inside the
crash window of CRASH_LIMIT deaths in CRASH_WINDOW s) on the same rank leave every rank replaceable, and the command
after them is served. A rank that dies without a word (SIGKILL, a segfault) is still counted
(tests/test_multinpu_launch_units.py)."""

from __future__ import annotations

import pytest

from tests.support import requires

torch = requires.torch_module()
from tests.test_multinpu_process import _env, drive  # noqa: E402

import comfy.multinpu_wire as wire  # noqa: E402

pytestmark = pytest.mark.slow

OOMS = wire.CRASH_LIMIT + 2  # more than the crash loop's limit of deaths


def test_reported_ooms_are_no_crash_loop(tmp_path):
    r = drive(tmp_path, "oom_loop", "--world", 2, "--victim", 1, "--repeat", OOMS, env=_env(H3KIT_EMULATE_NO_RELEASE="1"), timeout=600)
    assert len(r["ooms"]) == OOMS
    for oom in r["ooms"]:
        assert not oom["ok"] and oom["error"]["type"] == "OutOfMemoryError", oom
    assert r["next"]["ok"] and r["next"]["value"] == [1.0] * 4, r["next"]
    # the OOMs fall inside one crash window (about 15 s here), or the test would prove nothing about the crash loop
    assert sum(oom["seconds"] for oom in r["ooms"]) < wire.CRASH_WINDOW
    assert all(rank["alive"] and not rank.get("failed") for rank in r["ranks"]), r["ranks"]
    assert r["generation"] >= OOMS + 1, "each OOM replaced the group (a fresh process per rank)"
