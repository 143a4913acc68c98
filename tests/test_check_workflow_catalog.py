"""The checked-in node catalogue and the shipped workflows against a live pinned ComfyUI (booted once, on CPU).

pin_nodes.json is what the checker knows about widget order and inputs without a server; these tests prove
it equals the pin's /object_info, that the static node-type scan finds every type the server registers, and
that the shipped workflows use only node types, inputs, widget counts and option values the pin accepts.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from h3kit import health
from h3kit.workflow.catalog import H3KIT_NODES, PIN_CATALOG, compact_object_info, load_catalog
from h3kit.workflow.models import LOADER_INPUTS, scan_node_types
from tests.support.service_helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
BOOT_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def pin_object_info(pin_tree, comfy_python, tmp_path_factory):
    """/object_info of the pinned server; the tree stays untouched (base directory and database elsewhere)."""
    base = tmp_path_factory.mktemp("pin-base")
    for sub in ("custom_nodes", "models", "input", "output", "temp", "user"):
        (base / sub).mkdir()
    log = open(base / "server.log", "wb")
    port = free_port(8600, 8699)
    proc = subprocess.Popen([comfy_python, "-B", "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
                             "--base-directory", str(base), "--database-url", "sqlite:///:memory:"],
                            cwd=pin_tree, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    try:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the pinned server exited with {proc.returncode}: {(base / 'server.log').read_text()[-2000:]}")
            try:
                stats = health.request_json(f"http://127.0.0.1:{port}/system_stats", timeout=2)
            except health.HttpError:
                stats = None
            if stats is not None:
                # this server's answer (its --base-directory), not another's that holds the port: ours then exits
                # on its failed bind, which the poll above reports
                assert str(base) in (stats.get("system") or {}).get("argv", []), f"another server on {port}: {stats}"
                break
            if time.monotonic() > deadline:
                pytest.fail(f"the pinned server did not answer within {BOOT_TIMEOUT_S} s")
            time.sleep(0.5)
        yield health.request_json(f"http://127.0.0.1:{port}/object_info", timeout=60)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


pytestmark = [pytest.mark.slow, pytest.mark.upstream]


def test_packaged_catalogue_is_the_pins_object_info(pin_object_info):
    live = compact_object_info(pin_object_info, skip_modules=("comfy_api_nodes", "custom_nodes"))
    packaged = json.loads(Path(PIN_CATALOG).read_text())["nodes"]
    assert packaged == live, "regenerate with python -m h3kit.workflow.catalog http://127.0.0.1:PORT"
    assert not set(H3KIT_NODES) & set(pin_object_info)  # h3kit's own node is not upstream


def test_static_scan_finds_every_registered_node_type(pin_tree, pin_object_info):
    missing = set(pin_object_info) - scan_node_types(str(pin_tree))
    assert not missing


def test_loader_table_names_real_combo_inputs(pin_object_info):
    for kind, inputs in LOADER_INPUTS.items():
        spec = pin_object_info[kind]["input"]
        for name, _folder in inputs:
            entry = spec["required"].get(name) or spec.get("optional", {}).get(name)
            assert entry is not None and (isinstance(entry[0], list) or entry[0] == "COMBO"), (kind, name)


@pytest.mark.parametrize("name", ["t2va_8steps_lora.json", "fl2va_8steps_lora.json", "ref2va_8steps_lora.json"])
def test_shipped_workflow_fits_the_pins_node_definitions(pin_object_info, name):
    catalog = load_catalog()
    catalog.merge_object_info(pin_object_info)
    doc = json.loads((ROOT / "workflows" / name).read_text())
    for node in doc["nodes"]:
        kind = node["type"]
        if kind in H3KIT_NODES:
            continue
        assert kind in pin_object_info, kind
        info = pin_object_info[kind]
        spec = {**info["input"].get("required", {}), **info["input"].get("optional", {})}
        nd = catalog.get(kind)
        values = dict(zip(nd.widget_slots(), node["widgets_values"]))
        for input_name, value in values.items():
            if input_name is None:
                continue
            entry = spec[input_name]
            options = entry[0] if isinstance(entry[0], list) else (entry[1].get("options") if entry[0] == "COMBO" else None)
            # model and image lists depend on what is installed; the rest are fixed choices
            if options is not None and input_name not in {i for pairs in LOADER_INPUTS.values() for i, _ in pairs} \
                    and input_name != "image":
                assert value in options, (name, kind, input_name, value)
            if entry[0] == "INT":
                assert isinstance(value, int) and entry[1].get("min", value) <= value <= entry[1].get("max", value)
        for inp in node["inputs"]:
            assert inp["name"].split(".")[0] in spec, (kind, inp["name"])
        assert [o["type"] for o in node["outputs"]] == info["output"], kind
