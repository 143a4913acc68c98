"""parity and plan: the click layer over h3kit.runtime.parity and h3kit.runtime.costmodel.

Exit codes: 0 parity within the gate / plan printed, 1 a parity row missed its gate or the run failed,
2 bad input (including an --npu-count the machine does not have).
"""

from __future__ import annotations

import click

from h3kit import devices as h3devices
from h3kit.cliutil import sigterm_as_interrupt, comfy_home_option, emit_json, err, handle_errors, json_option
from h3kit.errors import UsageError
from h3kit.runtime import calibration as calibration_lib
from h3kit.runtime import costmodel
from h3kit.runtime import parity as parity_lib

COUNTS = [str(c) for c in h3devices.ALLOWED_COUNTS]


@click.command()
@comfy_home_option()
@click.option("--component", type=click.Choice(parity_lib.COMPONENTS), default="dit", show_default=True,
              help="What to compare: dit = the diffusion transformer (sequence parallel), te = the text "
                   "encoder (tensor parallel, and the layer split), vae = the video VAE decode (chunks across "
                   "devices) and the audio VAE (one device).")
@click.option("--device-type", type=click.Choice(("auto",) + h3devices.DEVICE_TYPES), default="auto",
              show_default=True, help="auto picks npu, then cuda, then cpu (cpu simulates the devices).")
@click.option("--npu-count", type=click.Choice(COUNTS), required=True, help="Devices for the parallel run.")
@click.option("--transport", type=click.Choice(parity_lib.TRANSPORTS), default="threads", show_default=True,
              help="threads: the ranks are threads of one process; process: one process per device in a "
                   "torch.distributed group (gloo on cpu, hccl on npu, nccl on cuda), as h3kit start runs them.")
@click.option("--python", metavar="PY", type=click.Path(dir_okay=False),
              help="Interpreter that runs ComfyUI (default: the one install recorded).")
@click.option("--inject-fault", "fault", is_flag=False, flag_value="", default=None, metavar="[FAULT]",
              help="Make the parallel path wrong on purpose; the command must then exit 1. dit: shard (default: "
                   "the last device's shard zeroed in the final gather), rope (RoPE rows off by one on devices > 0), "
                   "heads (two heads swapped inside the Ulysses all-to-all), noise (1e-4 relative noise on one "
                   "device's attention output), noise-attention / noise-mlp (1e-6 relative noise on one device's "
                   "attention / MLP output, fp32 rows), lora-twice / lora-missing (on the last device), shard-offset (the last "
                   "device's slice of block 0 taken 4 bytes off), shard-order (two slices of block 0 swapped in the "
                   "last device's gather); te: reduce (one "
                   "device's share left out of the reductions and hand-overs); vae: chunks (other devices' chunks "
                   "zeroed).")
@click.option("--timeout", type=click.FloatRange(min=1), default=parity_lib.DEFAULT_TIMEOUT, show_default=True,
              metavar="S", help="Seconds before the worker is killed.")
@click.option("--weights", type=click.Choice(parity_lib.WEIGHTS), default="float", show_default=True,
              help="dit only: int8 runs the rows on the tiny DiT with its block linears in INT8 (ConvRot, as the "
                   "published H3 INT8 files), through the NPU INT8 arm (its reference kernels on cpu).")
@json_option
@handle_errors
def parity(comfy_home, component, device_type, npu_count, transport, python, fault, timeout, weights, as_json):
    """Compare a multi-device run with one device (tiny random weights).

    dit: samples a tiny random-weight H3 DiT two steps with CFG on one device and through the
    MultiNPUParallelConfig node on --npu-count devices, for the t2va, fl2va and ref2va layouts (Ulysses
    and K/V-gather attention each), in fp32, in bf16 and with a random LoRA, and compares the video and
    the audio output of every forward, also with a user attention override. Gate on cpu: max_abs == 0 on
    each (the split is exact there); on npu/cuda: max_rel <= 4 x the floor one device measures on itself (the
    same sampling again, and with another attention backend), printed with the rows (unmeasured on hardware).
    Each device counts on itself that it ran every block of every forward, received the cost model's bytes,
    computed with the LoRA'd weights exactly once and called the attention override.

    te: encodes a prompt alone, with a first-frame image and with image/video/audio references through
    a tiny Qwen3-VL text encoder loaded by CLIPLoader, tensor-parallel through the node and split by
    layers, from an fp32 and a bf16 checkpoint (upstream computes the text encoder in fp32 either way).
    Gate: max_rel <= 1e-5, cos >= 0.99999 and rel_rms <= 1e-4, every rank's hidden states identical; a
    text encoder with a LoRA passes through the node to one device, unchanged.

    vae: decodes latents of 1 to 27 frames (1 to 5 temporal chunks) with a tiny video VAE loaded by
    VAELoader, and an audio latent. Gate: max_abs == 0 (bit-identical).

    --weights int8 (dit): the same rows with the tiny DiT in INT8, both sides through the NPU INT8 arm. Gate: the
    dit gate, and both sides called the arm in W8A8 and W8A16.

    te and vae rows also count the weight-file reads (weight_reads, must be 1). On a new NPU machine
    these are the acceptance checks: h3kit parity --component dit|te|vae --device-type npu --npu-count 4.
    """
    sigterm_as_interrupt()  # terminated like Ctrl-C: the worker, which holds the devices, is killed too
    n = int(npu_count)
    if fault == "":
        fault = parity_lib.FAULTS[component][0]
    # refused before the device probe, whatever the machine
    parity_lib.check_request(component, n, fault, weights, transport)
    kind = h3devices.resolve_device_type(device_type)
    err(f"h3kit: parity of {component}{' (INT8 weights)' if weights == 'int8' else ''} on {n} {kind} device(s) "
        f"({transport}){f' with the injected fault {fault}' if fault else ''}")
    report = parity_lib.run(comfy_home, component, kind, n, python=python, fault=fault, timeout=timeout,
                            weights=weights, transport=transport)
    rows = report["rows"]
    failed = [r for r in rows if not r["pass"]]
    if as_json:
        emit_json(rows, ok=not failed)
    else:
        _print_rows(rows, report["config"], component)
    if failed:
        err(f"h3kit: parity FAILED: {len(failed)} of {len(rows)} row(s) miss "
            f"{parity_lib.gate(component, weights, kind)}")
        raise SystemExit(1)
    err(f"h3kit: parity passed: {len(rows)} row(s) within {parity_lib.gate(component, weights, kind)}")


def _print_rows(rows, config, component):
    devices = ", ".join(config.get("devices", []))
    if component == "dit":
        int8 = config.get("weights") == "int8"
        click.echo(f"{component}: {', '.join(config.get('dtypes', []))}, {config.get('steps')} steps, "
                   f"cfg {config.get('cfg')}, devices {devices}, transport {config.get('transport')}"
                   + (", INT8 weights" if int8 else ""))
        click.echo(f"gate: {config.get('gate')}")
        for key, floor in (config.get("floor") or {}).items():
            click.echo(f"floor {key}: one device against itself run again {floor['run_to_run']:.3g}, with another "
                       f"attention backend {floor['attention_variant']:.3g}")
        click.echo(f"{'layout':8} {'attention':10} {'dtype':9} {'with':8} {'weights':10} {'S':>5} {'fwd':>4} "
                   f"{'max_abs':>10} {'max_rel':>10} {'floor':>9} {'worst':17} {'vs_repl':>8} {'bytes/rank (=plan)':24} "
                   f"{'fwd/rank':10} {'LoRA|override/rank':18}  gate" + ("  INT8 calls (parallel side)" if int8 else ""))
        for r in rows:
            calls = ", ".join(f"{k} {v}" for k, v in r.get("int8_calls_parallel", {}).items())
            vs = r.get("max_abs_vs_replicated")
            floor = max(r["floor"].values()) if r.get("floor") else None
            extra = "LoRA" if r["lora"] else "override" if r.get("attention_override") else "-"
            received = [b - w for b, w in zip(r["bytes_received"], r["weight_bytes_received"])]
            plan = "=" if received == r.get("bytes_received_plan") else "!="
            # what each rank measured on itself: its LoRA verdict, or its calls of the user's attention override
            per_rank = r.get("lora_ranks") or r.get("override_calls")
            lora = ",".join(str(v) for v in per_rank) if per_rank else "-"
            click.echo(f"{r['layout']:8} {r['attention']:10} {r['dtype']:9} {extra:8} {r.get('sharding') or '-':10} "
                       f"{r['seq_len']:>5} {r['forwards']:>4} {r['max_abs']:>10.3g} {r['max_rel']:>10.3g} "
                       f"{'-' if floor is None else f'{floor:.3g}':>9} {r['worst']:17} "
                       f"{'-' if vs is None else f'{vs:.3g}':>8} {','.join(map(str, received)) + ' ' + plan:24} "
                       f"{','.join(map(str, r['rank_forwards'])):10} {lora:18}  {_verdict(r)}"
                       + (f"  {calls or 'none'}" if int8 else ""))
        return
    click.echo(f"{component}: {', '.join(config.get('dtypes', [config.get('dtype', '')]))}, devices {devices}, "
               f"weight files read: {', '.join(f'{k} {v}' for k, v in config.get('reads', {}).items())}")
    if component == "te":
        head = f"{'layout':8} {'split':7} {'dtype':9} {'S':>4}"
        cells = lambda r: f"{r['layout']:8} {r['mode']:7} {r['dtype']:9} {r['tokens']:>4}"  # noqa: E731
    else:
        head = f"{'layout':8} {'frames':>6} {'chunks':>6}"
        cells = lambda r: f"{r['layout']:8} {r['frames']:>6} {r['chunks']:>6}"  # noqa: E731
    click.echo(f"{head} {'max_abs':>10} {'max_rel':>10} {'cos':>12} {'rel_rms':>10} {'reads':>5} {'bytes':>9}  gate")
    for r in rows:
        click.echo(f"{cells(r)} {r['max_abs']:>10.3g} {r['max_rel']:>10.3g} {r['cos']:>12.9f} {r['rel_rms']:>10.3g} "
                   f"{r['weight_reads']:>5} {r['bytes_moved']:>9}  {_verdict(r)}")


def _verdict(row) -> str:
    return "pass" if row["pass"] else f"FAIL: {'; '.join(row.get('failed') or ['gate'])}"


@click.command()
@click.option("--width", type=click.IntRange(min=32), help="Video width in pixels (a multiple of 32); with --tiers default H3's canvas, 1344x768, 124 frames.")
@click.option("--height", type=click.IntRange(min=32), help="Video height in pixels (a multiple of 32); with --tiers default H3's canvas, 1344x768, 124 frames.")
@click.option("--frames", type=click.IntRange(min=1), help="Frame count at 24 fps (snapped up to 17k+5); with --tiers default H3's canvas, 1344x768, 124 frames.")
@click.option("--npu-count", type=click.Choice(COUNTS), multiple=True,
              help="Devices; repeat the option to compare (--npu-count 1 --npu-count 2 --npu-count 4). Required "
                   "but with --tiers, where it picks the tiers shown (default: all).")
@click.option("--text-tokens", type=click.IntRange(min=1), default=costmodel.DEFAULT_TEXT_TOKENS, show_default=True,
              help="Prompt length in Qwen tokens (an assumption: it shifts the sequence by that much).")
@click.option("--keyframes", type=click.Choice(["0", "1", "2"]), default="0", show_default=True,
              help="fl2va keyframes (first and/or last frame), each adding one latent frame of tokens.")
@click.option("--guide", "guide_frames", type=click.IntRange(min=1), multiple=True, metavar="FRAMES",
              help="A MiniMaxH3AddGuide image (1) or clip (17k+5 frames) anchored in the video: its latent frames "
                   "join the sequence. Repeat it for chained guides.")
@click.option("--guide-audio", type=click.FloatRange(min=0, min_open=True), multiple=True, metavar="SECONDS",
              help="A MiniMaxH3AddGuide audio anchor of that many seconds (cropped to the video): two rows per "
                   "audio latent join the sequence. Repeatable.")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True)
@click.option("--cfg", "guider", flag_value="cfg", default="basic",
              help="A CFG guider (CFGGuider, KSampler with cfg > 1): two forwards per step, cond and uncond. "
                   "Default: BasicGuider, one forward per step (H3 is CFG-distilled; every upstream H3 template "
                   "and h3kit's workflows use it).")
@click.option("--tflops", type=click.FloatRange(min=0, min_open=True), metavar="T",
              help="Effective TFLOP/s per device (from a calibration run) to predict compute seconds per step.")
@click.option("--link-gbs", type=click.FloatRange(min=0, min_open=True), metavar="B",
              help="Effective exchange GB/s per device to predict exchange seconds per step.")
@click.option("--calibration", type=click.Path(dir_okay=False), metavar="FILE",
              help="A report from h3kit calibrate: seconds per step and speed-up from its measured throughputs "
                   "and bandwidths (instead of --tflops / --link-gbs).")
@click.option("--weights", type=click.Choice(["bf16", "int8"]), default=None,
              help="DiT weight storage: bf16 (default: --dtype), or int8 (INT8 block and refiner linears, the rest "
                   "at --dtype; docs/int8.md).")
@click.option("--sharding", type=click.Choice(costmodel.SHARDINGS), default="replicated", show_default=True,
              help="replicated: every device holds the whole DiT; sharded: every device keeps 1/N of each block's "
                   "weights and gathers each block per forward (the node's weights input).")
@click.option("--device-memory", type=click.FloatRange(min=0, min_open=True), metavar="GB", multiple=True,
              help="Memory of one card in GB (64 for a 910B, 32 for a 910B4): whether each tier fits and its "
                   "headroom. Repeat it with --tiers for one table per card size.")
@click.option("--tiers", is_flag=True,
              help="Print the tier table (1/2/4/8 devices, or those --npu-count names, x BF16/INT8 x "
                   "replicated/sharded, one column per --device-memory, default 64 and 32 GB) in markdown, for "
                   "this geometry (docs/deployment.md).")
@json_option
@handle_errors
def plan(width, height, frames, npu_count, text_tokens, keyframes, guide_frames, guide_audio, dtype, guider, tflops,
         link_gbs, calibration, weights, sharding, device_memory, tiers, as_json):
    """Print the sequence-parallel cost model for a resolution and device count.

    For the real H3 DiT (50 blocks, hidden 5376, 56x128 heads, ffn 14336): the packed sequence, tokens
    per device, FLOPs per device, bytes exchanged per block and per step (one forward per step with
    BasicGuider, two with --cfg), and memory per device: the DiT weights (replicated: the whole DiT;
    --sharding sharded: 1/N of every block plus two gathered blocks; --weights int8) plus estimated
    activations, with --device-memory whether it fits a card and the headroom, and the extra bytes the
    sharded weights' gathers move per step.
    """
    counts = sorted({int(c) for c in npu_count})
    canvas = {"--width": width, "--height": height, "--frames": frames}
    if tiers:  # H3's own canvas (768p/5 s) for what is not given
        width, height, frames = (v if v is not None else d
                                 for v, d in zip(canvas.values(), costmodel.GEOMETRIES["768p/5s"]))
    elif any(v is None for v in canvas.values()):
        missing = [k for k, v in canvas.items() if v is None]
        raise click.UsageError(f"Missing option{'s' if len(missing) > 1 else ''} {', '.join(missing)} (or --tiers, "
                               "which defaults to H3's canvas, 1344x768, 124 frames).")
    if not counts and not tiers:
        raise click.UsageError("Missing option '--npu-count' (or --tiers, which shows every device count).")
    if calibration and (tflops or link_gbs):
        raise UsageError("--calibration replaces --tflops and --link-gbs", hint="give one or the other")
    measured = calibration_lib.load(calibration) if calibration else None
    memory = device_memory[0] if device_memory else None
    guides = tuple((f, 0) for f in guide_frames) + tuple((0, a) for a in guide_audio)
    try:
        if tiers:
            memories = list(device_memory) or [64.0, 32.0]
            rows = tier_rows(width, height, frames, text_tokens, int(keyframes), guider, memories,
                             counts=counts or None, guides=guides)
            if as_json:
                emit_json({"width": width, "height": height, "frames": costmodel.align_frame_count(frames),
                           "tiers": rows})
            else:
                click.echo(tier_table(rows, memories))
            return
        plans = [costmodel.plan(width, height, frames, n, text_tokens=text_tokens, keyframes=int(keyframes),
                                guides=guides, dtype=dtype, tflops=tflops, link_gbs=link_gbs, guider=guider, weights=weights,
                                sharding=sharding, device_memory_gb=memory) for n in counts]
    except ValueError as e:
        raise UsageError(str(e), hint="H3 needs width and height in multiples of 32 (e.g. 1344x768, 736 not 720)")
    if measured is not None:
        one = costmodel.plan(width, height, frames, 1, text_tokens=text_tokens, keyframes=int(keyframes), dtype=dtype,
                             guider=guider, guides=guides)
        calibration_lib.apply_all(plans, one, measured)
    if as_json:
        emit_json({"model": costmodel.H3, "plans": plans})
        return
    for line in format_plans(plans) + (calibrated_lines(plans) if measured is not None else []):
        click.echo(line)


def _si(x, unit):
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def format_plans(plans) -> list:
    p0 = plans[0]
    seg = p0["segments"]
    lt, lh, lw = p0["latent"]
    lines = [
        f"MiniMax H3 DiT, {p0['width']}x{p0['height']}, {p0['frames']} frames, {p0['dtype']}, "
        f"{'fl2va, %d keyframe(s)' % p0['keyframes'] if p0['keyframes'] else 't2va'}"
        f"{', %d AddGuide anchor(s)' % len(p0['guides']) if p0['guides'] else ''}, "
        f"{'BasicGuider, 1 forward' if p0['forwards_per_step'] == 1 else 'CFG guider, 2 forwards'} per step",
        f"latents: video {lt}x{lh}x{lw} (T x H x W), audio {p0['audio_latents']} x 2 channels; "
        f"text {p0['text_tokens']} tokens (assumed)",
        f"packed sequence S = {p0['seq_len']} tokens: text {seg['text']}, cond {seg['cond']}, "
        f"cond_audio {seg['cond_audio']}, audio {seg['audio']}, video {seg['video']}",
        "",
    ]

    def row(label, fn):
        lines.append(f"{label:38}" + "".join(f"{fn(p):>16}" for p in plans))

    row("", lambda p: f"{p['npu_count']} device{'s' if p['npu_count'] > 1 else ''}")
    row("tokens per device (largest shard)", lambda p: str(max(p["tokens_per_device"])))
    row("attention exchange", lambda p: p["attention"])
    row("FLOPs per device per step", lambda p: _si(p["flops_per_device_step"], "FLOP"))
    per_step = lambda p, part: p["flops_per_device_forward"][part] * p["forwards_per_step"]  # noqa: E731
    row("  of which attention", lambda p: _si(per_step(p, "attention"), "FLOP"))
    row("  of which MLP", lambda p: _si(per_step(p, "mlp"), "FLOP"))
    row("exchanged per block (all devices)", lambda p: _si(p["bytes_per_block"], "B"))
    row("exchanged per step (all devices)", lambda p: _si(p["bytes_per_step"], "B"))
    row("exchanged per step (busiest device)", lambda p: _si(p["bytes_per_device_step"], "B"))
    row(f"weights per device ({p0['weights']}, {p0['sharding']})", lambda p: _si(p["memory_per_device"]["weights"], "B"))
    if p0["sharding"] == "sharded":
        row("  resident slices and the rest", lambda p: _si(p["memory_per_device"]["weights_resident"], "B"))
        row("  two gathered blocks", lambda p: _si(p["memory_per_device"]["weights_gathered"], "B"))
    _link_rows(row)
    row("activations per device (estimate)", lambda p: _si(p["memory_per_device"]["activations"], "B"))
    row("memory per device (device 0)", lambda p: _si(p["memory_per_device"]["total"], "B"))
    if "fit" in p0:
        row(f"fits a {p0['fit']['device_memory'] / 1e9:g} GB card (headroom)", lambda p: _fit_cell(p["fit"]))
    if p0["sharding"] == "sharded":
        row("weight gathers per step (per device)", lambda p: _si(p["weight_bytes_per_device_step"], "B"))
        row("weight gathers per step (all devices)", lambda p: _si(p["weight_bytes_per_step"], "B"))
    if "seconds_compute_step" in p0:
        row("compute per step (at --tflops)", lambda p: f"{p['seconds_compute_step']:.2f} s")
    if "seconds_exchange_step" in p0:
        row("exchange per step (at --link-gbs)", lambda p: f"{p['seconds_exchange_step']:.2f} s")
    lines.append("")
    if p0["forwards_per_step"] == 1:
        lines.append("A step is one forward (BasicGuider: H3 is CFG-distilled; pass --cfg for a CFG guider, two "
                     "forwards).")
    else:
        lines.append("A step is two forwards (--cfg: the guider runs cond and uncond separately).")
    if p0["sharding"] == "sharded":
        lines.append("Sharded weights: each of N devices keeps 1/N of every DiT block and all-gathers each block once "
                     "per forward (one device holds the whole DiT).")
    else:
        lines.append("Every device holds the full DiT weights (--sharding sharded keeps 1/N of each block per device).")
    return lines + _link_notes(plans)


def _link_rows(row):
    """The links' rows of the plan table (issue 45): HCCL buffers and pairs on device 0, the server's share."""
    row("HCCL buffers, device 0 (2 groups + pairs)", lambda p: _si(p["memory_per_device"]["communicators"], "B"))
    row("  pair communicators (device 0 / most)",
        lambda p: f"{p['pair_communicators'][0]} / {max(p['pair_communicators'])}" if p["npu_count"] > 1 else "-")
    row("  largest message (group / side)",
        lambda p: " / ".join(_si(v, "B") for v in p["hccl"]["largest_message"].values()))
    row("  HCCL buffer to hold it (MB)",
        lambda p: "{group} / {side}".format(**p["hccl"]["buffsize_mb"]) if p["npu_count"] > 1 else "-")
    row("server's share of device 0", lambda p: _si(p["memory_per_device"]["server_share"], "B"))


def _link_notes(plans) -> list:
    """The per-group HCCL buffers to export, and what device 0's figures include (docs/multinpu.md, "Links, buffers
    and the HCCL settings in force"; unmeasured on hardware)."""
    several = [p for p in plans if p["npu_count"] > 1]
    if not several:
        return []
    return ["Memory per device is device 0's: it holds the most pair communicators (send/recv pairs formed at join, "
            "2 x 20 MB each) and the server's share (text encoder embeddings and vision tower, VAE encoder and encode; "
            "estimates).",
            "HCCL buffers sized to the largest message of each group (each takes 2 x its size on every device; "
            "unmeasured on hardware): "
            + "; ".join(f"{p['npu_count']} devices: export {p['hccl']['env']}" for p in several)]


def _fit_cell(f) -> str:
    return f"yes, {_si(f['headroom'], 'B')}" if f["fits"] else f"no, -{_si(-f['headroom'], 'B')}"


TIER_COUNTS = (1, 2, 4, 8)


def tier_rows(width, height, frames, text_tokens=costmodel.DEFAULT_TEXT_TOKENS, keyframes=0, guider="basic",
              memories=(64.0, 32.0), counts=None, guides=()) -> list:
    """Every tier (1/2/4/8 devices, or only `counts`, x bf16/int8 weights x replicated/sharded) of one
    geometry: its memory per device, whether it fits each card size, and the weight gathers per step."""
    rows = []
    for n in counts or TIER_COUNTS:
        for weights in ("bf16", "int8"):
            for sharding in costmodel.SHARDINGS if n > 1 else ("replicated",):
                p = costmodel.plan(width, height, frames, n, text_tokens=text_tokens, keyframes=keyframes,
                                   guides=guides, guider=guider, weights=weights, sharding=sharding)
                need = p["memory_per_device"]["total"]
                rows.append({"npu_count": n, "weights": weights, "sharding": sharding, "memory_per_device": need,
                             "weights_per_device": p["memory_per_device"]["weights"],
                             "activations": p["memory_per_device"]["activations"],
                             "weight_bytes_per_device_step": p["weight_bytes_per_device_step"],
                             "bytes_per_device_step": p["bytes_per_device_step"],
                             "fit": {f"{m:g}": costmodel.fit(need, m) for m in memories}})
    return rows


def tier_table(rows: list, memories) -> str:
    """The markdown table of tier_rows (docs/deployment.md carries it)."""
    head = ("| devices | weights | sharding | weights / device | activations | exchange / step | weight gathers / step | "
            + " | ".join(f"{m:g} GB card" for m in memories) + " |")
    lines = [head, "|" + " --- |" * (7 + len(memories))]
    for r in rows:
        cells = [str(r["npu_count"]), r["weights"].upper(), r["sharding"], _si(r["weights_per_device"], "B"),
                 _si(r["activations"], "B"), _si(r["bytes_per_device_step"], "B") if r["npu_count"] > 1 else "-",
                 _si(r["weight_bytes_per_device_step"], "B") if r["sharding"] == "sharded" else "-"]
        cells += [_fit_cell(r["fit"][f"{m:g}"]) for m in memories]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _secs(x: float) -> str:
    return f"{x:.3g} s" if x < 1000 else f"{x / 60:.3g} min" if x < 36000 else f"{x / 3600:.3g} h"


def calibrated_lines(plans) -> list:
    """The plan's seconds from a calibration report (h3kit calibrate), one column per device count."""
    lines = [f"calibrated from: {plans[0]['calibrated']['from']}"]
    if plans[0]["calibrated"]["from_cpu"]:
        lines.append("  (a CPU calibration: these are this CPU's seconds for H3, not an accelerator's)")

    def row(label, fn):
        lines.append(f"{label:38}" + "".join(f"{fn(p):>16}" for p in plans))

    row("compute per step (calibrated)", lambda p: _secs(p['calibrated']['compute_s_step']))
    for transport in calibration_lib.TRANSPORTS:
        if all(transport in p["calibrated"]["step_s"] for p in plans):
            row(f"exchange per step ({transport})", lambda p: _secs(p['calibrated']['exchange_s_step'].get(transport, 0)))
            row(f"step ({transport})", lambda p: _secs(p['calibrated']['step_s'][transport]))
            row(f"speed-up vs 1 device ({transport})", lambda p: f"{p['calibrated']['speedup'][transport]:.2f}x")
    return lines
