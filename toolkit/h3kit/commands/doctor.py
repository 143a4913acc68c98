"""doctor: the click layer over h3kit.doctor (read-only preflight).

Exit codes: 0 nothing wrong (warnings allowed), 1 at least one error, 2 bad input.
"""

from __future__ import annotations

import click

from h3kit import devices as h3devices
from h3kit.cliutil import comfy_home_option, emit_json, err, handle_errors, json_option
from h3kit.doctor import Options, run

MARKS = {"ok": "ok", "info": "--", "warning": "WARN", "error": "FAIL"}


@click.command()
@comfy_home_option(required=False)
@click.option("--devices", metavar="LIST", help="The devices the service will use, as for h3kit start (0,1,2,3); "
              "default: ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES, else the running service's.")
@click.option("--device-type", type=click.Choice(("auto",) + h3devices.DEVICE_TYPES), default="auto",
              show_default=True, help="auto: npu where an Ascend card or npu-smi is present, else cuda, else cpu.")
@click.option("--python", metavar="PY", type=click.Path(dir_okay=False),
              help="Interpreter that runs ComfyUI (default: the one install recorded).")
@click.option("--runtime-root", metavar="DIR", type=click.Path(),
              help="Where the service keeps its record (default <comfy-home>/.h3kit/run).")
@click.option("--verify-hash", is_flag=True, help="Also compare each model file's sha256 with the published one "
              "(reads every file: minutes per file of tens of GB); without it, model files are checked by size.")
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Hosts the service will span (as for h3kit start): several need HCCL_IF_IP or HCCL_SOCKET_IFNAME.")
@json_option
@handle_errors
def doctor(comfy_home, devices, device_type, python, runtime_root, verify_hash, nnodes, as_json):
    """Check that this machine is ready to run H3, and say how to fix what is not.

    Read-only. Checks the interpreter ComfyUI runs with (Python, torch, torch-npu, a CUDA build beside
    torch-npu, CANN and its pairing), the driver (npu-smi / nvidia-smi), the devices torch sees against
    --devices, free device memory against each tier's need at 768p/5 s and 15 s, the installed tree
    (h3kit verify), the service (h3kit status), the model files the shipped workflows load, disk space
    and host memory. Never imports torch itself: the interpreter answers in a subprocess.
    Exit 0 when nothing is wrong (warnings allowed), 1 otherwise.
    """
    report = run(Options(comfy_home=comfy_home, devices=devices, device_type=device_type, python=python,
                         runtime_root=runtime_root, verify_hash=verify_hash, nnodes=nnodes))
    if as_json:
        emit_json(report)
    else:
        devs = ",".join(map(str, report["devices"])) if report["devices"] is not None else "all visible"
        click.echo(f"h3kit doctor: {report['host']}, {report['device_type']} devices {devs}"
                   + (f" (from {report['devices_from']})" if report["devices_from"] else "")
                   + (f", {report['comfy_home']}" if report["comfy_home"] else ""))
        for f in report["findings"]:
            click.echo(f"  {MARKS[f['severity']]:4}  {f['check']:12} {f['message']}")
            for line in f.get("lines", []):
                click.echo(f"{'':20}{line}")
            if f.get("fix"):
                click.echo(f"{'':20}fix: {f['fix']}")
    verdict = "ready" if report["ok"] else "not ready"
    err(f"h3kit doctor: {report['errors']} error(s), {report['warnings']} warning(s): {verdict}")
    if not report["ok"]:
        raise SystemExit(1)
