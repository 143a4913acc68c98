"""What the parity worker's components share: ComfyUI's set-up, the process group, the tiny checkpoints
through the loader nodes with their reads counted, the comparison of outputs and the verdict of a row.

Runs in the ComfyUI interpreter (parity_worker.py imports it; h3kit's toolkit is on its PYTHONPATH).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

LORA_RANK, LORA_SCALE = 4, 0.1
BAD = {"max_abs": float("inf"), "max_rel": float("inf"), "cos": float("-inf"), "rel_rms": float("inf")}


def start_group(args):
    """--transport process: this process drives N worker processes, rank 0 included, as the server does (the
    workers import the tree); None with
    threads. The one place the parity worker sets the process runtime up: what it returns is handed to the node's
    runners (and its figures read from them), so another runtime changes this function alone."""
    if args.transport != "process":
        return None
    import comfy.multinpu_wire as wire
    import comfy.multinpu_process as mp
    runtime = mp.get_runtime()
    if runtime is not None:  # parity_worker.py --jobs: the group an earlier run of this process started
        if runtime.spec.local_size == args.npu_count:
            return runtime
        mp.stop_runtime()
    key = os.environ.setdefault(wire.KEY_ENV, wire.new_key())
    # the workers unpickle the DiT fault hook: h3kit reaches them through PYTHONPATH (worker.run)
    spec = wire.GroupSpec(local_size=args.npu_count, device_type=args.device_type, timeout=args.timeout,
                          join_timeout=args.timeout, worker_args=["--cpu"] if args.device_type == "cpu" else [])
    runtime = mp.start_runtime(spec, key)
    mp.wait_ready(runtime, args.timeout)
    return runtime


_UNDO = []


def patch(obj, name, value):
    """Set obj.name for this run only (a fault's hook): end_run() puts it back, so that the next run of
    parity_worker.py --jobs in this process starts clean."""
    _UNDO.append((obj, name, getattr(obj, name)))
    setattr(obj, name, value)


def end_run():
    while _UNDO:
        obj, name, old = _UNDO.pop()
        setattr(obj, name, old)


def stop_group():
    if "comfy.multinpu_process" in sys.modules:
        sys.modules["comfy.multinpu_process"].stop_runtime()  # the workers end with the report written


def models_dir():
    """A folder for the tiny checkpoints, kept for the whole run: worker processes load them (in --out's
    folder, which h3kit parity removes)."""
    return contextlib.nullcontext(tempfile.mkdtemp(prefix="h3kit-parity-"))


def setup_comfy(comfy_home, device_type, npu_count):
    if comfy_home not in sys.path:  # once per process, which parity_worker.py --jobs runs several runs in
        sys.path.insert(0, comfy_home)
    os.chdir(comfy_home)
    if device_type == "cpu":
        os.environ["H3KIT_SIM_DEVICES"] = str(npu_count)
    import comfy.cli_args
    if device_type == "cpu":
        # before comfy.model_management is imported, or it probes CUDA
        comfy.cli_args.args.cpu = True
    import comfy.model_management  # noqa: F401


def worst(values):
    """The largest value, or inf when any is NaN (a Python max() over floats may skip a NaN)."""
    values = list(values)
    return float("inf") if any(v != v for v in values) else max(values)


def metrics(single, parallel):
    """max_abs, max_rel (over the reference's peak), cos and rel_rms of two lists of forwards' outputs, as one
    long vector each; BAD (every figure failing) for outputs of other lengths, empty or all-zero references."""
    import torch
    a = torch.cat([t.flatten() for fwd in single for t in fwd]).double()
    b = torch.cat([t.flatten() for fwd in parallel for t in fwd]).double()
    if a.shape != b.shape or not a.numel() or not a.abs().max().item():
        # other lengths, nothing, or a reference of zeros: a comparison that would pass on nothing fails
        return dict(BAD)
    diff = (b - a).abs()
    peak = a.abs().max().item()
    rms = a.pow(2).mean().sqrt().item()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    max_abs = float("nan") if diff.isnan().any() else diff.max().item()
    return {"max_abs": max_abs, "max_rel": max_abs / peak if peak else float("inf"),
            "cos": cos if cos == cos else float("-inf"), "rel_rms": diff.pow(2).mean().sqrt().item() / rms if rms else float("inf")}


def judge(row, checks):
    """row["pass"] when every (ok, reason) in `checks` holds; row["failed"] lists the reasons that did not."""
    row["failed"] = [reason for ok, reason in checks if not ok]
    row["pass"] = not row["failed"]
    return row


def tiny_models():
    """h3kit's tiny_models.py, loaded from its file (this interpreter may not have h3kit installed)."""
    path = Path(__file__).resolve().parents[1] / "tiny_models.py"
    spec = importlib.util.spec_from_file_location("h3kit_tiny_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def count_reads():
    """Count every weight-file read from now on: {real path: reads} (the loaders all read through load_torch_file)."""
    import comfy.utils
    from h3kit.runtime import reads
    return reads.count(comfy.utils)


def load_through_nodes(tmp, seed, components, vae_dims=None):
    """Tiny checkpoints of `components` (dit, te, video_vae, audio_vae) written to tmp and loaded by the loader
    nodes, with every weight-file read counted: (loaded, reads, paths, tiny_models)."""
    tiny = tiny_models()
    files = {c: f"h3kit_parity_{c}.safetensors" for c in components}
    for component, name in files.items():
        tiny.write(component, os.path.join(tmp, name), seed, dims=vae_dims if component == "video_vae" else None)
    import folder_paths
    import nodes
    for folder in ("diffusion_models", "text_encoders", "vae"):
        folder_paths.add_model_folder_path(folder, tmp, is_default=True)
    reads = count_reads()
    load = {"dit": lambda name: nodes.UNETLoader().load_unet(name, "default")[0],
            "te": lambda name: nodes.CLIPLoader().load_clip(name, type="minimax")[0],
            "video_vae": lambda name: nodes.VAELoader().load_vae(name)[0],
            "audio_vae": lambda name: nodes.VAELoader().load_vae(name)[0]}
    loaded = {c: load[c](name) for c, name in files.items()}
    paths = {c: os.path.realpath(os.path.join(tmp, n)) for c, n in files.items()}
    return loaded, reads, paths, tiny


def node_or_error(args):
    import comfy_extras.nodes_multinpu as nodes_multinpu
    node = nodes_multinpu.MultiNPUParallelConfigNode
    problem = node.validate_inputs(npu_count=args.npu_count)
    return node, (None if problem is True else {"ok": False, "error": {"code": "device_check", "message": problem}})


def config(args, tiny, extra):
    import comfy.multidevice
    return {"dtype": "float32", "seed": args.seed,
            "devices": [str(d) for d in comfy.multidevice.get_devices()[:args.npu_count]], **extra}


def lora_state_dict(weights, prefix, key_prefix, seed):
    """A random LoRA (rank LORA_RANK) on every linear weight of `weights` under `prefix`, in upstream's generic key
    format (key_prefix + "<module>.lora_up/lora_down.weight"), its delta about LORA_SCALE of each weight."""
    import torch
    g = torch.Generator().manual_seed(seed + 101)
    sd = {}
    for name, t in weights.items():
        if not (name.startswith(prefix) and name.endswith(".weight") and t.dim() == 2):
            continue
        out_f, in_f = t.shape
        key = key_prefix + name[:-len(".weight")]
        down = torch.randn(LORA_RANK, in_f, generator=g) / in_f ** 0.5
        up = torch.randn(out_f, LORA_RANK, generator=g) * (LORA_SCALE * t.float().std().item() / LORA_RANK ** 0.5)
        sd[key + ".lora_down.weight"], sd[key + ".lora_up.weight"] = down, up
    return sd
