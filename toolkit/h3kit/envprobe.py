"""Ask the interpreter that runs ComfyUI what it has. Run as a script by that interpreter:

    python envprobe.py                       package versions and the torch build, without importing torch
    python envprobe.py --packages            the same, and every installed distribution as "name==version"
    python envprobe.py --deep --device-type npu|cuda|cpu
                                             also CANN on disk, torch and torch-npu imported, the devices

Prints one JSON document on stdout. It imports nothing from h3kit (the ComfyUI interpreter may not have it)
and only the standard library until --deep asks for torch. The shallow answer comes first on purpose: with
torch-npu installed and no CANN, `import torch` itself fails (torch-npu autoloads), so the torch build is
read from torch/version.py and the shipped libraries, never from an import. The deep probe imports torch
with TORCH_DEVICE_BACKEND_AUTOLOAD=0 and then torch_npu explicitly, so each failure is reported on its own.

Read-only: it creates no file and loads no model; on npu/cuda, asking a device its free memory creates a
runtime context on it, which ends with this process.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import sys

PACKAGES = {"torch": ("torch",), "torch_npu": ("torch-npu", "torch_npu"), "torchaudio": ("torchaudio",),
            "torchvision": ("torchvision",), "comfy_kitchen": ("comfy-kitchen",),
            "prometheus_client": ("prometheus-client", "prometheus_client")}
ENV_KEYS = ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "H3KIT_SIM_DEVICES", "ASCEND_HOME_PATH",
            "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH", "TORCH_DEVICE_BACKEND_AUTOLOAD")
# where CANN puts its toolkit when no set_env.sh was sourced (the default root of its installer)
CANN_DIRS = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann")
CANN_INFO_FILES = ("ascend_toolkit_install.info", "ascend_all_cann_install.info")
_ASSIGN = re.compile(r"^(cuda|hip|rocm)\s*(?::[^=]*)?=\s*(.+?)\s*$", re.M)


def _version(*names):
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def torch_build():
    """What the installed torch was built for, read from its files: {"cuda", "hip", "libs"}."""
    spec = importlib.util.find_spec("torch")  # a top-level find_spec does not run the package
    if spec is None or not spec.origin:
        return None
    root = os.path.dirname(spec.origin)
    out = {"path": root, "cuda": None, "hip": None, "libs": []}
    try:
        with open(os.path.join(root, "version.py"), encoding="utf-8") as f:
            for key, value in _ASSIGN.findall(f.read()):
                value = value.strip("'\"")
                if value != "None":
                    out["hip" if key == "rocm" else key] = out["hip" if key == "rocm" else key] or value
    except OSError as e:
        out["error"] = f"cannot read torch/version.py: {e}"
    try:
        out["libs"] = sorted(f for f in os.listdir(os.path.join(root, "lib"))
                             if re.match(r"lib(torch|c10)_(cuda|hip)\w*\.so", f))
    except OSError:
        pass
    return out


def cann():
    """CANN's toolkit on disk: the first install-info file found under the usual roots, with its version."""
    arch = platform.machine() or "x86_64"
    roots = [os.environ.get(k) for k in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")]
    roots += list(CANN_DIRS) + sorted(glob.glob("/usr/local/Ascend/cann-*"), reverse=True)
    seen = []
    for root in roots:
        if not root or root in seen:
            continue
        seen.append(root)
        for name in CANN_INFO_FILES:
            path = os.path.join(root, f"{arch}-linux", name)
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
            except OSError:
                continue
            found = re.search(r"^version=(\S+)", text, re.M)
            return {"home": root, "file": path, "version": found.group(1) if found else None, "searched": seen}
    return {"home": None, "file": None, "version": None, "searched": seen}


def shallow():
    return {"python": list(sys.version_info[:3]), "executable": sys.executable,
            **{key: _version(*names) for key, names in PACKAGES.items()},
            "torch_build": torch_build(), "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ}}


def installed_packages():
    """Every distribution on this interpreter's path as "name==version", sorted by name (install records
    them in state.json; verify compares)."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] if dist.metadata else None
        if name:
            found.setdefault(re.sub(r"[-_.]+", "-", name).lower(), f"{name}=={dist.version}")
    return [found[k] for k in sorted(found)]


def _error(e):
    return f"{type(e).__name__}: {e}".strip()[:600]


def deep(device_type):
    info = shallow()
    info["cann"] = cann()
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # torch first on its own; torch_npu explicitly below
    try:
        import torch
    except BaseException as e:  # a broken torch can raise anything, even SystemExit from a native loader
        info["torch_import"] = {"ok": False, "error": _error(e)}
        return info
    info["torch_import"] = {"ok": True, "version": torch.__version__, "cuda": torch.version.cuda,
                            "hip": getattr(torch.version, "hip", None), "debug": bool(torch.version.debug)}
    if info["torch_npu"] is not None or device_type == "npu":
        try:
            import torch_npu
            info["torch_npu_import"] = {"ok": True, "version": getattr(torch_npu, "__version__", None)}
        except BaseException as e:
            info["torch_npu_import"] = {"ok": False, "error": _error(e)}
    info["devices"] = devices(torch, device_type)
    return info


def devices(torch, kind):
    """The devices torch sees for `kind` (visible-device variables applied), each with free/total bytes."""
    if kind == "cpu":
        return {"kind": "cpu", "count": 0, "list": []}
    try:
        module = torch.get_device_module(kind)
        if not module.is_available():
            return {"kind": kind, "count": 0, "list": [], "error": f"torch.{kind}.is_available() is False"}
        out = []
        for i in range(module.device_count()):
            entry = {"index": i, "name": module.get_device_name(i)}
            try:
                entry["free"], entry["total"] = (int(v) for v in module.mem_get_info(i))
            except BaseException as e:
                entry["error"] = _error(e)
            out.append(entry)
        return {"kind": kind, "count": len(out), "list": out}
    except BaseException as e:
        return {"kind": kind, "count": 0, "list": [], "error": _error(e)}


def main(argv):
    kind = "cpu"
    if "--device-type" in argv:
        kind = argv[argv.index("--device-type") + 1]
    report = deep(kind) if "--deep" in argv else shallow()
    if "--packages" in argv:
        report["packages"] = installed_packages()
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
