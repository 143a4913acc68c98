"""install, verify, revert: the click layer over h3kit.install."""

from __future__ import annotations

import sys

import click

from h3kit.cliutil import comfy_home_option, emit_json, err, handle_errors, json_option


def _log(msg: str) -> None:
    err(f"h3kit: {msg}")


@click.command()
@comfy_home_option()
@click.option("--source", metavar="URL_OR_PATH",
              help="Git URL or local mirror of ComfyUI holding the pin (default: $H3KIT_COMFY_SOURCE, "
                   "else the public URL).")
@click.option("--commit", metavar="REV",
              help="Install another commit than the pin (with --force): a commit id or prefix, a tag or a branch of "
                   "the source, resolved once and recorded with the word given. Where the series does not apply as "
                   "it is, it is merged three-way against the pin's files; a conflict names each hunk and changes "
                   "nothing.")
@click.option("--python", metavar="PY", type=click.Path(dir_okay=False),
              help="The interpreter that will run ComfyUI (default: the one the last install of this tree "
                   "recorded, else this one).")
@click.option("--models-dir", "models_dirs", multiple=True, metavar="DIR", type=click.Path(file_okay=False),
              help="A folder of H3 model files on shared storage (diffusion_models/, text_encoders/, vae/, loras/ "
                   "inside), written into the tree's extra_model_paths.yaml beside your own entries. Repeatable; "
                   "replaces the folders an earlier install wrote (default: keep them).")
@click.option("--force", is_flag=True,
              help="Check out the pin over another commit, restore locally edited patched files from the pin, "
                   "and overwrite edited shipped files.")
@click.option("--dry-run", is_flag=True, help="Check everything and report what would change; change nothing.")
@json_option
@handle_errors
def install(comfy_home, source, commit, python, models_dirs, force, dry_run, as_json):
    """Install ComfyUI at the pin with the h3kit patch series.

    Clones (without checkout, then checks out the pin) or reuses DIR, checks the interpreter, checks every
    patch before applying any, then writes the patched and shipped files all at once. Re-running on an
    installed tree changes nothing.
    """
    from pathlib import Path

    from h3kit import install as lib

    opts = lib.InstallOptions(comfy_home=Path(comfy_home), source=source, commit=commit, python=python,
                              force=force, dry_run=dry_run, progress=sys.stderr.isatty() and not as_json,
                              models_dirs=list(models_dirs) or None)
    report = lib.install(opts, log=_log if not as_json else (lambda m: None))
    if as_json:
        emit_json(report.to_dict())
        return
    for w in report.warnings:
        err(f"h3kit: warning: {w}")
    for d in report.drift:
        if d["kind"] == "upstream":
            err(f"h3kit: drift: {d['file']} is blob {str(d['found'])[:12]} at this commit; "
                f"{d['patch']} was made against {str(d['expected_base'])[:12]}")
    if report.merge is not None and any(m["how"] == "3-way" for m in report.merge["patches"]):
        err(f"h3kit: the series was merged three-way onto {report.merge['onto'][:12]} (recorded; verify checks the tree "
            "against that merge; h3kit patches rebase refreshes the series for it)")
    if report.discarded_edits:
        err("h3kit: restored from the pin (local edits discarded): " + ", ".join(report.discarded_edits))
    click.echo(f"ComfyUI {report.pin[:12]} at {report.comfy_home}" + (" (cloned)" if report.cloned else ""))
    for st in report.patches:
        label = {"apply": "apply" if report.dry_run else "applied now", "applied": "already applied"}[st["state"]]
        click.echo(f"  patch {st['patch']}: {label}" + (" (merged three-way)" if st.get("how") == "3-way" else ""))
    files = report.files
    click.echo(f"  files: {len(files['installed'])} new, {len(files['updated'])} updated, "
               f"{len(files['unchanged'])} unchanged, {len(files['kept'])} kept (edited), "
               f"{len(files['removed'])} removed")
    if report.models_dirs:
        click.echo(f"  models folders ({lib.modelpaths.CONFIG}): {', '.join(report.models_dirs)}")
    if not report.changed:
        click.echo("Nothing to change: the tree is installed.")
    else:
        click.echo(f"{'Would change' if report.dry_run else 'Changed'} {len(report.changed)} files.")


@click.command()
@comfy_home_option()
@json_option
@handle_errors
def verify(comfy_home, as_json):
    """Check an installed tree: pin, patches, installed files, bytecode. Exit 1 on any problem."""
    from pathlib import Path

    from h3kit import install as lib

    result = lib.verify(Path(comfy_home))
    if as_json:
        emit_json(result)
    else:
        for w in result["warnings"]:
            err(f"h3kit: warning: {w}")
        for d in result["models"]["dirs"]:
            files = result["models"]["files"]
            click.echo(f"models folder {d}: " + (", ".join(f"{k} {len(v)} file(s)" for k, v in files.items())
                                                 or "no model file yet"))
        if result["ok"]:
            at = (f"commit {result['requested']} = {result['pin'][:12]}" if result["requested"]
                  else f"the pin {result['pin'][:12]}")
            click.echo(f"OK: {result['comfy_home']} is at {at} with "
                       f"{len(result['patches'])} patches applied and its installed files intact.")
        else:
            click.echo(f"{len(result['problems'])} problem(s) in {result['comfy_home']}:")
            for p in result["problems"]:
                click.echo(f"  - {p}")
    sys.exit(0 if result["ok"] else 1)


@click.command()
@comfy_home_option()
@click.option("--force", is_flag=True, help="Restore edited patched files from the pin and remove edited shipped files.")
@json_option
@handle_errors
def revert(comfy_home, force, as_json):
    """Reverse the patch series and remove the files install added (those you did not edit)."""
    from pathlib import Path

    from h3kit import install as lib

    result = lib.revert(Path(comfy_home), force=force, log=_log if not as_json else (lambda m: None))
    if as_json:
        emit_json(result)
        return
    for st in result["patches"]:
        click.echo(f"  patch {st['patch']}: {'reversed' if st['state'] == 'reverse' else 'was not applied'}")
    click.echo(f"  removed {len(result['removed'])} installed files")
    if result["kept"]:
        click.echo("  kept (you edited them): " + ", ".join(result["kept"]))
    if result["restored_from_pin"]:
        click.echo("  restored from the pin: " + ", ".join(result["restored_from_pin"]))
