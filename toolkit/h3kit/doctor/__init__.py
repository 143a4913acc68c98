"""`h3kit doctor`: a read-only preflight of a host before H3 runs on it.

Each check adds findings (ok, info, warning, error), every warning and error with its fix:

interpreter  the Python ComfyUI runs with (--python, else install's state.json, else h3kit's own) and its version
torch        torch / torch-npu / torchaudio versions, the pairing in source_deps_info.json, a CUDA or ROCm
             build beside torch-npu (by what it is: torch/version.py and its libraries), torch importing
cann         CANN on disk, its version against the pairing (9.2.0 for torch-npu 2.14.0, 9.1.x compatible),
             torch_npu importing
driver       npu-smi / nvidia-smi: present, answering, each card's health
devices      the devices torch sees with the visible-device variable set as `h3kit start` sets it,
             against --devices (fewer than asked is an error) and the cards the driver lists
memory       free memory per device against the cost model's need at 768p/5 s and 15 s for every tier
hccl         HCCL's timeouts as the workers take them, HCCL_IF_IP / HCCL_SOCKET_IFNAME for several hosts (links.py)
tree         `h3kit verify` of the installed tree
service      `h3kit status` of its service
models       the model files the shipped workflows load, in models/ and extra_model_paths.yaml, with
             their sizes; a truncated safetensors file is an error
disk, ram    free disk space where ComfyUI writes, host memory against the model files

Nothing here imports torch: the interpreter answers through envprobe.py in a subprocess. Nothing is
written: git runs with GIT_OPTIONAL_LOCKS=0, the service is only asked over HTTP, and no file is created.

Where each check group lives: python_env.py (interpreter, torch, cann), devices.py (driver, devices, memory),
installed.py (tree, service, models), host.py (disk, shm, ram); base.py has the finding and the state they share.
"""

from __future__ import annotations

import socket

from h3kit import manifest, monitoring
from h3kit.doctor.base import CHECKS, GB, Doctor, Finding, Options  # noqa: F401
from h3kit.doctor.devices import check_devices, check_driver, check_memory, device_free_memory, tier_memory  # noqa: F401
from h3kit.doctor.host import (  # noqa: F401
    DISK_ERROR_BYTES, DISK_WARN_BYTES, SHM_PATH, VAE_CHUNK_LATENTS, VAE_CHUNK_OVERLAP, VAE_TIME_STRIDE, VAE_TOKEN_DROP,
    check_disk, check_ram, check_shm, shipped_geometries, shm_handoff_bytes, shm_needs, shm_verdict, video_bytes)
from h3kit.doctor.links import check_links  # noqa: F401
from h3kit.doctor.installed import (  # noqa: F401
    check_models, check_service, check_tree, safetensors_problem, shipped_model_files)
from h3kit.doctor.python_env import (  # noqa: F401
    PROBE_TIMEOUT, cann_pairing, check_cann, check_interpreter, check_probe, check_torch, torch_install_line,
    torch_versions)


def run(opts: Options) -> dict:
    """Every check; returns {"ok", "findings", "facts", ...}. Raises only for bad input (UsageError)."""
    d = Doctor(opts)
    d.data = manifest.load()
    d.requested_devices()
    if d.home is not None:
        check_service(d)
    python = check_interpreter(d)
    info = check_probe(d, python) if python else None
    if info is not None:
        check_torch(d, python, info)
        if d.kind == "npu" or info.get("torch_npu"):
            check_cann(d, info)
        d.add("metrics", *monitoring.doctor_finding(info, python))  # prometheus_client, for GET /metrics
    smi_info = check_driver(d)
    check_devices(d, info, smi_info)
    check_memory(d, info, smi_info)
    check_links(d, opts.nnodes)
    if d.home is not None:
        check_tree(d)
        check_models(d)
    else:
        d.add("tree", "info", "no --comfy-home: the installed tree, its service and its models were not checked",
              "pass --comfy-home DIR (or set H3KIT_COMFY_HOME)")
    check_disk(d)
    check_shm(d)
    check_ram(d)
    d.findings.sort(key=lambda f: CHECKS.index(f.check))
    errors = sum(f.severity == "error" for f in d.findings)
    warnings = sum(f.severity == "warning" for f in d.findings)
    return {"ok": errors == 0, "errors": errors, "warnings": warnings, "host": socket.gethostname(),
            "comfy_home": str(d.home) if d.home else None, "device_type": d.kind,
            "devices": d.requested, "devices_from": d.requested_from,
            "findings": [f.to_dict() for f in d.findings], "facts": d.facts}
