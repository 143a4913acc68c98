"""The model files workflows need, and where a ComfyUI tree has them (`h3kit models list`).

Every loader input that names a file statically (h3kit.workflow.models.LOADER_INPUTS; UI and API format,
subgraphs expanded as the frontend does; muted and bypassed loaders too, since a user may switch them on),
found the way ComfyUI at the pin searches: models/<folder> and the folders extra_model_paths.yaml adds
(h3kit.workflow.models.open_install).
"""

from __future__ import annotations

import os

from h3kit.errors import UsageError
from h3kit.weights import sources as sources_mod


class Wanted:
    """One model file: its kind (ComfyUI's folder name), its name as the loader gives it, the workflows and
    loader inputs that name it, and its sources."""

    def __init__(self, kind: str, name: str):
        self.kind = kind
        self.name = name
        self.workflows: list[str] = []
        self.loaders: list[str] = []
        self.sources: list = []
        self.found: str | None = None
        self.via: str | None = None
        self.size: int | None = None
        self.note: str | None = None

    @property
    def bad_name(self) -> str | None:
        """Why the name cannot be a file under a models folder (None when it can)."""
        return bad_name(self.name)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "workflows": self.workflows, "loaders": self.loaders,
                "found": self.found, "via": self.via, "size": self.size,
                "sources": [s.to_dict() for s in self.sources], "note": self.note}


def bad_name(name: str) -> str | None:
    rel = name.replace("\\", "/")
    if not rel or "\x00" in rel or rel.startswith("/") or any(p in ("", ".", "..") for p in rel.split("/")):
        return f"{name!r} is not a plain file name under a models folder"
    return None


def collect(paths: list[str]) -> list[Wanted]:
    """The files the workflows' loaders name, in order of first appearance. A file that is not a readable
    workflow raises UsageError (exit 2)."""
    from h3kit.workflow import graph as graph_mod, load, models, resolve
    from h3kit.workflow.catalog import load_catalog

    catalog = load_catalog()
    wanted: dict[tuple[str, str], Wanted] = {}
    for path in paths:
        workflow = load.read_workflow(path)
        try:
            graph = graph_mod.build_graph(workflow, catalog)
        except (graph_mod.GraphTooLarge, RecursionError) as e:
            raise UsageError(f"{path}: the workflow is too large or nests too deeply to read ({e})",
                             code="bad_workflow", hint="flatten nested subgraphs, then run it again") from None
        entries = sources_mod.workflow_entries(workflow.data) if workflow.kind == load.UI else {}
        for node, input_name, kind, name in models.model_references(graph, resolve.value):
            if kind == "vae" and (name == "pixel_space" or name in models.IMAGE_TAES):
                continue  # not files: VAELoader builds them from vae_approx or needs none
            w = wanted.get((kind, name))
            if w is None:
                w = wanted[(kind, name)] = Wanted(kind, name)
                w.sources = sources_mod.sources_for(kind, name, entries)
                w.note = sources_mod.manifest_note(kind, name)
            elif entries and not any(s.origin == "workflow" for s in w.sources):
                found = sources_mod.sources_for(kind, name, entries)
                if found and found[0].origin == "workflow":
                    w.sources = sources_mod.dedupe([found[0], *w.sources])
            if path not in w.workflows:
                w.workflows.append(path)
            loader = f"{node.class_type}.{input_name}"
            if loader not in w.loaders:
                w.loaders.append(loader)
    return list(wanted.values())


def locate(wanted: list[Wanted], install) -> None:
    """Fill found / via / size from a ComfyUI tree (h3kit.workflow.models.Install)."""
    tree_models = os.path.join(install.home, "models")
    for w in wanted:
        if w.bad_name:
            continue
        path = install.find_model(w.kind, w.name) or (install.find_model("vae_approx", w.name) if w.kind == "vae" else None)
        if path is None:
            continue
        w.found = path
        inside = os.path.commonpath([os.path.abspath(path), tree_models]) == tree_models
        w.via = "models/" if inside else "extra_model_paths.yaml"
        try:
            w.size = os.path.getsize(path)
        except OSError:
            w.size = None


def list_models(paths: list[str], comfy_home: str | None = None, verify_hash: bool = False) -> dict:
    """What `h3kit models list` reports (its --json data). A file on disk is checked against the published
    size (and with `verify_hash` the published sha256, sources.disk_problem)."""
    wanted = collect(paths)
    install = None
    if comfy_home:
        from h3kit.workflow import models

        install = models.open_install(comfy_home, object_info={})  # node types are not this command's business
        locate(wanted, install)
    rows = []
    for w in wanted:
        row = w.to_dict()
        published = next((s.size for s in w.sources if s.size is not None), None)
        row["published_size"] = published
        row["target"] = None
        if install is not None:
            row["searched"] = install.model_dirs.get(w.kind, [])
            if not w.found and not w.bad_name:  # where `h3kit models fetch` puts it (without --models-dir)
                row["target"] = os.path.join(install.home, "models", w.kind, *w.name.replace("\\", "/").split("/"))
        if w.bad_name:
            row["problem"] = w.bad_name
        elif install is not None and w.found:
            problem = sources_mod.disk_problem(w.found, w.sources, verify_hash)
            if problem:
                row["problem"] = problem
            row["hash_checked"] = bool(verify_hash and not problem and any(s.sha256 for s in w.sources))
        rows.append(row)
    missing = [r for r in rows if install is not None and r["found"] is None]
    return {"comfy_home": install.home if install else None, "workflows": list(paths), "files": rows,
            "missing": len(missing), "no_source": sum(1 for r in rows if not r["sources"]),
            "bad": sum(1 for r in rows if r.get("problem")),
            "problems": install.problems if install else []}


def render_text(data: dict) -> str:
    lines = []
    checked = data["comfy_home"] is not None
    for r in data["files"]:
        if not checked:
            state = "       "
        elif r["found"]:
            state = "ok     "
        else:
            state = "MISSING"
        where = f"{r['kind']}/{r['name']}"
        if r.get("size") is not None:
            size = f"  {_size(r['size'])}"
        elif r.get("published_size") is not None:
            size = f"  {_size(r['published_size'])} (published)"
        elif r["sources"]:
            size = "  size: not published (h3kit models fetch --dry-run asks the server)"
        else:
            size = ""
        lines.append(f"{state} {where}{size}")
        if r["found"]:
            lines.append(f"         at {r['found']} (via {r['via']})" + ("; sha256 as published" if r.get("hash_checked")
                                                                           else ""))
        elif checked:
            lines.append(f"         searched: {', '.join(r['searched']) or '(no folder)'}")
            if r.get("target"):
                lines.append(f"         fetch puts it at: {r['target']}")
        src = r["sources"][0] if r["sources"] else None
        lines.append(f"         source: {r['note'] if r['note'] and not src else sources_mod.describe_dict(src)}")
        if r.get("problem"):
            lines.append(f"         problem: {r['problem']}")
    lines.append("")
    n = len(data["files"])
    if checked:
        lines.append(f"{n} model file(s), {n - data['missing']} found in {data['comfy_home']}, {data['missing']} missing"
                     + (f", {data['bad']} not the published file" if data["bad"] else "")
                     + (f"; {data['no_source']} with no known source" if data["no_source"] else ""))
        if data["missing"]:
            lines.append(f"fetch them: h3kit models fetch {' '.join(data['workflows'])} --comfy-home {data['comfy_home']}")
    else:
        lines.append(f"{n} model file(s); give --comfy-home to see which the tree has")
    for p in data["problems"]:
        lines.append(f"note: {p}")
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e7 else f"{n / 1e6:.2f} MB" if n >= 1e4 else f"{n} bytes"
