"""h3kit calibrate: measure this machine's links, collectives and one DiT block, and project every tier.

config()   what the worker measures: the model width (SIZES), the tiers (1, 2, 4 up to --npu-count), the two
           deployment geometries (costmodel.GEOMETRIES, lengths scaled by the size's length_scale)
run()      runs calibrate_worker.py in the ComfyUI interpreter and returns analyse()'s report
analyse()  pure arithmetic on the worker's raw timings: bandwidths, two fits (compute: seconds against the
           cost model's FLOPs, linear and attention parts; exchange: latency + bytes / bandwidth per
           transport and collective), and per geometry and tier the projected forward (50 blocks) and
           speed-up for each transport
apply()    a plan (costmodel.plan) turned into seconds with a report's fits: `h3kit plan --calibration`

No torch here: the worker measures, this module only reads numbers. The report is JSON (SCHEMA below).
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import socket
import statistics
from pathlib import Path

from h3kit import devices as h3devices
from h3kit.errors import H3kitError, UsageError
from h3kit.runtime import costmodel, worker

KIND = "h3kit-calibration"
SCHEMA = 1
WORKER = Path(__file__).with_name("calibrate_worker.py")
MIB = 1024 * 1024
BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
DTYPES = {"npu": "bf16", "cuda": "bf16", "cpu": "fp32"}
TRANSPORTS = ("threads", "process")
SIZES = {
    "real": {"hidden": 5376, "heads": 56, "head_dim": 128, "ffn": 14336, "t_dim": 2688, "length_scale": 1.0,
             "copy_bytes": 256 * MIB, "repeats": 3, "stage_timeout": 1800.0, "collective_timeout": 600.0,
             "note": "H3's real width (hidden 5376, 56 x 128 heads, ffn 14336, random weights) at the real "
                     "768p sequence lengths"},
    "small": {"hidden": 384, "heads": 8, "head_dim": 48, "ffn": 1024, "t_dim": 192, "length_scale": 1 / 32,
              "copy_bytes": 16 * MIB, "repeats": 5, "stage_timeout": 300.0, "collective_timeout": 120.0,
              "note": "scaled down for a quick run: hidden 384 (8 x 48 heads), ffn 1024, sequence lengths 1/32 of "
                      "768p's; the seconds are this small model's, not H3's"},
}
CPU_REAL_FLOPS = 0.2e12   # what a server CPU sustains on one fp32 block, generously: only to size the refusal


def config(device_type: str, npu_count: int, sizes: str, repeats: int | None = None) -> dict:
    """The worker's instructions (JSON-ready). Refuses --sizes real on cpu, naming the time and memory."""
    if device_type not in BACKENDS:
        raise UsageError(f"calibrate needs a device type (npu, cuda or cpu), not {device_type!r}")
    if npu_count not in h3devices.ALLOWED_COUNTS:
        raise UsageError(f"--npu-count {npu_count}: H3 runs on {', '.join(map(str, h3devices.ALLOWED_COUNTS))} devices")
    size = SIZES[sizes]
    dims = {k: size[k] for k in ("hidden", "heads", "head_dim", "ffn", "t_dim")}
    geometries = []
    for name, (w, h, f) in costmodel.GEOMETRIES.items():
        real = costmodel.packed_sequence(w, h, f)["seq_len"]
        geometries.append({"name": name, "width": w, "height": h, "frames": f, "seq_len_real": real,
                           "seq_len": max(npu_count * 8, round(real * size["length_scale"]))})
    if device_type == "cpu" and sizes == "real":
        longest = max(g["seq_len"] for g in geometries)
        flops = costmodel.flops_per_device(longest, 1, _model_cfg(dims))["total"]
        memory = longest * (dims["hidden"] * 2 + dims["heads"] * dims["head_dim"] * 4 + dims["ffn"] * 2) * 4
        raise UsageError(f"--sizes real on cpu: one H3 block at 768p/15 s alone is {flops / 1e12:.0f} TFLOP (about "
                         f"{flops / CPU_REAL_FLOPS / 3600:.1f} h per run on a fast CPU, several runs needed) and "
                         f"{memory / 1e9:.0f} GB of activations", code="real_on_cpu",
                         hint="use --sizes small on cpu (seconds, scaled down and said so in the report); "
                              "--sizes real is for NPUs and GPUs")
    return {"device_type": device_type, "npu_count": npu_count, "sizes": sizes, "dims": dims, "dtype": DTYPES[device_type],
            "backend": BACKENDS[device_type], "tiers": [c for c in h3devices.ALLOWED_COUNTS if c <= npu_count],
            "geometries": geometries, "repeats": repeats or size["repeats"], "copy_bytes": size["copy_bytes"],
            "stage_timeout": size["stage_timeout"], "collective_timeout": size["collective_timeout"],
            "note": size["note"]}


def _model_cfg(dims: dict) -> dict:
    return dict(costmodel.H3, blocks=1, hidden=dims["hidden"], heads=dims["heads"], head_dim=dims["head_dim"],
                ffn=dims["ffn"])


def run(comfy_home, cfg: dict, *, python: str | None = None, timeout: float = 3600.0) -> dict:
    """Measure (worker in the ComfyUI interpreter) and analyse; returns the report."""
    from h3kit import service
    from h3kit.runtime import parity  # the same patched-tree check as parity
    home = Path(comfy_home).resolve()
    parity.check_tree(home)
    py = service.resolve_python(home, python)
    service.require_torch(home, py, cfg.get("device_type", "cpu"), "calibration")
    raw = worker.run([py, str(WORKER), "--comfy-home", str(home), "--config", json.dumps(cfg)], timeout=timeout,
                     what="the calibration worker", timeout_code="calibrate_timeout")
    if not raw.get("ok"):
        error = raw.get("error") or {}
        raise H3kitError(f"calibration worker: {error.get('message', 'failed')}", code="calibrate_failed",
                         details={"traceback": (error.get("traceback") or "").splitlines()[-15:],
                                  "log_tail": raw.get("log_tail")},
                         hint="with --device-type npu|cuda, run h3kit doctor first")
    raw.pop("log_tail", None)
    return analyse(raw, cfg, python=py)


# ---- analysis ----------------------------------------------------------------------------------------------

def _gbs(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else math.inf


def predicted_bytes(cfg: dict, geometry: dict, world: int) -> dict:
    """Bytes each collective moves per the cost model: rank 0's share and the group's total (received)."""
    e = costmodel.DTYPE_BYTES[cfg["dtype"]]
    m = costmodel.exchange_messages(geometry["seq_len"], world, _model_cfg(cfg["dims"]))
    s, p, hp, d = m["sizes"], world, cfg["dims"]["heads"] // world, cfg["dims"]["head_dim"]
    total = {"scatter": sum(3 * (geometry["seq_len"] - x) * hp * d for x in s),
             "gather": sum((p - 1) * x * hp * d for x in s), "final": m["final"]}  # the final gather lands on rank 0 alone
    return {op: {"rank": m[op] * e, "group": total[op] * e} for op in ("scatter", "gather", "final")}


def fit_line(points: list) -> dict | None:
    """Least squares seconds = latency + bytes / bandwidth over (bytes, seconds) points."""
    points = [(x, t) for x, t in points if x > 0 and t > 0]
    if not points:
        return None
    xs = [x for x, _ in points]
    if len(set(xs)) > 1:
        mx, mt = statistics.fmean(xs), statistics.fmean(t for _, t in points)
        slope = sum((x - mx) * (t - mt) for x, t in points) / sum((x - mx) ** 2 for x in xs)
        latency = mt - slope * mx
    if len(set(xs)) < 2 or slope <= 0 or latency < 0:
        slope, latency = sum(t for _, t in points) / sum(xs), 0.0
    err = max(abs(latency + slope * x - t) / t for x, t in points)
    return {"latency_s": latency, "gbs": 1 / slope / 1e9, "points": len(points), "max_rel_err": err}


def line_seconds(fit: dict, nbytes: float) -> float:
    return 0.0 if nbytes <= 0 else fit["latency_s"] + nbytes / (fit["gbs"] * 1e9)


def fit_compute(blocks: list) -> dict:
    """seconds = linear FLOPs / R_linear + attention FLOPs / R_attention, fitted on relative error.

    Falls back to one throughput for all FLOPs when the two-term fit is degenerate (or gives a negative
    rate, which happens when every point has the same mix).
    """
    pts = [(b["flops_linear"], b["flops_attention"], b["seconds"]) for b in blocks if b["seconds"] > 0]
    sll = sum(lin * lin / t / t for lin, _, t in pts)
    sla = sum(lin * att / t / t for lin, att, t in pts)
    saa = sum(att * att / t / t for _, att, t in pts)
    slt = sum(lin / t for lin, _, t in pts)
    sat = sum(att / t for _, att, t in pts)
    det = sll * saa - sla * sla
    u = w = None
    if det > 1e-12 * sll * saa:
        u, w = (slt * saa - sat * sla) / det, (sat * sll - slt * sla) / det
    if u is None or u <= 0 or w <= 0:
        total = [(lin + att, t) for lin, att, t in pts]
        u = w = sum(f / t for f, t in total) / sum(f * f / t / t for f, t in total)
    modeled = [lin * u + att * w for lin, att, _ in pts]
    return {"tflops_linear": 1 / u / 1e12, "tflops_attention": 1 / w / 1e12,
            "max_rel_err": max(abs(m - t) / t for m, (_, _, t) in zip(modeled, pts))}


def compute_seconds(fit: dict, flops: dict) -> float:
    """Seconds for a cost-model FLOP split (costmodel.flops_per_device) at a fit's throughputs."""
    linear = flops["projections"] + flops["mlp"] + flops.get("final_layer", 0)
    return linear / (fit["tflops_linear"] * 1e12) + flops["attention"] / (fit["tflops_attention"] * 1e12)


def analyse(raw: dict, cfg: dict, *, python: str | None = None) -> dict:
    model = _model_cfg(cfg["dims"])
    geos = {g["name"]: g for g in cfg["geometries"]}
    collectives = {"threads": raw["threads"], "process": (raw["process"] or {}).get("rows", [])}
    wrong = []
    for transport, rows in collectives.items():
        for row in rows:
            want = predicted_bytes(cfg, geos[row["geometry"]], row["world"])[row["op"]]
            row["bytes"] = want["rank"]
            row["gbs"] = _gbs(want["rank"], row["seconds"])
            if row["bytes_counted"] != want[row["counted_for"]]:
                wrong.append(f"{transport} {row['op']} on {row['world']} devices at {row['geometry']}: moved "
                             f"{row['bytes_counted']} bytes ({row['counted_for']}), the plan says {want[row['counted_for']]}")
    if wrong:  # timing the wrong messages would calibrate the plan against something else
        raise H3kitError("the collectives did not move the bytes h3kit plan predicts: " + "; ".join(wrong[:4]),
                         code="bytes_mismatch", details=wrong,
                         hint="the installed tree's comfy/multinpu.py and h3kit's cost model disagree: "
                              "h3kit verify, and update h3kit and the tree together")
    blocks = []
    for b in raw["blocks"]:
        flops = costmodel.flops_per_device(b["seq_len"], b["world"], model)
        blocks.append(dict(b, flops_linear=flops["projections"] + flops["mlp"], flops_attention=flops["attention"],
                           tflops=(flops["total"] - flops["final_layer"]) / b["seconds"] / 1e12))
    compute = fit_compute(blocks)
    for b in blocks:
        b["modeled_seconds"] = compute_seconds(compute, {"projections": b["flops_linear"], "mlp": 0,
                                                         "attention": b["flops_attention"]})
    exchange = {}
    for transport, rows in collectives.items():
        if rows:
            exchange[transport] = {
                "all_to_all": fit_line([(r["bytes"], r["seconds"]) for r in rows if r["op"] != "final"]),
                "all_gather": fit_line([(r["bytes"], r["seconds"]) for r in rows if r["op"] == "final"])}
    report = {
        "kind": KIND, "schema": SCHEMA, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"host": socket.gethostname(), "platform": platform.platform(), "python": python,
                    "torch": raw.get("torch"), "device_name": raw.get("device_name")},
        "device_type": cfg["device_type"], "devices": raw["devices"], "simulated": raw["simulated"],
        "npu_count": cfg["npu_count"], "sizes": cfg["sizes"], "note": cfg["note"], "dims": cfg["dims"],
        "dtype": cfg["dtype"], "backend": cfg["backend"], "repeats": cfg["repeats"], "geometries": cfg["geometries"],
        "copy": {"pairs": [dict(p, gbs=_gbs(p["bytes"], p["seconds"])) for p in raw["copy"]["pairs"]],
                 "ring": [dict(r, gbs=_gbs(r["bytes"], r["seconds"])) for r in raw["copy"]["ring"]]},
        "collectives": {"threads": collectives["threads"], "process": collectives["process"],
                        "process_skipped": (raw["process"] or {}).get("skipped")},
        "blocks": blocks,
        "fit": {"compute": compute, "exchange": exchange},
        "elapsed_s": raw.get("elapsed_s"), "stage_s": raw.get("stage_s"),
    }
    report["tiers"] = project(report)
    return report


def project(report: dict) -> list:
    """Per geometry and tier: the measured block plus the measured exchange, over a 50-block forward."""
    blocks = costmodel.H3["blocks"]
    out = []
    for g in report["geometries"]:
        one = next(b for b in report["blocks"] if b["geometry"] == g["name"] and b["world"] == 1)
        base = blocks * one["seconds"]
        for b in [b for b in report["blocks"] if b["geometry"] == g["name"]]:
            row = {"geometry": g["name"], "world": b["world"], "block_s": b["seconds"], "forward_s": {}, "speedup": {},
                   "ideal_speedup": b["world"]}
            for transport in TRANSPORTS:
                if b["world"] == 1:
                    row["forward_s"][transport], row["speedup"][transport] = base, 1.0
                    continue
                ops = {r["op"]: r["seconds"] for r in report["collectives"][transport]
                       if r["geometry"] == g["name"] and r["world"] == b["world"]}
                if len(ops) == 3:
                    fwd = blocks * (b["seconds"] + ops["scatter"] + ops["gather"]) + ops["final"]
                    row["forward_s"][transport], row["speedup"][transport] = fwd, base / fwd
            out.append(row)
    return out


# ---- reading a report, and the calibrated plan -----------------------------------------------------------

def load(path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise UsageError(f"cannot read the calibration {path}: {e.strerror or e}", code="bad_calibration") from None
    except ValueError as e:
        raise UsageError(f"{path} is not JSON ({e})", code="bad_calibration") from None
    if not isinstance(data, dict) or data.get("kind") != KIND or data.get("schema") != SCHEMA \
            or not isinstance((data.get("fit") or {}).get("compute"), dict):
        raise UsageError(f"{path} is not an h3kit calibration report (schema {SCHEMA})", code="bad_calibration",
                         hint="pass the JSON that h3kit calibrate wrote (--out)")
    return data


def label(report: dict) -> str:
    sim = " simulated" if report.get("simulated") else ""
    return (f"{report['npu_count']}{sim} {report['device_type']} device(s), {report['sizes']} sizes, "
            f"{report['dtype']}, {report['date'][:10]}, {report['machine'].get('device_name') or report['machine']['host']}")


def apply(plan: dict, report: dict) -> dict:
    """Seconds per step for a costmodel.plan() result at a calibration's throughputs and bandwidths."""
    flops = plan["flops_per_device_forward"]
    forwards = plan["flops_per_device_step"] / flops["total"]
    compute = compute_seconds(report["fit"]["compute"], flops)
    e = costmodel.DTYPE_BYTES[plan["dtype"]]
    m = costmodel.exchange_messages(plan["seq_len"], plan["npu_count"])
    out = {"from": label(report), "from_cpu": report["device_type"] == "cpu", "forwards_per_step": forwards,
           "compute_s_step": forwards * compute,
           "exchange_s_step": {}, "step_s": {}}
    for transport, fits in report["fit"]["exchange"].items():
        if plan["npu_count"] == 1:
            exch = 0.0
        elif fits.get("all_to_all") and fits.get("all_gather"):
            exch = (costmodel.H3["blocks"] * (line_seconds(fits["all_to_all"], m["scatter"] * e)
                                             + line_seconds(fits["all_to_all"], m["gather"] * e))
                    + line_seconds(fits["all_gather"], m["final"] * e))
        else:
            continue
        out["exchange_s_step"][transport] = forwards * exch
        out["step_s"][transport] = forwards * (compute + exch)
    if not out["step_s"]:  # a one-device calibration has no exchange fits
        out["step_s"]["threads"] = forwards * compute
    return out


def apply_all(plans: list, one_device: dict, report: dict) -> None:
    """apply() to every plan, as plan["calibrated"], with the speed-up over `one_device` (the same
    configuration on 1 device) per transport."""
    base = apply(one_device, report)["step_s"]
    for p in plans:
        p["calibrated"] = apply(p, report)
        one = next(iter(base.values()))
        p["calibrated"]["speedup"] = {t: one / s for t, s in p["calibrated"]["step_s"].items()}
