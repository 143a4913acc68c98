"""doctor's interpreter, torch and cann checks: the Python ComfyUI runs with, what it has installed (through
envprobe.py in a subprocess: nothing here imports torch), and the pairing in source_deps_info.json."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from h3kit import cliutil, install, pyenv
from h3kit import service as h3service
from h3kit.doctor.base import Doctor
from h3kit.pairing import torch_install_line  # noqa: F401 (doctor's interface keeps it)
from h3kit.errors import H3kitError

PROBE_TIMEOUT = 180.0          # importing torch_npu and touching every card can take a minute


def check_interpreter(d: Doctor) -> str | None:
    python, source = d.opts.python, "--python"
    if not python and d.home is not None:
        try:
            python = (install.load_state(d.home) or {}).get("python")
            source = str(install.state_path(d.home))
        except H3kitError as e:
            d.add("interpreter", "error", e.message, e.hint)
    if not python:
        python, source = sys.executable, "h3kit's own interpreter"
        d.add("interpreter", "warning", f"no interpreter recorded for ComfyUI: checking {python}, the one "
              "h3kit runs in", "pass --python with the interpreter that runs ComfyUI (or run h3kit install "
              "--python PY, which records it)")
    try:
        python = h3service.resolve_python(d.home or Path(tempfile.gettempdir()), python)
    except H3kitError as e:
        d.add("interpreter", "error", e.message, e.hint)
        return None
    d.facts["python"] = {"path": python, "from": source}
    return python


def check_probe(d: Doctor, python: str) -> dict | None:
    env = dict(d.env)
    if d.requested is not None and d.kind != "cpu":
        env = h3service.child_environment(d.kind, d.requested, env)  # what `h3kit start` exposes
    cmd = [python, str(pyenv.PROBE), "--deep", "--device-type", d.kind]
    try:
        proc = cliutil.run_captured(cmd, timeout=PROBE_TIMEOUT, env=env)
    except subprocess.TimeoutExpired:
        d.add("interpreter", "error", f"{python} did not answer the probe within {PROBE_TIMEOUT:g} s",
              "a device or driver call hangs: check the driver (npu-smi info / nvidia-smi) first")
        return None
    except OSError as e:
        proc = subprocess.CompletedProcess(cmd, 126, "", str(e))
    try:
        info = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = " ".join(proc.stderr.strip().splitlines()[-3:])
        d.add("interpreter", "error", f"{python} could not run the environment probe (exit {proc.returncode}): "
              f"{tail or 'no answer'}", "pass --python with a working interpreter (a wrapper script must "
              "exec python \"$@\")")
        return None
    d.facts["probe"] = info
    version = ".".join(map(str, info.get("python", [])))
    d.add("interpreter", "ok", f"{info.get('executable') or python} (Python {version}), from "
          f"{d.facts['python']['from']}")
    return info


def check_torch(d: Doctor, python: str, info: dict):
    env = pyenv.evaluate(python, info, d.data)
    install_cmd = torch_install_line(d.data, d.kind, python)
    torch = info.get("torch")
    for message in env.errors:
        d.add("torch", "error", message, install_cmd)
    for message in env.warnings:
        if torch is None and message.startswith("torch is not installed"):
            continue  # said below, as the error it is, with the versions and the command
        if info.get("torchaudio") is None and message.startswith("torchaudio is not installed"):
            d.add("torch", "error", f"torchaudio is not installed in {python}: the pinned comfy/sd.py imports "
                  f"it at start-up, so ComfyUI will not start", torch_install_line(d.data, d.kind, python,
                                                                                   only_audio=True))
            continue
        d.add("torch", "warning", message)
    if torch is None:
        d.add("torch", "error", f"torch is not installed in {python}: ComfyUI will not start without it "
              f"(this host needs {torch_versions(d.data, d.kind)})", install_cmd)
    imported = info.get("torch_import") or {}
    if torch is not None and not imported.get("ok", True):
        d.add("torch", "error", f"import torch fails in {python}: {imported.get('error')}",
              f"reinstall torch into that interpreter: {install_cmd}")
    build = info.get("torch_build") or {}
    if d.kind == "cuda" and torch is not None and not build.get("cuda"):
        d.add("torch", "error", f"torch {torch} is not a CUDA build, but the device type is cuda",
              "install a CUDA build of torch, or choose --device-type npu|cpu")
    if d.kind == "npu" and not info.get("torch_npu") and torch is not None:
        d.add("torch", "error", f"torch-npu is not installed in {python} (this host needs "
              f"{torch_versions(d.data, d.kind)})", install_cmd)
    if torch is not None and not env.errors and imported.get("ok", True):
        what = pyenv.gpu_build(torch, build) or "CPU build"
        extra = f", torch-npu {info['torch_npu']}" if info.get("torch_npu") else ""
        d.add("torch", "ok", f"torch {torch}: {what}{extra}, torchaudio {info.get('torchaudio')}")


def check_cann(d: Doctor, info: dict):
    cann = info.get("cann") or {}
    npu = info.get("torch_npu")
    entry = next((p for p in d.data["torch"]["npu"] if npu and pyenv._base(npu) == pyenv._base(p["torch_npu"])),
                 d.data["torch"]["npu"][0])
    want = f"CANN {entry['cann']}" + (f" ({', '.join(c + '.x' for c in entry.get('cann_compatible', []))} "
                                      "compatible)" if entry.get("cann_compatible") else "")
    setenv = "source CANN's set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh) in a wrapper script " \
             "that execs python, and pass that script as --python"
    if not cann.get("version"):
        d.add("cann", "error", f"CANN not found (looked in {', '.join(cann.get('searched') or ['nothing'])}); "
              f"torch-npu {npu or entry['torch_npu']} needs {want}", f"install {want}, then {setenv}")
    else:
        verdict = cann_pairing(cann["version"], entry)
        if verdict is None:
            d.add("cann", "error", f"CANN {cann['version']} (from {cann['file']}) is not paired with torch-npu "
                  f"{entry['torch_npu']}, which needs {want}", f"install {want}, or the torch-npu release made "
                  f"for CANN {cann['version']}")
        else:
            d.add("cann", "ok", f"CANN {cann['version']} at {cann['home']}: {verdict} for torch-npu "
                  f"{entry['torch_npu']}")
    imported = info.get("torch_npu_import")
    if imported and not imported.get("ok"):
        d.add("cann", "error", f"import torch_npu fails: {imported.get('error')}", setenv)


# ---- pieces with their own tests -------------------------------------------------------------------------------------

def torch_versions(data: dict, kind: str) -> str:
    """The versions source_deps_info.json pairs for this device type, in words."""
    cpu = data["torch"]["cpu"]
    if kind == "npu":
        entry = data["torch"]["npu"][0]
        compatible = "".join(f", {c}.x compatible" for c in entry.get("cann_compatible", []))
        return (f"torch {entry['torch']} (CPU build), torch-npu {entry['torch_npu']}, torchaudio {cpu['torchaudio']} "
                f"and CANN {entry['cann']}{compatible}")
    build = "a CUDA build of " if kind == "cuda" else ""
    return f"{build}torch {cpu['torch']}, torchvision {cpu['torchvision']} and torchaudio {cpu['torchaudio']}"


def cann_pairing(version: str, entry: dict) -> str | None:
    """"listed" when `version` is the CANN release the torch-npu entry names (same major.minor), "compatible"
    for a release line in its cann_compatible, None otherwise."""
    def line(text):
        parts = []
        for piece in text.split("."):
            if not piece.isdigit():
                break
            parts.append(int(piece))
        return tuple(parts[:2])
    if line(version) == line(entry["cann"]):
        return "listed"
    if any(line(version) == line(c) for c in entry.get("cann_compatible", [])):
        return "compatible"
    return None
