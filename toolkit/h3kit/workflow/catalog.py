"""What check-workflow knows about node types: inputs, widget order, outputs.

The packaged catalogue `pin_nodes.json` is a compact copy of `GET /object_info` from the pinned ComfyUI
(the pin in source_deps_info.json, booted on CPU; built-in nodes from nodes.py and comfy_extras/, the API nodes left out). It is
generated, never hand-edited: `python -m h3kit.workflow.catalog http://127.0.0.1:PORT` rewrites it, and
tests/test_check_workflow_catalog.py compares it with a live pin server when one can be booted.

Why a catalogue: UI-format workflows store widget values as a bare list (`widgets_values`) in the order the
frontend creates widgets, which is the node definition's input order (required, then optional) restricted
to widget types, plus one extra "control_after_generate" value after each INT (or COMBO) input that asks
for it (or, for INT, is named seed/noise_seed; ComfyUI frontend FRONTEND_VERSION,
src/renderer/extensions/vueNodes/widgets/composables/useIntWidget.ts), and one "upload" value after a combo
with image_upload/video_upload/audio_upload. Without the definition, values are not guessed: nodes absent
from the catalogue get no widget mapping.

The frontend these rules were read from is FRONTEND_VERSION, the one the pin's requirements.txt names
(tests/test_frontend_rules.py fails when they differ). Read from the sources in the package's source maps
(FRONTEND_SOURCES). 1.49.6 against 1.48.7, re-read 2026-12-06: useIntWidget.ts, useComboWidget.ts,
useImageUploadWidget.ts, executionUtil.ts and ExecutableNodeDTO.ts are unchanged; widgets.ts adds a VIDEO_EDIT
widget with a structured value ({trim, crop}: opaque here); LGraphNode.ts saves `widgets_values_named`
({widget name: value}) beside the positional `widgets_values`, but restores from it only when
LiteGraph.namedValuesRestore is set (default false), so the positional list still decides; SubgraphNode.ts
appends widgets added by extensions after the promoted ones (the promoted order is unchanged).

MultiNPUParallelConfig is not upstream: it comes from the h3kit patch series, and its entry below follows
the interface fixed in issue 4 (inputs model, clip, vae, audio_vae, widget npu_count first; outputs MODEL,
CLIP, VAE, VAE), with the optional widget weights (auto, replicated, sharded) after npu_count since issue 14
(a workflow saved without it keeps its default, graph.APPENDED_WIDGETS).
"""

from __future__ import annotations

import json
import os

PIN_CATALOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pin_nodes.json")
# the ComfyUI frontend (comfyui-frontend-package) the widget rules below and graph.py's flattening were read from
FRONTEND_VERSION = "1.49.6"
FRONTEND_SOURCES = (
    "src/renderer/extensions/vueNodes/widgets/composables/useIntWidget.ts",
    "src/renderer/extensions/vueNodes/widgets/composables/useComboWidget.ts",
    "src/renderer/extensions/vueNodes/widgets/composables/useImageUploadWidget.ts",
    "src/scripts/widgets.ts",
    "src/lib/litegraph/src/LGraphNode.ts",
    "src/lib/litegraph/src/subgraph/SubgraphNode.ts",
    "src/lib/litegraph/src/subgraph/ExecutableNodeDTO.ts",
    "src/utils/executionUtil.ts",
)

WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})
# Input types whose widgets the frontend builds in ways this module does not model (dynamic combos add
# widgets per option, 3D and colour pickers, bounding boxes, painters and the video editor store structured
# values): widget mapping stops at the first one that is not forceInput (a forceInput one is a socket).
# Every type frontend FRONTEND_VERSION's ComfyWidgets builds (src/scripts/widgets.ts) is here or in WIDGET_TYPES.
OPAQUE_TYPES = frozenset({"COMFY_DYNAMICCOMBO_V3", "COLOR", "WEBCAM", "AUDIO_RECORD", "LOAD_3D",
                          "LOAD3D_CAMERA", "LOAD3D_MODEL_INFO", "CURVE", "IMAGECOMPARE", "VIDEO_EDIT",
                          "BOUNDING_BOX", "BOUNDING_BOXES", "CHART", "COLORS", "COMPOSITOR", "GALLERIA",
                          "IMAGEUPLOAD", "MARKDOWN", "PAINTER", "RANGE", "TEXTAREA"})
# Socket-less structured inputs (autogrow groups, match types) are connected per slot, never widgets.
GROUP_TYPES = frozenset({"COMFY_AUTOGROW_V3"})
UPLOAD_FLAGS = ("image_upload", "video_upload", "audio_upload", "file_upload")

H3KIT_NODES = {
    "MultiNPUParallelConfig": {
        "inputs": [
            ["npu_count", "COMBO", True, {"options": ["auto", 1, 2, 4, 8], "default": 4}],
            ["model", "MODEL", True, {}],
            ["clip", "CLIP", False, {}],
            ["vae", "VAE", False, {}],
            ["audio_vae", "VAE", False, {}],
            ["weights", "COMBO", False, {"options": ["auto", "replicated", "sharded"], "default": "auto"}],
        ],
        "outputs": ["MODEL", "CLIP", "VAE", "VAE"],
        "output_node": False,
        "source": "h3kit patch series (issue 4 interface)",
    },
}

# Frontend-only node types: they never reach the server and need no backend definition.
VIRTUAL_NODES = frozenset({"PrimitiveNode", "Reroute", "Note", "MarkdownNote", "Group", "Label"})


class NodeDef:
    """One node type: ordered inputs [(name, type, required, options)], output types, output_node."""

    __slots__ = ("name", "inputs", "outputs", "output_node", "_widgets")

    def __init__(self, name: str, inputs, outputs, output_node: bool = False):
        self.name = name
        self.inputs = [(str(i[0]), str(i[1]), bool(i[2]), i[3] if len(i) > 3 and isinstance(i[3], dict) else {})
                       for i in inputs]
        self.outputs = [str(o) for o in outputs]
        self.output_node = bool(output_node)
        self._widgets = None

    def input(self, name: str):
        for item in self.inputs:
            if item[0] == name:
                return item
        return None

    def is_widget(self, name: str) -> bool:
        item = self.input(name)
        return item is not None and _is_widget(item)

    def widget_slots(self) -> list[str | None]:
        """Names for the positions of a UI `widgets_values` list; None marks a value to skip.

        The list ends early (and `widget_slots_complete` is False) at an input whose widgets this module
        does not model; values past that point are not mapped.
        """
        if self._widgets is None:
            slots: list[str | None] = []
            complete = True
            for name, kind, _required, opts in self.inputs:
                if _is_opaque(kind, opts) or opts.get("widgetType") or opts.get("component"):
                    complete = False
                    break
                if not _is_widget((name, kind, _required, opts)):
                    continue
                slots.append(name)
                cag = opts.get("control_after_generate")
                if kind == "INT" and cag is None:
                    cag = name in ("seed", "noise_seed")
                if cag:
                    slots.append(None)
                if kind == "COMBO" and any(opts.get(flag) for flag in UPLOAD_FLAGS):
                    slots.append(None)
            self._widgets = (slots, complete)
        return self._widgets[0]

    @property
    def widget_slots_complete(self) -> bool:
        self.widget_slots()
        return self._widgets[1]

    def socket_inputs(self, required_only: bool = False) -> list[str]:
        """Inputs that take a link and have no widget value to fall back on."""
        return [item[0] for item in self.inputs if is_socket(item) and (item[2] or not required_only)]


def _is_opaque(kind: str, opts: dict) -> bool:
    return kind in OPAQUE_TYPES and not opts.get("forceInput")


def _is_widget(item) -> bool:
    _name, kind, _required, opts = item
    return kind in WIDGET_TYPES and not opts.get("forceInput")


def is_socket(item) -> bool:
    """True for a pure link input; False for widgets, opaque widget types and autogrow groups."""
    _name, kind, _required, opts = item
    if _is_widget(item) or _is_opaque(kind, opts) or kind in GROUP_TYPES:
        return False
    return not (opts.get("widgetType") or opts.get("component"))


class Catalog:
    """Node definitions by class name, built from the compact entries on first use."""

    def __init__(self, entries: dict[str, dict]):
        self.entries = entries
        self.defs: dict[str, NodeDef] = {}
        self._produced = None

    def get(self, class_type) -> NodeDef | None:
        if not isinstance(class_type, str):
            return None
        nd = self.defs.get(class_type)
        if nd is None:
            e = self.entries.get(class_type)
            if e is None:
                return None
            nd = self.defs[class_type] = NodeDef(class_type, e["inputs"], e["outputs"], e.get("output_node", False))
        return nd

    def __contains__(self, class_type) -> bool:
        return isinstance(class_type, str) and class_type in self.entries

    def is_produced(self, kind: str) -> bool:
        """Whether some known node outputs this type (else an input of it can only be a widget)."""
        if self._produced is None:
            self._produced = {t.strip() for e in self.entries.values() for o in e["outputs"] for t in str(o).split(",")}
        return kind in ("*", "COMFY_MATCHTYPE_V3") or any(t.strip() in self._produced for t in kind.split(","))

    def merge_object_info(self, object_info: dict) -> None:
        """Add (or replace) definitions from a live server's /object_info answer."""
        for name, entry in compact_object_info(object_info).items():
            self.entries[name] = entry
            self.defs.pop(name, None)
        self._produced = None


def load_catalog(path: str = PIN_CATALOG) -> Catalog:
    with open(path, encoding="utf-8") as f:
        entries = json.load(f)["nodes"]
    entries.update(H3KIT_NODES)
    return Catalog(entries)


_KEEP_OPTIONS = ("control_after_generate", "forceInput", "widgetType", "component", *UPLOAD_FLAGS)


def compact_object_info(object_info: dict, *, skip_modules: tuple[str, ...] = ()) -> dict:
    """Reduce /object_info to what the checker uses. Malformed entries are skipped, never fatal."""
    out = {}
    if not isinstance(object_info, dict):
        return out
    for name, info in object_info.items():
        if not isinstance(info, dict) or not isinstance(info.get("input"), dict):
            continue
        module = str(info.get("python_module") or "")
        if skip_modules and module.startswith(skip_modules):
            continue
        spec = info["input"]
        order = info.get("input_order") if isinstance(info.get("input_order"), dict) else {}
        inputs = []
        for category, required in (("required", True), ("optional", False)):
            group = spec.get(category)
            if not isinstance(group, dict):
                continue
            names = order.get(category) if isinstance(order.get(category), list) else list(group)
            for input_name in names:
                item = group.get(input_name)
                if not isinstance(item, (list, tuple)) or not item:
                    continue
                kind = "COMBO" if isinstance(item[0], list) else str(item[0])
                opts = item[1] if len(item) > 1 and isinstance(item[1], dict) else {}
                kept = {k: opts[k] for k in _KEEP_OPTIONS if k in opts and _small(opts[k])}
                inputs.append([input_name, kind, required, kept])
        outputs = info.get("output") if isinstance(info.get("output"), list) else []
        out[name] = {"inputs": inputs,
                     "outputs": ["COMBO" if isinstance(o, list) else str(o) for o in outputs],
                     "output_node": bool(info.get("output_node"))}
    return out


def _small(value) -> bool:
    return isinstance(value, (bool, int, float, str)) and len(str(value)) < 64


def refresh(url: str, path: str = PIN_CATALOG) -> int:
    """Rewrite the packaged catalogue from a pin server's /object_info (maintainers only)."""
    from h3kit import health, manifest

    info = health.request_json(url.rstrip("/") + "/object_info", timeout=60)
    nodes = compact_object_info(info, skip_modules=("comfy_api_nodes", "custom_nodes", "comfy_extras.nodes_multinpu"))  # the series: _H3KIT_NODES
    data = {
        "source": f"GET /object_info of ComfyUI {manifest.pin(manifest.load())} on CPU, "
                  "compacted by h3kit.workflow.catalog.compact_object_info (API and custom nodes left out)",
        "nodes": dict(sorted(nodes.items())),
    }
    # one node per line, so a refresh after an upstream bump reviews as a readable diff
    lines = [json.dumps(name) + ": " + json.dumps(entry, separators=(",", ":"))
             for name, entry in data["nodes"].items()]
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"source": ' + json.dumps(data["source"]) + ',\n"nodes": {\n' + ",\n".join(lines) + "\n}}\n")
    return len(nodes)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m h3kit.workflow.catalog http://127.0.0.1:PORT")
    try:
        count = refresh(sys.argv[1])
    except Exception as e:  # a maintainer tool: say what failed, no traceback
        sys.exit(f"cannot read {sys.argv[1]}/object_info: {type(e).__name__}: {e}")
    sys.stderr.write(f"wrote {count} node definitions to {PIN_CATALOG}\n")
