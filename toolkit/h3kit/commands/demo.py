"""h3kit demo and h3kit bench: the click layer over h3kit.demo and h3kit.bench."""

from __future__ import annotations

import click

from h3kit import devices as h3devices
from h3kit import group, service
from h3kit.cliutil import comfy_home_option, emit_json, err, handle_errors, json_option
from h3kit.demo import PROMPT_TIMEOUT

COUNTS = [str(n) for n in h3devices.ALLOWED_COUNTS]


def _log(msg: str) -> None:
    err(f"h3kit: {msg}")


@click.command()
@comfy_home_option()
@click.option("--device-type", type=click.Choice(["auto", *h3devices.DEVICE_TYPES]), default="auto", show_default=True)
@click.option("--npu-count", type=click.Choice(COUNTS), default="2", show_default=True,
              help="Devices to run on (ids 0..N-1); simulated on cpu. With 2 or 4 the prompt also runs with "
                   "npu_count 1 and the latents are compared.")
@click.option("--transport", type=click.Choice(("auto",) + group.TRANSPORTS), default="auto", show_default=True,
              help="process: one process per device (torch.distributed: gloo on cpu); threads: one process. "
                   "auto: process on npu and cuda, threads on cpu.")
@click.option("--keep-running", is_flag=True, help="Leave the server running afterwards.")
@click.option("--source", metavar="URL_OR_PATH", help="Where install clones ComfyUI from, if it must (as for install).")
@click.option("--python", metavar="PY", type=click.Path(dir_okay=False),
              help="The interpreter that runs ComfyUI (default: install's record).")
@click.option("--port", type=click.IntRange(1, 65535), default=service.DEFAULT_PORT, show_default=True)
@click.option("--timeout", type=click.FloatRange(min=1), default=PROMPT_TIMEOUT, show_default=True,
              help="Seconds one prompt may take.")
@click.option("--weights", type=click.Choice(["float", "int8"]), default="float", show_default=True,
              help="int8: the tiny DiT with its block linears in INT8 (ConvRot, as the published H3 INT8 files), "
                   "run on the NPU INT8 arm (its reference kernels on cpu).")
@json_option
@handle_errors
def demo(comfy_home, device_type, npu_count, transport, keep_running, source, python, port, timeout, weights, as_json):
    """Run a real H3 prompt with tiny weights through the patched server.

    Installs if needed, writes four tiny H3 checkpoints (h3kit_tiny_*), starts the service on N devices,
    checks the shipped demo workflow, submits it, follows it, and prints where the video (with its audio
    track) was written and the time of each stage. With N > 1 the same prompt runs with npu_count 1 and the
    largest latent difference must stay within the DiT parity gate (max_rel 1e-5), else exit 1. With
    --weights int8 the DiT is the INT8 one, and the server log must show the NPU INT8 arm ran.
    """
    from pathlib import Path

    from h3kit.demo import DemoOptions, run_demo

    opts = DemoOptions(comfy_home=Path(comfy_home), device_type=device_type, npu_count=int(npu_count),
                       keep_running=keep_running, source=source, python=python, port=port, timeout=timeout,
                       transport=transport, weights=weights)
    report = run_demo(opts, log=_log)  # progress on stderr, also with --json
    if as_json:
        emit_json(report)
        return
    click.echo(f"h3kit demo: {report['npu_count']} {report['device_type']} device(s) "
               f"{'(simulated) ' if report['device_type'] == 'cpu' and report['transport'] == 'threads' else ''}"
               f"({report['transport']} transport) at {report['comfy_home']}"
               + (", INT8 DiT" if report["weights"] == "int8" else ""))
    for s in report["stages"]:
        click.echo(f"  {s['stage']:15s} {s['seconds']:7.2f} s  {s['detail']}")
    v = report["video"]
    click.echo(f"video with audio: {v['path']} (tracks: {', '.join(v['tracks'])}, {v['bytes']} bytes)")
    if "parity" in report:
        p = report["parity"]
        click.echo(f"parity, npu_count {p['npu_count']} vs 1: max_rel {p['max_rel']:.3e} "
                   f"(gate {p['gate_max_rel']:g}): {'PASS' if p['ok'] else 'FAIL'}")
    if keep_running:
        click.echo(f"server kept running: {report['service']['url']}")


@click.command()
@click.argument("workflow", type=click.Path(exists=True, dir_okay=False))
@comfy_home_option(required=False)
@click.option("--runtime-root", metavar="DIR", type=click.Path(),
              help="Where the service record is (default <comfy-home>/.h3kit/run).")
@click.option("--runs", type=click.IntRange(1, 100), default=3, show_default=True)
@click.option("--switch", "switch", type=click.Path(exists=True, dir_okay=False), metavar="WORKFLOW2",
              help="Run this other workflow between runs (a model switch).")
@click.option("--no-cold", is_flag=True, help="Do not empty the server's models before the first run.")
@click.option("--npu-count", type=click.Choice(COUNTS), default=None,
              help="Set every MultiNPUParallelConfig's npu_count before submitting (default: as in the file).")
@click.option("--timeout", type=click.FloatRange(min=1), default=3600.0, show_default=True,
              help="Seconds one run may take.")
@json_option
@handle_errors
def bench(workflow, comfy_home, runtime_root, runs, switch, no_cold, npu_count, timeout, as_json):
    """Time an API-format workflow on the running server: the first run cold, then warm.

    Per run: end-to-end time (submission to completion, measured here), per-stage times from the server's
    node events, model files read and device loads (from the server log), peak device memory
    (/system_stats). Each run moves the seed, as a user's next prompt would, from an offset drawn anew for
    every bench; a run that executed no node (all from ComfyUI's cache) is flagged and left out of the figures.
    """
    from pathlib import Path

    from h3kit.bench import run_bench

    if not comfy_home and not runtime_root:
        raise click.UsageError("give --comfy-home (or H3KIT_COMFY_HOME) or --runtime-root")
    result = run_bench(comfy_home, runtime_root, Path(workflow), runs=runs,
                       switch=Path(switch) if switch else None, cold=not no_cold, timeout=timeout,
                       npu_count=int(npu_count) if npu_count else None, log=_log)
    if as_json:
        emit_json(result)
        return
    click.echo(f"{result['workflow']} on {result['url']} ({result['device_type']} {result['devices']})")
    for r in result["runs"]:
        stages = ", ".join(f"{k} {v}" for k, v in r["stages"].items())
        mem = ", ".join(f"{k} {v / 2 ** 30:.1f} GiB" for k, v in r["peak_device_memory"].items())
        click.echo(f"  run {r['run']:>8} {r['kind']:6s} {r['end_to_end_s']:8.2f} s  models read {r['models_loaded']}, "
                   f"device loads {r['device_loads']}  [{stages}]  peak {mem}"
                   + (f"  FLAGGED: {r['flag']}" if r.get("flag") else ""))
    s = result["summary"]
    click.echo(f"cold {s['cold_s']} s, warm median {s['warm_median_s']} s, models read on warm runs: "
               f"{s['warm_models_loaded']}")
