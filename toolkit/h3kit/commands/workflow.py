"""`h3kit check-workflow`: the click layer over h3kit.workflow."""

from __future__ import annotations

import sys

import click

from h3kit.cliutil import comfy_home_option, emit_json, handle_errors, json_option


@click.command("check-workflow")
@click.argument("files", nargs=-1, required=True, metavar="FILE...", type=click.Path())
@click.option("--devices", metavar="LIST",
              help="Devices the service exposes, as for `h3kit start` (e.g. 0,1,2,3). Default: "
                   "ASCEND_RT_VISIBLE_DEVICES, else the running service of --comfy-home.")
@comfy_home_option(required=False)
@click.option("--runtime-root", metavar="DIR", type=click.Path(),
              help="Where the service record is (default <comfy-home>/.h3kit/run).")
@click.option("--port", type=click.IntRange(1, 65535), default=None, metavar="PORT",
              help="The server of --comfy-home on PORT, when the tree runs several (npu_count auto is its count).")
@click.option("--device-memory", type=click.FloatRange(min=0, min_open=True), metavar="GB",
              help="Memory of one card in GB (64 for a 910B, 32 for a 910B4), to check that the workflow's tier "
                   "fits. Default: the smallest card the running service of --comfy-home reports.")
@json_option
@handle_errors
def check_workflow(files, devices, comfy_home, runtime_root, port, device_memory, as_json):
    """Check H3 workflows (UI, API or /prompt body) before they reach the NPUs.

    Finds a wrong npu_count, a tier (devices, BF16/INT8 weights, replicated/sharded) that does not fit the
    cards, H3 canvas sizes and lengths the model cannot use, Turbo LoRAs on pruned bases, samplers and VAEs
    that spoil the audio, and broken graphs. With --comfy-home it also checks
    that the model files exist and the node types are installed. Exit 0: no error (warnings allowed);
    1: at least one error; 2: a file could not be read or is not a workflow. Codes: docs/check-workflow.md.
    """
    from h3kit.workflow import check_paths, report

    result = check_paths(list(files), devices=devices, comfy_home=comfy_home, runtime_root=runtime_root,
                         device_memory=device_memory, port=port)
    if as_json:
        emit_json({"findings": [f.to_dict() for f in result.findings], "summary": result.summary},
                  ok=result.exit_code == 0)
    else:
        click.echo(report.render_text(result.findings, list(files), result.summary))
    sys.exit(result.exit_code)
