"""Small helpers the check-workflow tests share: write a document, run the checker, read findings."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from h3kit.workflow import check_paths

DATA = Path(__file__).resolve().parents[1] / "data" / "workflows"
ROOT = Path(__file__).resolve().parents[2]


def load_data(name: str):
    return json.loads((DATA / name).read_text(encoding="utf-8"))


def check_doc(tmp_path, doc, name="wf.json", **kwargs):
    path = Path(tmp_path) / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc), encoding="utf-8")
    kwargs.setdefault("environ", {})
    return check_paths([str(path)], **kwargs)


def found(result, code=None):
    """[(code, node)] of the findings, optionally only one code."""
    return [(f.code, f.node) for f in result.findings if code is None or f.code == code]


def messages(result, code):
    return [f.message for f in result.findings if f.code == code]


def ui_node(doc, node_id, subgraph=None):
    """The node dict with this id in the root graph or in the subgraph whose name or id starts with `subgraph`."""
    if subgraph is None:
        nodes = doc["nodes"]
    else:
        defs = doc["definitions"]["subgraphs"]
        nodes = next(s for s in defs if s["id"].startswith(subgraph) or s.get("name", "").startswith(subgraph))["nodes"]
    return next(n for n in nodes if n["id"] == node_id)


def deep(doc):
    return copy.deepcopy(doc)


_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", re.I)


def _num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _vec2(v):
    return isinstance(v, list) and len(v) == 2 and all(_num(x) for x in v)


def _node_id(v):
    return (isinstance(v, int) and not isinstance(v, bool)) or isinstance(v, str)


def _data_type(v):
    return isinstance(v, str) or _num(v) or (isinstance(v, list) and all(isinstance(x, str) for x in v))


def frontend_schema_errors(doc) -> list[str]:
    """Where a UI workflow breaks the pinned frontend's zComfyWorkflow (0.4) schema.

    ComfyUI frontend 1.49.6 (unchanged since 1.48.7), src/platform/workflow/validation/schemas/workflowSchema.ts: the fields a
    flat (subgraph-free) workflow uses.
    """
    errors = []
    if "id" in doc and not (isinstance(doc["id"], str) and _UUID.match(doc["id"])):
        errors.append("id is not a UUID string")
    if not _node_id(doc.get("last_node_id")) or not _num(doc.get("last_link_id")) or not _num(doc.get("version")):
        errors.append("last_node_id / last_link_id / version")
    for node in doc.get("nodes", []):
        where = f"node {node.get('id')}"
        if not (_node_id(node.get("id")) and isinstance(node.get("type"), str) and _vec2(node.get("pos"))
                and _vec2(node.get("size")) and isinstance(node.get("flags"), dict) and _num(node.get("order"))
                and _num(node.get("mode")) and isinstance(node.get("properties"), dict)):
            errors.append(f"{where}: id/type/pos/size/flags/order/mode/properties")
        if not isinstance(node.get("properties", {}).get("Node name for S&R", ""), str):
            errors.append(f"{where}: properties['Node name for S&R']")
        if "widgets_values" in node and not isinstance(node["widgets_values"], (list, dict)):
            errors.append(f"{where}: widgets_values")
        for inp in node.get("inputs", []):
            link = inp.get("link")
            if not (isinstance(inp.get("name"), str) and _data_type(inp.get("type")) and (link is None or _num(link))):
                errors.append(f"{where}: input {inp.get('name')!r}")
        for out in node.get("outputs", []):
            links = out.get("links")
            if not (isinstance(out.get("name"), str) and _data_type(out.get("type"))
                    and (links is None or (isinstance(links, list) and all(_num(x) for x in links)))):
                errors.append(f"{where}: output {out.get('name')!r}")
    for link in doc.get("links", []):
        if not (isinstance(link, list) and len(link) == 6 and _num(link[0]) and _node_id(link[1])
                and isinstance(link[2], int) and _node_id(link[3]) and isinstance(link[4], int)
                and _data_type(link[5])):
            errors.append(f"link {link!r}")
    extra = doc.get("extra")
    if extra is not None and "ds" in extra and not (_num(extra["ds"].get("scale")) and _vec2(extra["ds"].get("offset"))):
        errors.append("extra.ds")
    return errors
