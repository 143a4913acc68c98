"""Parity of the text encoder split across devices (tensor parallel, and by layers) against one device; run by
parity_worker.py in the ComfyUI interpreter.

A tiny Qwen3-VL text encoder (h3kit's tiny_models.py) loaded by CLIPLoader encodes a prompt alone (t2va), with a
first-frame image (fl2va: the vision tower and DeepStack) and with image, video and audio references (ref2va),
through the node (tensor parallel) and forced to the layer split, from an fp32 and a bf16 checkpoint. The layer
split runs each layer unchanged: max_abs == 0. The tensor split sums each row-parallel linear's partial products
across devices, another order than one device's: gate max_rel <= 1e-5, cos >= 0.99999 and rel_rms <= 1e-4
(measured 1.5-1.7e-6 on cpu; upstream computes the text encoder in fp32 whatever the checkpoint), every rank's
final hidden states identical and the same token tags. A text encoder with a random LoRA must pass through the
node to one device, unchanged. The reduce fault drops rank 0's share of every reduction and corrupts the layer
hand-overs.
"""

from __future__ import annotations

import os
import time

from h3kit.runtime import parity_common as common
from h3kit.runtime.parity_dit import LAYOUTS

TE_LAYOUTS = LAYOUTS
TE_PROMPT = "A red fox trots through fresh snow at dawn, wind hissing through the pines."


TE_GATE_MAX_REL = 1e-5


TE_GATE_COS = 0.99999


TE_GATE_REL_RMS = 1e-4


TE_FAULT_NOTE = "rank 0's share left out of every all_reduce; layer hand-overs and the final broadcast zeroed"
# latent (T, h, w) per row: 1 frame (no chunks), then 1, 2, 4 and 5 temporal chunks; 73f has 2x2 spatial tiles


def _te_tokens(clip, layout, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    image = torch.rand(1, 64, 64, 3, generator=g)
    if layout == "t2va":
        return clip.tokenize(TE_PROMPT)
    if layout == "fl2va":
        return clip.tokenize(TE_PROMPT, images=[image])
    frames = torch.rand(3, 64, 64, 3, generator=g)  # 3 frames at 2 fps: padded to two 2-frame video blocks
    return clip.tokenize(TE_PROMPT, minimax_ref_items=[{"type": "image", "data": image},
                                                      {"type": "video", "data": frames}, {"type": "audio"}])


def _encode(clip, layout, seed):
    out = clip.encode_from_tokens_scheduled(_te_tokens(clip, layout, seed))
    return out[0][0].detach().float().cpu(), out[0][1]["minimax_token_tags"]


class TEFault:
    """comfy.multinpu_te.fault_hook of --inject-fault: rank 0's share of every reduction dropped, and the hidden
    states a layer split hands over zeroed where they arrive. A module-level class: with the process transport the
    hook is pickled and sent to the workers with every forward."""

    def __call__(self, stage, x, comm):
        if stage == "reduce":
            return x * 0 if comm.rank == 0 else x
        return x * 0  # a received broadcast or hand-over


def _inject_te_fault(npu_count):
    import comfy.multinpu_te
    common.patch(comfy.multinpu_te, "fault_hook", TEFault())


def _bf16_copy(path):
    """A bf16 checkpoint of the same weights beside `path` (what deployments load), metadata kept. Read with
    safetensors itself: this copy is the harness's, not a read the loaders' count should see."""
    import safetensors
    import safetensors.torch
    import torch
    import comfy.utils
    sd = safetensors.torch.load_file(path)
    with safetensors.safe_open(path, framework="pt") as f:
        metadata = f.metadata()
    out = path.replace(".safetensors", "_bf16.safetensors")
    comfy.utils.save_torch_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()},
                                out, metadata=metadata)
    return out


def _rank_spread(runner, npu_count):
    """The largest difference between any rank's final hidden states and rank 0's (inf for a NaN, and when not
    every rank handed its output back: a comparison over fewer ranks would pass on what it did not see)."""
    import torch
    outs = runner.rank_outputs or []
    if len(outs) != npu_count or any(o.shape != outs[0].shape for o in outs):
        return float("inf")
    if all(torch.equal(o, outs[0]) for o in outs):  # torch.equal is False on a NaN
        return 0.0
    return float(torch.stack([(o.float() - outs[0].float()).abs().max() for o in outs]).nan_to_num(nan=float("inf")).max())


def _single_device(clips: dict, layouts: list, layouts_of, seed: int) -> tuple[dict, dict]:
    """One device's encodes, the reference of every row: ({(dtype, layout): (outputs..., seconds)}, {dtype: the
    run-to-run max_rel of one device's own bf16 encode})."""
    single, noise = {}, {}
    for dtype, (component, clip) in clips.items():
        for layout in layouts_of(dtype):
            t0 = time.perf_counter()
            single[(dtype, layout)] = _encode(clip, layout, seed) + (time.perf_counter() - t0,)
        if dtype == "bfloat16":  # one device's own bf16 noise: the same encode again
            again = _encode(clip, layouts[0], seed)[0]
            noise[dtype] = common.metrics([[single[(dtype, layouts[0])][0]]], [[again]])["max_rel"]
    return single, noise


def run_te(args):
    common.setup_comfy(args.comfy_home, args.device_type, args.npu_count)
    import torch
    import comfy.multidevice
    import comfy.multinpu_te
    import nodes
    node, error = common.node_or_error(args)
    if error:
        return error
    runtime = common.start_group(args)
    with common.models_dir() as tmp:
        loaded, reads, paths, tiny = common.load_through_nodes(tmp, args.seed, ("dit", "te"))
        if "bfloat16" in args.dtypes:
            paths["te_bf16"] = os.path.realpath(_bf16_copy(paths["te"]))
            loaded["te_bf16"] = nodes.CLIPLoader().load_clip(os.path.basename(paths["te_bf16"]), type="minimax")[0]
    if args.faults != ["none"]:
        _inject_te_fault(args.npu_count)
    layouts = [x for x in args.layouts if x in TE_LAYOUTS] or list(TE_LAYOUTS)
    clips = {"float32": ("te", loaded["te"])}
    if "bfloat16" in args.dtypes:
        clips["bfloat16"] = ("te_bf16", loaded["te_bf16"])
    # the bf16 checkpoint: the first layout (tensor parallel); upstream computes in fp32 either way, and one
    # device's bf16 encodes cost several times the fp32 ones on a CPU (every weight cast at every call)
    layouts_of = lambda dtype: layouts if dtype == "float32" else layouts[:1]  # noqa: E731
    single, noise = _single_device(clips, layouts, layouts_of, args.seed)
    rows = []
    for dtype, (component, clip) in clips.items():
        variants = [node.execute(model=loaded["dit"], npu_count=args.npu_count, clip=clip).args[1]]
        if dtype == "float32":  # the layer split runs each layer unchanged, whatever the dtype: once is enough
            devices = comfy.multidevice.devices_for(clip.patcher.load_device, args.npu_count)
            variants.append(comfy.multinpu_te.apply_tensor_parallel(clip, devices, mode="layers"))
        for par in variants:
            runner = comfy.multinpu_te.get_runner(par)
            if runner is not None:
                runner.keep_rank_outputs = True
                runner.runtime.timeout = args.timeout  # the process group's: the one it started with
            rows.extend(_te_row(args, par, runner, layout, dtype, single[(dtype, layout)], reads[paths[component]])
                        for layout in layouts_of(dtype))
            if runner is not None:
                runner.runtime.release()  # a thread runtime is the row's own; the process group serves every row
    if args.lora:
        rows.append(_te_lora_row(args, node, loaded, layouts[0], single[("float32", layouts[0])][0],
                                 lambda: reads[paths["te"]]))
    te = tiny.TINY_TE
    config = common.config(args, tiny, {
        "te": {k: te[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                  "num_key_value_heads")},
        "dtypes": list(clips), "bf16_noise": {"run_to_run": noise.get("bfloat16")},
        "gate": f"max_rel <= {TE_GATE_MAX_REL:g}, cos >= {TE_GATE_COS}, rel_rms <= {TE_GATE_REL_RMS:g} (the tensor "
                "split sums across devices in another order), max_abs == 0 for the layer split, rank_spread == 0, "
                "same token tags, weight_reads == 1 (bf16 checkpoints too: upstream computes the text encoder in fp32)",
        "reads": {c: reads[p] for c, p in paths.items()},
        "faults": {"reduce": TE_FAULT_NOTE} if args.faults != ["none"] else {}})
    return {"ok": all(r["pass"] for r in rows), "rows": rows, "config": config}


def _te_row(args, par, runner, layout, dtype, reference, weight_reads):
    """One encode through the split text encoder `par`, against one device's (reference: output, tags, seconds)."""
    import torch
    before = runner.bytes_moved if runner else 0
    t0 = time.perf_counter()
    out, tags = _encode(par, layout, args.seed)
    seconds = time.perf_counter() - t0
    ref, ref_tags, t_single = reference
    row = {"component": "te", "layout": layout, "mode": runner.mode if runner else "none", "dtype": dtype,
           "lora": False, "npu_count": args.npu_count, "device_type": args.device_type, "transport": args.transport,
           "tokens": int(ref.shape[1]), **common.metrics([[ref]], [[out]]),
           "rank_spread": _rank_spread(runner, args.npu_count) if runner else 0.0,
           "tags_equal": tags.shape == ref_tags.shape and bool(torch.equal(tags, ref_tags)),
           "weight_reads": weight_reads, "bytes_moved": (runner.bytes_moved - before) if runner else 0,
           "seconds_single": round(t_single, 4), "seconds_parallel": round(seconds, 4)}
    # the row must really have run split: a node that passed the text encoder through on one device would compare a
    # model with itself and pass every other test
    row["split"] = row["mode"] != "none" and row["bytes_moved"] > 0
    checks = [(row["split"], "not split over the devices"),
              (row["max_rel"] <= TE_GATE_MAX_REL, f"max_rel > {TE_GATE_MAX_REL:g}"),
              (row["cos"] >= TE_GATE_COS, f"cos < {TE_GATE_COS}"),
              (row["rel_rms"] <= TE_GATE_REL_RMS, f"rel_rms > {TE_GATE_REL_RMS:g}"),
              (row["rank_spread"] == 0, "the devices' hidden states differ"),
              (row["tags_equal"], "token tags differ"),
              (row["weight_reads"] == 1, f"weight file read {row['weight_reads']} times")]
    if row["mode"] == "layers":  # each layer runs unchanged on one device: exact
        checks.append((row["max_abs"] == 0, f"the layer split is not exact (max_abs {row['max_abs']:.3g})"))
    return common.judge(row, checks)


def _te_lora_row(args, node, loaded, layout, plain, te_reads):
    """A text encoder with a random LoRA through the node: it must pass through, unchanged, to one device
    (its LoRA names weights tensor parallelism would split), and still carry the LoRA."""
    import comfy.multinpu_te
    import comfy.sd
    clip = loaded["te"]
    lora = common.lora_state_dict(clip.cond_stage_model.state_dict(), "qwen3vl_32b.transformer.model.layers.",
                            "text_encoders.", args.seed)
    lora_clip = comfy.sd.load_lora_for_models(None, clip, lora, 0.0, 1.0)[1]
    ref = _encode(lora_clip, layout, args.seed)[0]
    out_clip = node.execute(model=loaded["dit"], npu_count=args.npu_count, clip=lora_clip).args[1]
    out = _encode(out_clip, layout, args.seed)[0]
    effect = common.metrics([[plain]], [[ref]])["max_rel"]
    row = {"component": "te", "layout": layout, "mode": "one device", "dtype": "float32", "lora": True,
           "npu_count": args.npu_count, "device_type": args.device_type, "tokens": int(ref.shape[1]),
           **common.metrics([[ref]], [[out]]), "weight_reads": te_reads(),
           "bytes_moved": 0, "split": False, "lora_patches": len(lora_clip.patcher.patches), "lora_effect": effect,
           "passed_through": out_clip is lora_clip and comfy.multinpu_te.get_runner(out_clip) is None}
    return common.judge(row, [(row["passed_through"], "the node split a text encoder carrying a LoRA"),
                        (row["lora_patches"] == len(lora) // 2, "the LoRA did not patch every weight it names"),
                        (row["max_abs"] == 0, "the output changed on the way through the node"),
                        (row["weight_reads"] == 1, f"weight file read {row['weight_reads']} times"),
                        (effect > 1e-3, f"the LoRA changed the output by max_rel {effect:.2g} only")])
