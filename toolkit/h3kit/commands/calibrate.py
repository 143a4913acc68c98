"""calibrate: the click layer over h3kit.runtime.calibration.

Exit codes: 0 report written, 1 the measurement failed (or --plot without matplotlib), 2 bad input
(including --sizes real on cpu).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from h3kit import devices as h3devices
from h3kit.cliutil import comfy_home_option, emit_json, err, handle_errors, json_option, sigterm_as_interrupt
from h3kit.runtime import calibration

COUNTS = [str(c) for c in h3devices.ALLOWED_COUNTS]


@click.command()
@comfy_home_option()
@click.option("--device-type", type=click.Choice(("auto",) + h3devices.DEVICE_TYPES), default="auto",
              show_default=True, help="auto picks npu, then cuda, then cpu (cpu simulates the devices).")
@click.option("--npu-count", type=click.Choice(COUNTS), required=True,
              help="Devices to calibrate; every tier up to it (1, 2, 4, 8) is measured and projected.")
@click.option("--sizes", type=click.Choice(sorted(calibration.SIZES)), default=None,
              help="real: H3's width and 768p lengths (accelerators; refused on cpu). small: scaled down, "
                   "seconds on a CPU. Default: small on cpu, real elsewhere.")
@click.option("--repeats", type=click.IntRange(1, 100), help="Timed runs per measurement (median), after one warm-up.")
@click.option("--out", "out", type=click.Path(dir_okay=False), metavar="FILE",
              help="Where to write the JSON report (default <comfy-home>/.h3kit/calibration/<type>-n<N>-<sizes>.json).")
@click.option("--plot", type=click.Path(dir_okay=False), metavar="FILE",
              help="Also draw the report as a PNG (needs matplotlib in h3kit's interpreter).")
@click.option("--python", metavar="PY", type=click.Path(dir_okay=False),
              help="Interpreter that runs ComfyUI (default: the one install recorded).")
@click.option("--timeout", type=click.FloatRange(min=1), default=3600.0, show_default=True, metavar="S",
              help="Seconds before the measuring worker is killed.")
@json_option
@handle_errors
def calibrate(comfy_home, device_type, npu_count, sizes, repeats, out, plot, python, timeout, as_json):
    """Measure this machine's links, collectives and one DiT block, and project each tier.

    On the devices themselves: copy bandwidth between every pair and under concurrency (thread transport);
    the DiT's all-to-all and all-gather at the message sizes `h3kit plan` predicts (thread transport and
    processes over hccl / nccl / gloo); one DiT block at H3's width with random weights at the shard
    lengths of 768p/5 s and 768p/15 s for each tier. Then the projected forward time and speed-up of each
    tier. Writes a JSON report (`h3kit plan --calibration FILE` reads it) and, with --plot, a PNG.
    """
    sigterm_as_interrupt()  # the worker and its rank processes hold the devices: killed with us
    kind = h3devices.resolve_device_type(device_type)
    sizes = sizes or ("small" if kind == "cpu" else "real")
    cfg = calibration.config(kind, int(npu_count), sizes, repeats)
    if plot:
        from h3kit.runtime import calplot
        calplot.require()
    path = Path(out) if out else Path(comfy_home).resolve() / ".h3kit" / "calibration" / f"{kind}-n{npu_count}-{sizes}.json"
    err(f"h3kit: calibrating {npu_count} {kind} device(s), {sizes} sizes: {cfg['note']}")
    report = calibration.run(comfy_home, cfg, python=python, timeout=timeout)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    if plot:
        calplot.plot(report, plot)
    if as_json:
        emit_json(report)
    else:
        for line in format_report(report):
            click.echo(line)
    err(f"h3kit: report written to {path}" + (f", picture to {plot}" if plot else ""))


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_report(rep: dict) -> list:
    sim = " (simulated)" if rep["simulated"] else ""
    lines = [f"h3kit calibrate: {rep['npu_count']} {rep['device_type']} device(s){sim}, {rep['dtype']}, {rep['date']}",
             f"  {rep['note']}", ""]
    pairs = rep["copy"]["pairs"]
    if pairs:
        gbs = sorted(p["gbs"] for p in pairs)
        lines.append(f"copies, one pair at a time ({_mb(pairs[0]['bytes'])}, thread transport): "
                     f"{len(pairs)} pairs, {gbs[0]:.2f} to {gbs[-1]:.2f} GB/s (median {gbs[len(gbs) // 2]:.2f})")
        for r in rep["copy"]["ring"]:
            lines.append(f"copies, {r['world']} devices at once (ring): {r['gbs']:.2f} GB/s per device")
    skipped = rep["collectives"].get("process_skipped")
    head = f"{'collective':28} {'devices':>7} {'bytes/rank':>12} {'threads':>14} {'process':>14}"
    rows = [r for r in rep["collectives"]["threads"]]
    if rows:
        lines += ["", f"collectives at the message sizes h3kit plan predicts (process: {skipped or rep['backend']})", head]
        names = {"scatter": "all_to_all q/k/v", "gather": "all_to_all output", "final": "all_gather hidden"}
        for r in rows:
            p = next((q for q in rep["collectives"]["process"] if (q["op"], q["world"], q["geometry"]) ==
                      (r["op"], r["world"], r["geometry"])), None)
            pcell = f"{p['seconds'] * 1e3:8.2f} ms" if p else "-"
            lines.append(f"{r['geometry'] + ' ' + names[r['op']]:28} {r['world']:>7} {_mb(r['bytes']):>12} "
                         f"{r['seconds'] * 1e3:11.2f} ms {pcell:>14}")
    lines += ["", f"DiT block ({rep['dims']['hidden']} hidden, {rep['dims']['heads']}x{rep['dims']['head_dim']} heads), "
              "rank 0's shard of each tier", f"{'geometry':10} {'devices':>7} {'shard':>7} {'of S':>7} {'seconds':>10} "
              f"{'modeled':>10} {'TFLOP/s':>9}"]
    for b in rep["blocks"]:
        lines.append(f"{b['geometry']:10} {b['world']:>7} {b['shard']:>7} {b['seq_len']:>7} {b['seconds']:>10.4f} "
                     f"{b['modeled_seconds']:>10.4f} {b['tflops']:>9.3f}")
    fit = rep["fit"]
    lines += ["", f"fit: compute {fit['compute']['tflops_linear']:.3g} TFLOP/s (projections, MLP), "
              f"{fit['compute']['tflops_attention']:.3g} TFLOP/s (attention), within {fit['compute']['max_rel_err']:.0%}"]
    for transport, fits in fit["exchange"].items():
        parts = [f"{name} {f['gbs']:.3g} GB/s + {f['latency_s'] * 1e3:.2f} ms" for name, f in fits.items() if f]
        lines.append(f"     {transport}: {', '.join(parts)}")
    lines += ["", "projected forward (50 blocks: measured block + measured exchange) and speed-up vs 1 device"]
    for t in rep["tiers"]:
        cells = ", ".join(f"{tr} {t['forward_s'][tr]:.3g} s ({t['speedup'][tr]:.2f}x)" for tr in t["forward_s"])
        lines.append(f"  {t['geometry']:10} {t['world']} device(s): {cells}")
    lines.append("A step is one forward with the shipped workflows (BasicGuider); a CFG guider runs two.")
    if rep["device_type"] == "cpu":
        lines.append("cpu: every simulated device shares the host's cores; these figures show the method and this "
                     "host, not an accelerator's speed")
    return lines
