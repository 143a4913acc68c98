"""API-format prompts derived from UI workflows, for tests that check both forms of one real graph."""

from __future__ import annotations

from h3kit.workflow.catalog import load_catalog
from h3kit.workflow.graph import Link, build_graph
from h3kit.workflow.load import classify


_CATALOG = load_catalog()


def to_api(doc: dict) -> dict:
    """The prompt the frontend would queue: execution ids "outer:inner", links as [id, slot]."""
    graph = build_graph(classify(doc), _CATALOG)
    prompt = {}
    for node in graph.nodes.values():
        inputs = {name: [v.node, v.slot] if isinstance(v, Link) else {"__value__": v} if isinstance(v, list) else v
                  for name, v in node.inputs.items()}
        prompt[node.id] = {"class_type": node.class_type, "inputs": inputs, "_meta": {"title": node.title or ""}}
    return prompt
