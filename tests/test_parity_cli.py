"""`h3kit parity` refuses a request that cannot mean anything before it looks for a tree or a device (no torch)."""

from __future__ import annotations

import pytest

from h3kit.runtime import parity as parity_lib
from tests.support import jsondoc
from tests.support.service_helpers import h3kit


@pytest.mark.parametrize("component", parity_lib.COMPONENTS)
def test_one_device_is_refused_for_every_component(tmp_path, component):
    proc = h3kit("parity", "--comfy-home", tmp_path, "--component", component, "--npu-count", "1", "--json")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    error = jsondoc.error(proc.stdout, proc.returncode)
    assert error["code"] == "meaningless_count" and "compare a model with itself" in error["message"]
    assert "--npu-count 2 or 4" in error["fix"]


@pytest.mark.parametrize("component, fault", [("te", "rope"), ("vae", "heads"), ("dit", "reduce")])
def test_a_fault_of_another_component_is_refused(tmp_path, component, fault):
    proc = h3kit("parity", "--comfy-home", tmp_path, "--component", component, "--npu-count", "2",
                 "--inject-fault", fault)
    assert proc.returncode == 2 and f"{component} has no such fault" in proc.stderr
    assert ", ".join(parity_lib.FAULTS[component]) in proc.stderr and "Traceback" not in proc.stderr
