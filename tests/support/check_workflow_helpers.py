"""Small helpers the check-workflow tests share: write a document, run the checker, read findings."""

from __future__ import annotations

import copy
import json
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
