"""doctor's disk, shm and ram checks: free disk space where ComfyUI writes, /dev/shm against the process
transport's largest hand-off, host memory against the model files."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from h3kit.doctor.base import GB, Doctor
from h3kit.paths import repo_root
from h3kit.runtime import costmodel

DISK_ERROR_BYTES = 2 * GB      # below this ComfyUI cannot write a video, a log or its database
DISK_WARN_BYTES = 20 * GB
# The process transport hands each command's inputs and results between the server and worker rank 0 through
# /dev/shm. The largest is the VAE decode's result: every decoded temporal chunk at once (the upstream VAE's chunks
# of 7 latents, 28 frames, overlapping by 2 latents), at fp32 (the VAE's working dtype where fp16 is not used): 7.3 GB
# for 768p/15 s, whose video alone is about 4.5 GB. Containers default /dev/shm to 64 MB.
SHM_PATH = "/dev/shm"
VAE_CHUNK_LATENTS, VAE_TOKEN_DROP, VAE_TIME_STRIDE = 5, 3, 4  # comfy/ldm/minimax/vae.py: ceil(17 / 4), token_drop
VAE_CHUNK_OVERLAP = (-VAE_TOKEN_DROP) % VAE_CHUNK_LATENTS     # 2 latents each chunk shares with the next


def check_disk(d: Doctor):
    places = {"temp": Path(tempfile.gettempdir())}
    if d.home is not None and d.home.is_dir():
        places["comfy-home"] = d.home
        for sub in ("models", "output"):
            if (d.home / sub).is_dir():
                places[sub] = (d.home / sub).resolve()
    seen = {}
    for label, path in places.items():
        try:
            dev = path.stat().st_dev
            seen.setdefault(dev, (label, path, shutil.disk_usage(path).free))
        except OSError:
            continue
    for label, path, free in seen.values():
        if free < DISK_ERROR_BYTES:
            d.add("disk", "error", f"{label} ({path}): {free / GB:.1f} GB free", "free disk space: ComfyUI writes "
                  "outputs, temp files and its database there")
        elif free < DISK_WARN_BYTES:
            d.add("disk", "warning", f"{label} ({path}): {free / GB:.1f} GB free", "free some space before long runs")
        else:
            d.add("disk", "ok", f"{label} ({path}): {free / GB:.0f} GB free")


def check_shm(d: Doctor):
    try:
        st = os.statvfs(SHM_PATH)
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    except OSError:
        free = total = None
    several = d.kind in ("npu", "cuda") or (d.requested is not None and len(d.requested) > 1)
    try:
        needs = shm_needs()
    except Exception as e:  # a shipped workflow that does not parse is the models check's finding
        needs = shm_needs(workflows=False)
        needs["note"] = f"shipped workflows not read ({type(e).__name__})"
    severity, message, fix = shm_verdict(free, several, needs, total)
    d.facts["shm"] = {"path": SHM_PATH, "free": free, "size": total,
                         "needs": {k: v for k, v in needs.items() if k != "note"}}
    d.add("shm", severity, message, fix)


def check_ram(d: Doctor):
    total = _meminfo("MemTotal")
    if total is None:
        return
    biggest = max(d.found_models.values(), default=0)
    message = f"host memory {total / GB:.0f} GB"
    if biggest and total < biggest:
        d.add("ram", "warning", f"{message}, less than the {biggest / GB:.0f} GB of model files one shipped "
              "workflow loads: ComfyUI reads them into host memory first", "expect reloads between prompts; "
              "INT8 files, or a host with more memory")
    else:
        d.add("ram", "ok", message + (f" ({biggest / GB:.0f} GB of model files per workflow)" if biggest else ""))


# ---- pieces with their own tests -------------------------------------------------------------------------------------

def shm_handoff_bytes(width: int, height: int, frames: int) -> int:
    """Bytes of the largest hand-off of one prompt at this geometry: the VAE decode's result, every decoded temporal
    chunk at once at fp32 (comfy/multinpu_vae.py: worker rank 0 hands them all back; upstream's
    _decode_temporal_chunks counts them, each 7 latents, 28 frames)."""
    latents = costmodel.video_latent_t(costmodel.align_frame_count(frames))
    total = latents + VAE_TOKEN_DROP
    total += (-total) % VAE_CHUNK_LATENTS
    chunks = max(1, total // VAE_CHUNK_LATENTS - int(VAE_TOKEN_DROP > 0))
    chunk_frames = (VAE_CHUNK_LATENTS + VAE_CHUNK_OVERLAP) * VAE_TIME_STRIDE
    return chunks * chunk_frames * width * height * 3 * 4


def video_bytes(width: int, height: int, frames: int) -> int:
    """The decoded video itself at fp32 (what ComfyUI holds afterwards)."""
    return costmodel.align_frame_count(frames) * width * height * 3 * 4


def shipped_geometries() -> dict:
    """{workflow file name: (width, height, frames)} of the shipped workflows' latent nodes (the largest per file)."""
    from h3kit.workflow import graph as graph_mod, load
    from h3kit.workflow.catalog import load_catalog
    from h3kit.workflow.checks import GEOMETRY_NODES
    from h3kit.workflow.resolve import as_int, value
    catalog = load_catalog()
    out = {}
    for path in sorted((repo_root() / "workflows").glob("*.json")):
        graph = graph_mod.build_graph(load.read_workflow(str(path)), catalog)
        for node in graph.nodes.values():
            if node.class_type in GEOMETRY_NODES:
                geo = tuple(as_int(value(graph, node, k)) for k in ("width", "height", "length"))
                if None not in geo and shm_handoff_bytes(*geo) > shm_handoff_bytes(*out.get(path.name, (0, 0, 0))):
                    out[path.name] = geo
    return out


def shm_needs(workflows: bool = True) -> dict:
    """{"workflows": (name, bytes) of the shipped workflow with the largest hand-off (without them, or workflows
    False: the shortest deployment geometry's), "tier": ("768p/15s", bytes) for the longest deployment geometry
    (costmodel.GEOMETRIES), "video": the bytes of that tier's video}."""
    tiers = sorted(costmodel.GEOMETRIES.items(), key=lambda kv: shm_handoff_bytes(*kv[1]))
    (short, geo_short), (name, (w, h, f)) = tiers[0], tiers[-1]
    out = {"tier": (name, shm_handoff_bytes(w, h, f)), "video": video_bytes(w, h, f),
           "workflows": (short, shm_handoff_bytes(*geo_short))}
    if workflows:
        sizes = {wf: shm_handoff_bytes(*geo) for wf, geo in shipped_geometries().items()}
        if sizes:
            out["workflows"] = max(sizes.items(), key=lambda kv: kv[1])
    return out


def shm_verdict(free: int | None, several_devices: bool, needs: dict | None = None, size: int | None = None) -> tuple:
    """(severity, message, fix) for /dev/shm's free bytes against the largest hand-off (shm_needs()): an error when
    the shipped workflows' does not fit (their prompts would fail), a warning when the longest tier's does not."""
    needs = needs or shm_needs()
    tier, tier_need = needs["tier"]
    workflow, workflow_need = needs["workflows"]
    want = max(tier_need, workflow_need)
    gib = int(-(-(want + (size - free if size is not None and free is not None else 0)) // 2**30)) + 1
    fix = (f"give /dev/shm room: `docker run --shm-size {gib}g` (Kubernetes: an emptyDir with medium Memory on "
           f"/dev/shm), or `mount -o remount,size={gib}G /dev/shm`; or free what other programs left there")
    if free is None:
        return ("warning" if several_devices else "info", "/dev/shm is missing: the process transport hands its "
                "tensors through the temp folder instead (disk)", fix)
    message = f"/dev/shm: {free / GB:.1f} GB free" + (f" of {size / GB:.1f} GB" if size is not None else "")
    largest = (f"the largest hand-off between the server and worker rank 0, the VAE decode's chunks at fp32, is "
               f"{tier_need / GB:.1f} GB at {tier} (its video alone {needs['video'] / GB:.1f} GB)"
               + (f", {workflow_need / GB:.1f} GB for {workflow}" if workflow != tier else ""))
    if free >= want:
        return "ok", message + f" ({largest})", None
    if not several_devices:
        return "info", message + " (only the process transport, on several devices, uses it)", None
    if free < workflow_need:
        return "error", message + f": {largest}; a prompt whose hand-off does not fit fails", fix
    return "warning", message + f": {largest}; a {tier} prompt would fail", fix


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
