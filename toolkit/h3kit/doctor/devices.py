"""doctor's driver, devices and memory checks: the driver tool's view of the cards, the devices torch sees as
`h3kit start` exposes them, and free memory against the cost model's need per tier."""

from __future__ import annotations

from h3kit import devices as h3devices
from h3kit import smi
from h3kit.doctor.base import GB, Doctor
from h3kit.runtime import costmodel


def check_driver(d: Doctor) -> dict | None:
    if d.kind == "cpu":
        return None
    tool = "npu-smi" if d.kind == "npu" else "nvidia-smi"
    answer = smi.query(d.kind)
    if answer is None:
        d.add("driver", "warning", f"{tool} is not on PATH: the driver's own view of the cards is missing",
              f"install the {'Ascend driver (npu-smi comes with it)' if d.kind == 'npu' else 'NVIDIA driver'}"
              f" or add its bin folder to PATH")
        return None
    if answer.get("error"):
        d.add("driver", "error", answer["error"], f"check that the driver is loaded: {tool} must list the cards")
        return None
    d.facts["driver"] = answer
    names = sorted({card["name"] for card in answer["devices"]})
    d.add("driver", "ok", f"{tool} {answer.get('version')}: {len(answer['devices'])} device(s) "
          f"({', '.join(names)})")
    for i, card in enumerate(answer["devices"]):
        health = card.get("health", "OK")
        if health != "OK" and (d.requested is None or i in d.requested):
            d.add("driver", "warning" if health == "Warning" else "error",
                  f"{tool}: device {i} ({card.get('name')}) reports health {health}",
                  f"see `{tool} info -t health -i {card.get('npu', i)}` and the driver's log before using it")
    return answer


def check_devices(d: Doctor, info: dict | None, smi_info: dict | None):
    if d.kind == "cpu":
        n = len(d.requested) if d.requested else None
        d.add("devices", "info", "cpu: devices are simulated (H3KIT_SIM_DEVICES), every rank runs on the host"
              + (f"; {n} asked" if n else ""))
        return
    var = h3devices.VISIBLE_ENV[d.kind]
    if d.opts.devices is not None and d.env.get(var) and d.env[var] != d.opts.devices:
        d.add("devices", "warning", f"this shell sets {var}={d.env[var]}, but --devices is {d.opts.devices}: "
              "h3kit start exposes --devices, while parity, calibrate and scripts run from this shell see "
              f"{d.env[var]}", f"unset {var}, or set it to {d.opts.devices}")
    seen = (info or {}).get("devices") or {}
    listed = len(smi_info["devices"]) if smi_info else None
    if d.requested is not None and listed is not None:
        missing = [i for i in d.requested if i >= listed]
        if missing:
            d.add("devices", "error", f"device id(s) {', '.join(map(str, missing))} do not exist: "
                  f"{'npu-smi' if d.kind == 'npu' else 'nvidia-smi'} lists {listed} device(s)",
                  f"use ids 0..{listed - 1} in --devices")
    if seen.get("error") or "count" not in seen:
        if info is not None and (info.get("torch_import") or {}).get("ok"):
            d.add("devices", "error", f"torch sees no {d.kind} device: {seen.get('error', 'no answer')}",
                  "fix the torch / driver findings above first")
        return
    count = seen["count"]
    shown = f"{var}={','.join(map(str, d.requested))}" if d.requested is not None else f"{var} unset"
    if d.requested is not None and count < len(d.requested):
        d.add("devices", "error", f"{len(d.requested)} device(s) asked ({d.requested_from}), but torch sees "
              f"only {count} with {shown}", "check the ids against npu-smi info / nvidia-smi; a busy or "
              "unhealthy card, or a container exposing fewer cards, shows this way")
    elif count == 0:
        d.add("devices", "error", f"torch sees no {d.kind} device ({shown})", "check the driver findings")
    else:
        names = sorted({card.get("name") or "?" for card in seen["list"]})
        d.add("devices", "ok", f"torch sees {count} {d.kind} device(s) with {shown}: {', '.join(names)}")


def check_memory(d: Doctor, info: dict | None, smi_info: dict | None):
    if d.kind == "cpu":
        return
    free = device_free_memory(d.kind, (info or {}).get("devices"), smi_info, d.requested)
    if not free:
        d.add("memory", "warning", "free device memory is unknown (torch and the driver tool could not say)",
              "fix the findings above; doctor then compares it with what each tier needs")
        return
    d.facts["free_memory"] = free
    verdicts = tier_memory(free)
    d.facts["tiers"] = verdicts
    lines = [f"{v['npu_count']} device(s), {v['geometry']}: needs {v['need_bf16'] / GB:.1f} GB at BF16, "
             f"{v['need_int8'] / GB:.1f} GB with INT8 weights"
             + (f" (sharded: {v['need_bf16_sharded'] / GB:.1f} / {v['need_int8_sharded'] / GB:.1f} GB)"
                if v["npu_count"] > 1 else "")
             + (f", device 0's including the server's share {v['server_share'] / GB:.1f} GB"
                if v["server_share"] else "")
             + f"; smallest free {v['free'] / GB:.1f} GB: {v['verdict']}" for v in verdicts]
    mine = [v for v in verdicts if v["npu_count"] == max(v["npu_count"] for v in verdicts)]
    short = next((v for v in mine if v["geometry"] == "768p/5s"), mine[0])
    held = " (the service holds memory on them now)" if d.service and d.service.get("running") else ""
    if short["verdict"] == "does not fit":
        d.add("memory", "error", f"{short['npu_count']} device(s) at {short['geometry']}: even INT8 weights "
              f"need {short['need_int8'] / GB:.1f} GB, the devices have {short['free'] / GB:.1f} GB free{held}",
              "free the cards (other processes: npu-smi info / nvidia-smi) or use cards with more memory",
              lines)
    elif short["verdict"] != "fits":
        d.add("memory", "warning", f"{short['npu_count']} device(s) at {short['geometry']}: BF16 needs "
              f"{short['need_bf16'] / GB:.1f} GB per device, {short['free'] / GB:.1f} GB free{held}: "
              f"{short['verdict']}", "set weights sharded on MultiNPUParallelConfig (auto does it where a "
              "replica does not fit), use INT8 DiT weights, or rely on ComfyUI's partial loading (slower); "
              "docs/deployment.md section 2, 'Tiers' (h3kit plan --tiers)", lines)
    else:
        d.add("memory", "ok", f"every tier up to {short['npu_count']} device(s) fits 768p/5 s at BF16", lines=lines)


# ---- pieces with their own tests -------------------------------------------------------------------------------------

def device_free_memory(kind: str, probed: dict | None, smi_info: dict | None, requested: list | None) -> list:
    """Free bytes per exposed device in rank order: torch's mem_get_info, else the driver tool's figures."""
    listed = [d for d in (probed or {}).get("list", []) if d.get("free") is not None]
    if listed:
        return [d["free"] for d in listed]
    devs = (smi_info or {}).get("devices") or []
    ids = requested if requested is not None else range(len(devs))
    out = []
    for i in ids:
        if i < len(devs):
            d = devs[i]
            free = d.get("free") if d.get("free") is not None else (
                d["total"] - d["used"] if d.get("total") is not None and d.get("used") is not None else None)
            if free is not None:
                out.append(free)
    return out


def tier_memory(free: list) -> list:
    """Per tier (1, 2, 4 devices, as many as there are) and per geometry: the DiT's need per device at BF16
    and with INT8 weights (activations at BF16) against the smallest free memory among the tier's devices."""
    out = []
    for n in [c for c in h3devices.ALLOWED_COUNTS if c <= len(free)]:
        smallest = min(free[:n])
        for name, (w, h, f) in costmodel.GEOMETRIES.items():
            seq = costmodel.packed_sequence(w, h, f)["seq_len"]
            server = costmodel.server_share(w, h, n)["total"]  # the server's own work on device 0 beside rank 0
            mem = costmodel.memory_per_device(seq, n, "bf16", server=server)
            act = mem["total"] - mem["weights"]  # activations, the HCCL communicators' buffers, the server's share
            bf16, int8 = costmodel.weight_bytes("bf16") + act, costmodel.weight_bytes("int8") + act
            sharded = {wt: costmodel.memory_per_device(seq, n, "bf16", weights=wt, sharding="sharded",
                                                       server=server)["total"] for wt in ("bf16", "int8")}
            verdict = ("fits" if bf16 <= smallest else "INT8 weights fit; BF16 only with partial loading"
                       if int8 <= smallest else "BF16 and INT8 only with partial loading" if act < smallest
                       else "does not fit")
            out.append({"npu_count": n, "geometry": name, "seq_len": seq, "server_share": server,
                        "need_bf16": bf16, "need_int8": int8,
                        "need_bf16_sharded": sharded["bf16"], "need_int8_sharded": sharded["int8"],
                        "free": smallest, "verdict": verdict})
    return out
