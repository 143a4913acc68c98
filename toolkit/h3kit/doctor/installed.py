"""doctor's tree, service and models checks: `h3kit verify` of the installed tree (git without optional locks:
nothing is written), `h3kit status` of its service, and the model files the shipped workflows load."""

from __future__ import annotations

import contextlib
import json
import os

from h3kit import install
from h3kit import service as h3service
from h3kit.doctor.base import GB, Doctor
from h3kit.errors import H3kitError
from h3kit.paths import repo_root

SAFETENSORS_HEADER_MAX = 100 * 1024 * 1024
SERVICE_TIMEOUT = 3.0


def check_tree(d: Doctor):
    try:
        with _no_git_locks():
            result = install.verify(d.home)
    except H3kitError as e:
        d.add("tree", "error", e.message, e.hint or f"h3kit install --comfy-home {d.home}")
        return
    for problem in result["problems"]:
        d.add("tree", "error", problem, f"h3kit install --comfy-home {d.home} (--force if files were edited)")
    for warning in result["warnings"][:10]:
        d.add("tree", "warning", warning)
    if result["ok"]:
        d.add("tree", "ok", f"installed at the pin {result['pin'][:12]} with {len(result['patches'])} patches "
              "(h3kit verify: clean)")


def check_service(d: Doctor):
    try:
        root = h3service.runtime_root(d.home, d.opts.runtime_root)
        status = h3service.status(root, timeout=SERVICE_TIMEOUT)
    except H3kitError as e:
        d.add("service", "warning", e.message, e.hint)
        return
    d.service = status
    if not status.get("record"):
        d.add("service", "info", "not running (no record)", f"h3kit start --comfy-home {d.home} --devices ...")
    elif not status.get("running"):
        d.add("service", "warning", f"recorded but not running: {status.get('stale')}",
              f"h3kit restart --comfy-home {d.home} (h3kit status shows the last log's first error)")
    elif not status.get("healthy"):
        d.add("service", "error", f"pid {status.get('pid')} runs but does not answer at {status.get('url')}: "
              f"{status.get('health')}", "h3kit logs --errors, then h3kit restart")
    else:
        d.add("service", "ok", f"running: pid {status['pid']} at {status['url']}, {status['device_type']} devices "
              f"{','.join(map(str, status['requested_devices']))}")
        if d.requested is None:
            d.requested = list(status["requested_devices"])
            d.requested_from = "the running service"
        elif list(status["requested_devices"]) != d.requested:
            d.add("service", "warning", f"the service runs on devices {status['requested_devices']}, "
                  f"not {d.requested} ({d.requested_from})", "h3kit stop, then start with the devices you mean")


def check_models(d: Doctor):
    from h3kit.workflow import models
    try:
        tree = models.open_install(str(d.home))
    except H3kitError as e:
        d.add("models", "error", e.message, e.hint)
        return
    from h3kit.weights import sources

    needed = shipped_model_files()
    by_workflow: dict[str, list] = {}
    found, missing, broken = {}, {}, []
    for (kind, name), workflows in sorted(needed.items()):
        path = tree.find_model(kind, name)
        if path is None:
            missing[(kind, name)] = workflows
        else:
            found[(kind, name)] = (path, os.path.getsize(path))
            problem = (sources.disk_problem(path, sources.sources_for(kind, name), d.opts.verify_hash)
                       or safetensors_problem(path))
            if problem:
                broken.append(f"{path}: {problem}")
        for wf in workflows:
            by_workflow.setdefault(wf, []).append((kind, name))
    ready = sorted(wf for wf, files in by_workflow.items() if all(f in found for f in files))
    d.found_models = {wf: sum(found[f][1] for f in files if f in found) for wf, files in by_workflow.items()}
    if missing:
        _missing_models(d, tree, missing, ready)
    for problem in broken:
        d.add("models", "error", problem, "move the file away and run h3kit models fetch (it checks the published "
              "size and sha256; h3kit models list --verify-hash compares a file's sha256)")
    lines = [f"{kind}/{name}: {size / GB:.2f} GB at {path}" for (kind, name), (path, size) in sorted(found.items())]
    if found:
        checked = "sizes and sha256" if d.opts.verify_hash else "sizes"
        d.add("models", "ok" if not missing and not broken else "info",
              f"{len(found)} of {len(needed)} model file(s) found, {sum(s for _, s in found.values()) / GB:.1f} GB "
              f"({checked} checked against h3kit's manifest where published); workflows ready: "
              f"{', '.join(ready) or 'none'}", lines=lines)


def _missing_models(d: Doctor, tree, missing: dict, ready: list):
    """One finding for every missing file, with one `h3kit models fetch` over the shipped workflows that
    need them (their installed copies when install put them in the tree) and each file's source in the
    words of `h3kit models list`."""
    from h3kit.weights import listing, sources

    users = sorted({wf for workflows in missing.values() for wf in workflows})
    paths = []
    for wf in users:
        copy = d.home / install.WORKFLOW_DEST / wf
        paths.append(str(copy if copy.is_file() else repo_root() / "workflows" / wf))
    known = {(w.kind, w.name): w for w in listing.collect(paths)}
    lines, unknown = [], []
    for (kind, name), workflows in missing.items():
        w = known.get((kind, name))
        src = w.sources if w is not None else sources.sources_for(kind, name)
        if not src:
            unknown.append(f"{kind}/{name}")
        lines.append(f"{kind}/{name} (needed by {', '.join(workflows)}; searched {tree.folders(kind)}); "
                     f"source: {sources.describe(src)}")
    fix = f"h3kit models fetch {' '.join(paths)} --comfy-home {d.home} (add --dry-run to see sizes and " \
          "free space first, --models-dir DIR for shared storage)"
    if unknown:
        fix += f"; no source is known for {', '.join(unknown)}: download it into models/<kind>/ or a folder " \
               "listed in extra_model_paths.yaml"
    d.add("models", "warning" if ready else "error",
          f"{len(missing)} model file(s) missing, needed by {', '.join(users)}", fix, lines)


# ---- pieces with their own tests -------------------------------------------------------------------------------------

def shipped_model_files() -> dict:
    """{(kind, file name): [workflow file names]} for every model file the shipped workflows load."""
    from h3kit.workflow import graph as graph_mod, load, models, resolve
    from h3kit.workflow.catalog import load_catalog
    catalog = load_catalog()
    out: dict = {}
    for path in sorted((repo_root() / "workflows").glob("*.json")):
        graph = graph_mod.build_graph(load.read_workflow(str(path)), catalog)
        for _node, _input, kind, name in models.model_references(graph, resolve.value):
            users = out.setdefault((kind, name), [])
            if path.name not in users:
                users.append(path.name)
    return out


def safetensors_problem(path: str) -> str | None:
    """Why a .safetensors file cannot be whole (a truncated download), or None. Reads only its header."""
    if not path.endswith(".safetensors"):
        return None
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{size} bytes: too short for a safetensors header"
            n = int.from_bytes(head, "little")
            if n > SAFETENSORS_HEADER_MAX or 8 + n > size:
                return f"header of {n} bytes does not fit in the file's {size} bytes (truncated or not safetensors)"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        return f"unreadable header ({type(e).__name__})"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
            and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2]
    want = 8 + n + max(ends, default=0)
    if size < want:
        return f"truncated: {size} of {want} bytes"
    return None


@contextlib.contextmanager
def _no_git_locks():
    # `git status` refreshes the index when it can; doctor must not write anything
    saved = os.environ.get("GIT_OPTIONAL_LOCKS")
    os.environ["GIT_OPTIONAL_LOCKS"] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("GIT_OPTIONAL_LOCKS", None)
        else:
            os.environ["GIT_OPTIONAL_LOCKS"] = saved
