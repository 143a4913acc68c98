"""h3kit patches check|refresh|status: maintain the series the way quilt users do."""

from __future__ import annotations

import json
import os
import sys

import click

from h3kit.cliutil import comfy_home_option, emit_json, err, handle_errors, json_option
from h3kit.errors import NotAComfyTree, UsageError

source_option = click.option("--source", metavar="PATH", envvar="H3KIT_COMFY_SOURCE", type=click.Path(),
                             help="A local mirror or checkout holding the pin (env H3KIT_COMFY_SOURCE).")


def _local_source(source, required=False):
    """The local mirror to read the pin from. A URL (valid for install, which clones it) cannot be read
    here: an error when the command needs the pin, else None with a note."""
    from h3kit import gitutil

    if not source:
        return None
    if not gitutil.is_local_source(source) or not os.path.exists(source):
        if not required:
            err(f"h3kit: {source} is not a local mirror: the series is not applied to the pin")
            return None
        raise UsageError(f"--source {source!r} is not a local mirror or checkout",
                         hint="clone the mirror locally (git clone --mirror URL) and pass its path")
    return source


@click.group()
def patches():
    """Inspect and maintain the patch series (check, refresh, status, rebase)."""


@patches.command()
@source_option
@json_option
@handle_errors
def check(source, as_json):
    """Validate patches/series: every entry parses with a DEP-3 header, appears once, no orphans, sources in
    sync, manifest in sync, an index line on every section; with a source, the whole series applies to the pin
    and reverses back to it, and each index line names the blobs the series goes through on the pin."""
    from h3kit import gitutil, manifest
    from h3kit.patches import (PatchConflict, Series, index_problems, local_import_problems, plan_reverse, series_result,
                               structural_problems, walk)
    from h3kit.paths import repo_root

    root = repo_root()
    data = manifest.load(root)
    series = Series.load(root)
    problems = structural_problems(series, data)
    applied_to_pin = None
    src = _local_source(source)
    if src:
        pin = manifest.pin(data)
        touched = series.touched_files()
        base = gitutil.read_blobs(src, pin, touched)
        for entry in data["patches"]:
            for f in entry.get("files", []):
                found = manifest.git_blob_id(base[f["path"]]) if base.get(f["path"]) is not None else None
                if f["path"] in base and found != f.get("base_blob"):
                    problems.append(f"{entry['name']}: {f['path']} is blob {found} at the pin, the manifest says "
                                    f"{f.get('base_blob')}")
        try:
            result = series_result(series, base)
            problems += [p for p in index_problems(series, walk(series, base))
                         if "no index line" not in p]  # the structural check named those already
            problems += local_import_problems(series, base, result)
            back = plan_reverse(series, result)
            applied_to_pin = True
            if back.conflicts or back.after != base:
                problems.append("the series does not reverse back to the pin's files")
        except PatchConflict as e:
            applied_to_pin = False
            problems.append(f"{e.message}: {e.details}")
    if as_json:
        emit_json({"ok": not problems, "patches": series.names, "problems": problems,
                   "applies_to_pin": applied_to_pin})
    else:
        for i, name in enumerate(series.names, 1):
            click.echo(f"  {i}/{len(series.names)} {name}")
        if applied_to_pin is None:
            err("h3kit: no --source: the series was not applied to the pin")
        for p in problems:
            click.echo(f"problem: {p}")
        click.echo("OK" if not problems else f"{len(problems)} problem(s)")
    sys.exit(0 if not problems else 1)


@patches.command()
@source_option
@click.option("--add", "additions", multiple=True, metavar="PATCH:PATH",
              help="Add a new-file section for patches/src/PATH to PATCH (repeatable).")
@handle_errors
def refresh(source, additions):
    """Regenerate new-file sections from patches/src, write every section's index line (its base and new blob
    on the pin) and rewrite the manifest's patch list (sha256, touched files, base blobs read from the pin in
    --source)."""
    from h3kit import gitutil, manifest
    from h3kit.patches import Series, add_source_sections, index_lines, manifest_entries, regenerate, walk
    from h3kit.paths import require_checkout

    import shutil
    import tempfile
    from pathlib import Path

    root = require_checkout("patches refresh")
    src = _local_source(source, required=True)
    if not src:
        raise UsageError("refresh needs the pin's files", hint="pass --source or set H3KIT_COMFY_SOURCE to a local mirror")
    # Everything is computed in a scratch copy of patches/ first; the real patches and the manifest are
    # written only once the new series is known to apply to the pin (all or nothing).
    scratch = Path(tempfile.mkdtemp(prefix="h3kit-refresh-"))
    try:
        shutil.copytree(root / "patches", scratch / "patches")
        series = Series.load(scratch)
        for spec in additions:
            name, _, rel = spec.partition(":")
            if name not in series.names or not rel:
                raise UsageError(f"--add {spec!r}: give PATCH:PATH with PATCH listed in patches/series")
            (scratch / "patches" / name).write_text(add_source_sections(series, name, [rel]))
            series = Series.load(scratch)
        changed = regenerate(series)
        for name, text in changed.items():
            (scratch / "patches" / name).write_text(text)
        series = Series.load(scratch)
        data = manifest.load(root)
        pin = manifest.pin(data)
        base = gitutil.read_blobs(src, pin, series.touched_files())
        steps = walk(series, base)  # refuses to record a series that does not apply
        for name, text in regenerate(series, index_lines(steps), gitutil.read_modes(src, pin, series.touched_files())).items():
            (scratch / "patches" / name).write_text(text)
        series = Series.load(scratch)
        data["patches"] = manifest_entries(series, base)
        # the patch files and the manifest change together: the new ones are written beside the old first,
        # and the written ones put back if a later write fails
        from h3kit.patches import read_tree_files, write_tree_files

        rels = [f"patches/{p.name}" for p in series.patches] + ["source_deps_info.json"]
        before = read_tree_files(root, rels)
        after = {f"patches/{p.name}": p.raw for p in series.patches}
        after["source_deps_info.json"] = (json.dumps(data, indent=2) + "\n").encode()
        for rel in write_tree_files(root, before, after):
            if rel.startswith("patches/"):
                click.echo(f"regenerated {rel[len('patches/'):]}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    click.echo(f"source_deps_info.json: {len(series.names)} patches recorded")


@patches.command()
@click.argument("old", type=click.Path(exists=True, file_okay=False))
@click.argument("new", type=click.Path(exists=True, file_okay=False))
@click.argument("paths", nargs=-1, required=True)
@handle_errors
def diff(old, new, paths):
    """Print diff sections for PATHS from tree OLD to tree NEW in the series' format (a/ b/, 3 lines of
    context, full index lines), ready to paste under a patch's DEP-3 header (refresh corrects the index
    lines if OLD was not the tree the earlier patches leave)."""
    from h3kit.patches import diff_sections

    click.echo(diff_sections(old, new, list(paths)), nl=False)


@patches.command()
@comfy_home_option()
@json_option
@handle_errors
def status(comfy_home, as_json):
    """Per patch: applied, applies cleanly, or conflicts (with the failing hunk) in a ComfyUI tree.
    Exit 0 only when every patch is applied."""
    from pathlib import Path

    from h3kit.install import load_state
    from h3kit.patches import Series, plan_forward, read_tree_files
    from h3kit.paths import repo_root

    series = Series.load(repo_root())
    tree = Path(comfy_home)
    if not (tree / "main.py").is_file():
        raise NotAComfyTree(tree)
    plan = plan_forward(series, read_tree_files(tree, series.touched_files()))
    applied = all(s.state == "applied" for s in plan.states)
    state = load_state(tree) or {}
    installed = {"commit": state.get("pin"), "requested": state.get("commit_requested")}
    if as_json:
        emit_json({"patches": [s.to_dict() for s in plan.states], "installed": installed}, ok=applied)
    else:
        if installed["commit"]:
            asked = f" (--commit {installed['requested']})" if installed["requested"] else ""
            click.echo(f"installed at {installed['commit'][:12]}{asked}")
        for s in plan.states:
            click.echo(f"{s.state:9} {s.name}")
            for f in s.failures:
                click.echo(f"          {f}")
    # 0: every patch applied; 1: some would still apply; 2 is bad input; conflicts are 1 as well
    sys.exit(0 if applied else 1)


@patches.command()
@click.option("--onto", required=True, metavar="REV", help="The upstream commit (or branch of the source) to move to.")
@click.option("--source", metavar="URL_OR_PATH", envvar="H3KIT_COMFY_SOURCE",
              help="Git URL or local mirror holding the pin and REV (env H3KIT_COMFY_SOURCE, else the public URL).")
@click.option("--out", "out_dir", metavar="DIR", type=click.Path(file_okay=False),
              help="A new or empty folder for the report and the refreshed series (default: ./rebase-REV).")
@click.option("--resolved", "resolved_dir", metavar="DIR", type=click.Path(file_okay=False),
              help="The conflicts/ folder of an earlier run with its files resolved (markers removed): each is "
                   "taken as its patch's result for that file, and the replay goes on.")
@click.option("--write", is_flag=True,
              help="Also write the refreshed series and source_deps_info.json over this checkout's (clean only).")
@json_option
@handle_errors
def rebase(onto, source, out_dir, resolved_dir, write, as_json):
    """Move the series onto upstream REV three-way, patch by patch (gbp pq's way), and report per patch and
    hunk: clean, merged three-way, or conflicting with the conflicting lines. Clean: the refreshed series
    (new context, new base blobs, Upstream-Commit in each DEP-3 header) and its source_deps_info.json go
    into --out. A conflict: exit 1, the files with conflict markers go beside the report in --out; nothing
    else changes. See docs/upstream.md."""
    from pathlib import Path

    from h3kit import manifest, rebase as lib
    from h3kit.install import resolve_source
    from h3kit.patches import Series
    from h3kit.paths import repo_root, require_checkout

    root = require_checkout("patches rebase") if write else repo_root()
    data = manifest.load(root)
    series = Series.load(root)
    src = resolve_source(source, data)
    out = Path(out_dir or f"rebase-{onto.replace('/', '_')[:40]}")
    resolved = lib.read_resolutions(Path(resolved_dir), series) if resolved_dir else None
    rep, doc = lib.rebase_onto(root, data, series, onto, src, out, progress=sys.stderr.isatty() and not as_json,
                               resolved=resolved, log=lambda m: err(f"h3kit: {m}"))
    if write and rep.ok:
        doc["written_into_checkout"] = lib.write_into_checkout(root, out)
    if as_json:
        emit_json(doc)
    else:
        click.echo((out / lib.REPORT_TEXT).read_text(), nl=False)
        if rep.ok:
            click.echo(f"refreshed series: {out}/patches, {out}/source_deps_info.json"
                       + (" (written into this checkout)" if write else
                          " (copy them over patches/ and source_deps_info.json, or rerun with --write)"))
        else:
            click.echo(f"report and conflicting files: {out}")
    sys.exit(0 if rep.ok else 1)
