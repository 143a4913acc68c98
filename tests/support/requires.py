"""What a test needs that a checkout may lack, and what happens when it is missing (test support).

Three things can be missing: the pinned upstream (H3KIT_COMFY_SOURCE, a mirror holding the pin), torch (the
ComfyUI environment of tools/ensure-venv.sh) and the upstream workflow templates. By default a test that
needs one skips with the reason and the fix: a developer without a mirror still runs everything else.

- H3KIT_REQUIRE_UPSTREAM=1 (set by .ci/run) turns those skips into failures with the same how-to: CI must
  not go green on a checkout where the upstream tests could not run.
- H3KIT_TORCH_FREE_RUN=1 (set by make test for its runs on the other supported Pythons, whose small
  environments have the toolkit's dependencies and no torch) skips the tests that need torch by design,
  with that reason; everything else, upstream tests included, runs there as in the main run.

Every skip of the suite goes through skip() here (tests/test_test_policy.py keeps pytest.skip, skipif,
mark.skip and importorskip out of every other file). A skip is one of two kinds:
- a missing prerequisite (the source, torch in the main run, a tool such as systemd-analyze or setpriv, a
  second interpreter): skip(reason) skips with the reason and its fix, and fails under H3KIT_REQUIRE_UPSTREAM=1;
- a skip by design, where the test cannot mean anything in this run and another run covers it (torch in the
  torch-free runs, a Linux-only behaviour elsewhere): skip(reason, by_design=True), which skips everywhere and
  says "by design" in the summary.
A module a test imports (torch, comfy_kitchen) is asked for with module(name, reason), never with
pytest.importorskip, which skips whatever H3KIT_REQUIRE_UPSTREAM says.

A test needs torch when it is marked `torch` (module-level: `torch = requires.torch_module()`) or uses a
fixture that runs the pinned ComfyUI (TORCH_FIXTURES); tests/conftest.py applies the rule per test.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRE_UPSTREAM = os.environ.get("H3KIT_REQUIRE_UPSTREAM") == "1"
TORCH_FREE_RUN = os.environ.get("H3KIT_TORCH_FREE_RUN") == "1"
HAVE_TORCH = importlib.util.find_spec("torch") is not None
# fixtures (conftest.py) that run the pinned ComfyUI, hence need torch in the test's interpreter
TORCH_FIXTURES = frozenset({"comfy_python", "installed_tree"})
TORCH_FREE_REASON = ("needs torch: this is make test's torch-free run on another Python (toolkit dependencies "
                     "only); the main run, in the ComfyUI environment, runs it")
NO_TORCH_REASON = ("torch is not installed in this interpreter: run the tests with the environment from "
                   "tools/ensure-venv.sh (make test) or set H3KIT_COMFY_PYTHON")


BY_DESIGN = "by design: "          # how a skip by design starts in pytest's summary


def skip(reason: str, *, by_design: bool = False, allow_module_level: bool = False):
    """The one way a test of this suite skips. `reason` says what is missing and how to provide it (or, with
    by_design, why this run cannot judge the test and which run does). A skip that is not by design fails under
    H3KIT_REQUIRE_UPSTREAM=1 (CI): there, everything a test needs must be present."""
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError("requires.skip needs the reason the test skips")
    if by_design:
        pytest.skip(BY_DESIGN + reason, allow_module_level=allow_module_level)
    if REQUIRE_UPSTREAM:
        pytest.fail(f"{reason} [H3KIT_REQUIRE_UPSTREAM=1: CI needs every test to run; only a skip by design may "
                    "skip]", pytrace=False)
    pytest.skip(reason, allow_module_level=allow_module_level)


def upstream_moved(reason: str):
    """The verdict of a look-ahead test when upstream's newest commit conflicts with the series: an expected
    failure that names the commit and the hunks (pytest prints it as XFAIL), never a skip and never a red CI:
    what upstream does next is not this submission's fault, and the report is the point."""
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError("requires.upstream_moved needs the commit and the conflicting hunks")
    pytest.xfail(reason)


def skip_or_fail(reason: str, allow_module_level: bool = False):
    """Skip with `reason`; under H3KIT_REQUIRE_UPSTREAM=1 (CI) fail with it instead (skip(), not by design)."""
    skip(reason, allow_module_level=allow_module_level)


def missing_torch(allow_module_level: bool = False):
    """The verdict for a test that needs torch in an interpreter without it."""
    if TORCH_FREE_RUN:
        skip(TORCH_FREE_REASON, by_design=True, allow_module_level=allow_module_level)
    skip(NO_TORCH_REASON, allow_module_level=allow_module_level)


def needs_torch(item) -> bool:
    if item.get_closest_marker("torch") is not None:
        return True
    # the ComfyUI fixtures run their interpreter: with H3KIT_COMFY_PYTHON that is another one
    return bool(TORCH_FIXTURES & set(item.fixturenames)) and not os.environ.get("H3KIT_COMFY_PYTHON")


def torch_module():
    """torch, for a test module that uses it at import time; otherwise the verdict of missing_torch()."""
    if not HAVE_TORCH:
        missing_torch(allow_module_level=True)
    import torch
    return torch


def module(name: str, reason: str, allow_module_level: bool = False):
    """The imported module `name` (torch, comfy_kitchen.tensor...), or the verdict for a test that needs it: torch
    follows missing_torch(); anything else of the ComfyUI environment skips with `reason`, a failure under
    H3KIT_REQUIRE_UPSTREAM=1 (in a torch-free run it skips by design, as torch does)."""
    import importlib
    try:
        return importlib.import_module(name)
    except ImportError:
        pass
    if name == "torch" or TORCH_FREE_RUN:
        missing_torch(allow_module_level=allow_module_level)
    skip_or_fail(reason, allow_module_level=allow_module_level)
