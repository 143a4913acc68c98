"""check-workflow's widget rules come from the frontend the pin ships.

The rules (h3kit.workflow.catalog: which inputs are widgets, the extra control_after_generate and upload
values, opaque widget types; graph.py's flattening) were read from one comfyui-frontend-package,
catalog.FRONTEND_VERSION. These tests fail when the pin's frontend is another version (re-read the sources
named in catalog.FRONTEND_SOURCES, then move FRONTEND_VERSION), and, where the package is installed, tie each
rule to the text of the source it was read from.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from h3kit.workflow import catalog
from tests.support import requires

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_REQUIREMENTS = ROOT / "toolkit" / "requirements" / "comfy-runtime-cpu.txt"
PIN = json.loads((ROOT / "source_deps_info.json").read_text())["upstream"]["commit"]


def frontend_pin(requirements: str) -> str:
    m = re.search(r"^comfyui[-_]frontend[-_]package==([\w.]+)", requirements, re.M | re.I)
    assert m, "no comfyui-frontend-package pin in the requirements"
    return m.group(1)


def test_the_rules_were_read_from_the_frontend_the_runtime_requirements_pin():
    assert frontend_pin(RUNTIME_REQUIREMENTS.read_text()) == catalog.FRONTEND_VERSION, (
        f"{RUNTIME_REQUIREMENTS.name} pins another frontend than the one check-workflow's widget rules were read "
        f"from ({catalog.FRONTEND_VERSION}): re-read catalog.FRONTEND_SOURCES there, then move FRONTEND_VERSION")


def test_the_rules_were_read_from_the_frontend_of_the_pins_requirements(comfy_source):
    git_dir = ["--git-dir", comfy_source] if (Path(comfy_source) / "objects").is_dir() else ["-C", comfy_source]
    text = subprocess.run(["git", *git_dir, "show", f"{PIN}:requirements.txt"], capture_output=True, text=True,
                          check=True).stdout
    assert frontend_pin(text) == catalog.FRONTEND_VERSION


@pytest.fixture(scope="module")
def frontend_sources():
    """{source path: text} of catalog.FRONTEND_SOURCES from the installed package's source maps."""
    spec = importlib.util.find_spec("comfyui_frontend_package")
    if spec is None or not spec.origin:  # the ComfyUI environment has it (the pin's requirements); small ones do not
        requires.skip("comfyui-frontend-package is not installed in this interpreter: the main run, in the ComfyUI "
                      "environment, reads it", by_design=requires.TORCH_FREE_RUN)
    assert importlib.metadata.version("comfyui-frontend-package") == catalog.FRONTEND_VERSION
    assets = os.path.join(os.path.dirname(spec.origin), "static", "assets")
    wanted, found = set(catalog.FRONTEND_SOURCES), {}
    for path in glob.glob(os.path.join(assets, "*.js.map")):
        with open(path, "rb") as f:
            raw = f.read()
        if not any(os.path.basename(w).encode() in raw for w in wanted):
            continue
        doc = json.loads(raw)
        for src, text in zip(doc.get("sources", []), doc.get("sourcesContent") or []):
            key = next((w for w in wanted if src.endswith(w)), None)
            if key and text:
                found.setdefault(key, text)
    assert set(found) == wanted, f"not in the package's source maps: {sorted(wanted - set(found))}"
    return found


def test_each_rule_is_in_the_source_it_was_read_from(frontend_sources):
    ints = frontend_sources["src/renderer/extensions/vueNodes/widgets/composables/useIntWidget.ts"]
    assert "['seed', 'noise_seed'].includes(inputSpec.name)" in ints  # the extra value after seed / noise_seed
    assert "inputSpec.control_after_generate ??" in ints
    combos = frontend_sources["src/renderer/extensions/vueNodes/widgets/composables/useComboWidget.ts"]
    assert "if (inputSpec.control_after_generate)" in combos
    widgets = frontend_sources["src/scripts/widgets.ts"]
    constructors = set(re.findall(r"^\s+([A-Z][A-Z0-9_]+): transformWidgetConstructorV2ToV1", widgets, re.M))
    # every widget type the frontend builds is a plain widget type or one check-workflow treats as opaque
    assert "VIDEO_EDIT" in constructors and "INT" in constructors
    assert constructors - catalog.WIDGET_TYPES - catalog.OPAQUE_TYPES == set()
    node = frontend_sources["src/lib/litegraph/src/LGraphNode.ts"]
    assert "if (namedValues && LiteGraph.namedValuesRestore)" in node  # named restore only behind the setting
    assert "namedValuesRestore: boolean = false" not in node  # (the default lives in LiteGraphGlobal.ts)
