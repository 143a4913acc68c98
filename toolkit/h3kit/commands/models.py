"""`h3kit models list|fetch`: the click layer over h3kit.weights."""

from __future__ import annotations

import sys

import click

from h3kit.cliutil import comfy_home_option, emit_json, err, handle_errors, json_option

workflows_argument = click.argument("workflows", nargs=-1, required=True, metavar="WORKFLOW...", type=click.Path())


@click.group()
def models():
    """List and fetch the model files workflows need (Hugging Face, resumable, verified)."""


@models.command("list")
@workflows_argument
@comfy_home_option(required=False)
@click.option("--verify-hash", is_flag=True, help="Also read every file found and compare its sha256 with the "
              "published one (minutes per file of tens of GB); without it, files are checked by size.")
@json_option
@handle_errors
def list_(workflows, comfy_home, verify_hash, as_json):
    """Every model file the workflows' loaders name (UI or API format, subgraphs included): its folder,
    whether ComfyUI at --comfy-home finds it (models/ or extra_model_paths.yaml), its size on disk against
    the published size (h3kit's manifest), and its source (the workflow's properties.models, else the
    manifest). Exit 0 when it could list them and no file found differs from the published one (missing
    files are listed, not an error), 1 when one differs, 2 when a file is not a workflow or --comfy-home is
    not ComfyUI."""
    from h3kit.weights import listing

    data = listing.list_models(list(workflows), comfy_home, verify_hash=verify_hash)
    if as_json:
        emit_json(data, ok=not data["bad"])
    else:
        click.echo(listing.render_text(data))
    if data["bad"]:
        sys.exit(1)


@models.command()
@workflows_argument
@comfy_home_option(required=True)
@click.option("--models-dir", metavar="DIR", type=click.Path(file_okay=False),
              help="Put diffusion_models/, text_encoders/, vae/ and loras/ files on this folder (shared storage) "
                   "instead of the tree's models/; extra_model_paths.yaml is made to name it (h3kit install "
                   "--models-dir) when it does not yet.")
@click.option("--dry-run", is_flag=True, help="Ask the server for each file's size and print what would be "
              "downloaded (or taken from the Hugging Face cache), where each file goes, the total and the free "
              "space; write nothing.")
@json_option
@handle_errors
def fetch(workflows, comfy_home, models_dir, dry_run, as_json):
    """Download the model files the workflows need that the tree lacks.

    From Hugging Face with huggingface_hub (HF_ENDPOINT names a mirror, HF_TOKEN a token), or a plain
    https:// URL. Each file lands under its folder by name, only after its size and sha256 (where known)
    were checked; an interrupted download stays in <folder>/.h3kit-fetch/ and the next run resumes it from
    its last byte. A Hub file already in the Hugging Face cache (HF_HOME) is hard-linked from it (copied
    across file systems) instead of downloaded.
    Nothing is downloaded when a target folder is read-only or its disk is too full. Exit 0: every file is
    in place; 1: some could not be fetched (the reason is given per file) or the fetch was refused."""
    from h3kit.weights import fetch as fetch_mod

    data = fetch_mod.fetch(list(workflows), comfy_home, models_dir, log=err, progress=sys.stderr.isatty(),
                           dry_run=dry_run)
    if as_json:
        emit_json(data)
    else:
        click.echo(fetch_mod.render_text(data))
    sys.exit(0 if data["ok"] else 1)
