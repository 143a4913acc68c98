"""Check the interpreter that will run ComfyUI: its version and its torch / torch-npu pairing.

Versions are read from package metadata in a subprocess (envprobe.py), never by importing torch: with
torch-npu installed and no CANN, `import torch` itself fails, and that is one of the things this check must
report cleanly. What torch was built for comes from its own files (torch/version.py, lib/libtorch_cuda*.so):
the default x86_64 wheel on PyPI is a CUDA build whose version carries no "+cu" tag.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import packaging.specifiers
import packaging.version

from h3kit import cliutil
from h3kit.errors import H3kitError, UsageError

PROBE = Path(__file__).with_name("envprobe.py")  # run by the interpreter being checked


class PythonEnvError(H3kitError):
    code = "python_env"


@dataclass
class EnvReport:
    python: str
    info: dict
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    packages: list[str] | None = None  # "name==version" of every distribution, when asked for

    def to_dict(self) -> dict:
        return {"python": self.python, "info": self.info, "errors": self.errors, "warnings": self.warnings}


def probe(python: str, packages: bool = False) -> dict:
    """envprobe's shallow answer from `python`; with `packages`, also its "packages" list."""
    hint = "give --python the interpreter that runs ComfyUI (a wrapper script must exec python \"$@\")"
    try:
        # Ctrl-C or SIGTERM while the interpreter starts must not leave it running
        proc = cliutil.run_captured([python, str(PROBE)] + (["--packages"] if packages else []), timeout=60)
    except (FileNotFoundError, PermissionError, NotADirectoryError) as e:  # bad input: no such interpreter
        raise UsageError(f"the Python interpreter {python} cannot be run: {e.strerror or e}", code="bad_python",
                         hint=hint) from None
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PythonEnvError(f"cannot run {python}: {e}", hint=hint) from None
    why = proc.stderr.strip()[-400:] or (f"it exited with status {proc.returncode} and printed nothing: it is not a "
                                         "Python interpreter, or a wrapper that does not run the script it is given")
    if proc.returncode != 0:
        raise PythonEnvError(f"{python} failed to report its packages: {why}", hint=hint)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise PythonEnvError(f"{python} failed to report its packages: it printed no report (exit 0, "
                             f"{len(proc.stdout)} bytes on stdout): it is not a Python interpreter, or a wrapper "
                             "that does not run the script it is given", hint=hint) from None


def _base(version: str) -> tuple[int, ...]:
    """'2.14.0.post2' -> (2, 14, 0); '2.14.1+cu130' -> (2, 14, 1); () for what is not a version."""
    try:
        return packaging.version.Version(version).release[:3]
    except packaging.version.InvalidVersion:
        return ()


def gpu_build(version: str, build: dict | None) -> str | None:
    """"CUDA 12.8 build (...)" when torch was built for CUDA or ROCm, judged by what it is (torch/version.py,
    the shipped libtorch_cuda / libtorch_hip libraries) and by its local version tag; None for a CPU build."""
    build = build or {}
    evidence = [f"torch.version.{k} = {build[k]}" for k in ("cuda", "hip") if build.get(k)]
    evidence += [f"{lib} present" for lib in build.get("libs", [])[:2]]
    local = version.split("+", 1)[1] if "+" in version else ""
    if local.startswith(("cu", "rocm")):
        evidence.append(f"version tag +{local}")
    if not evidence:
        return None
    kind = f"ROCm {build['hip']}" if build.get("hip") else f"CUDA {build.get('cuda') or local}"
    return f"{kind} build ({', '.join(evidence)})"


def evaluate(python: str, info: dict, spec: dict) -> EnvReport:
    """Judge a probe result against the manifest's "python" and "torch" entries."""
    report = EnvReport(python=python, info=info)
    py = tuple(info["python"])
    supported = packaging.specifiers.SpecifierSet(f">={spec['python']['min']},<{spec['python']['below']}")
    if packaging.version.Version(".".join(map(str, py))) not in supported:
        report.errors.append(f"Python {'.'.join(map(str, py))} is outside the supported range "
                             f">={spec['python']['min']},<{spec['python']['below']}")
    torch, npu = info.get("torch"), info.get("torch_npu")
    if torch is None:
        report.warnings.append("torch is not installed in this interpreter: ComfyUI will not start until it is "
                               "(install the torch and torchaudio versions `h3kit doctor` names into it; NPU: torch and "
                               "torch-npu from the table in the README)")
    elif info.get("torchaudio") is None:
        report.warnings.append("torchaudio is not installed: the pinned comfy/sd.py imports it at start-up")
    if npu is not None:
        if torch is None:
            report.errors.append(f"torch-npu {npu} is installed without torch")
        else:
            build = gpu_build(torch, info.get("torch_build"))
            if build:
                report.errors.append(f"torch {torch} is a {build}; torch-npu {npu} needs the CPU build of the same "
                                     f"version (pip install 'torch=={'.'.join(map(str, _base(torch)))}' --index-url "
                                     "https://download.pytorch.org/whl/cpu into " + python + ")")
            if _base(npu) != _base(torch):
                want = ".".join(map(str, _base(npu)))
                report.errors.append(f"torch-npu {npu} needs torch {want}.*, but torch {torch} is installed "
                                     f"(pip install 'torch=={want}' into {python})")
            known = {(p["torch_npu"], p["torch"]) for p in spec["torch"]["npu"]}
            if (".".join(map(str, _base(npu))), ".".join(map(str, _base(torch)))) not in known:
                tested = ", ".join(f"torch-npu {p['torch_npu']} + torch {p['torch']} (CANN {p['cann']})"
                                   for p in spec["torch"]["npu"])
                report.warnings.append(f"torch-npu {npu} with torch {torch} is not a tested pairing (tested: {tested})")
    return report


def check(python: str, spec: dict, packages: bool = False) -> EnvReport:
    info = probe(python, packages)
    found = info.pop("packages", None)
    report = evaluate(python, info, spec)
    report.packages = found
    return report


def package_drift(recorded: list[str], now: list[str]) -> dict:
    """What changed between two "name==version" lists: {"changed": ["torch 2.14.1 -> 2.14.0"], "added":
    [...], "removed": [...]}, each sorted; all empty when nothing did."""
    def table(items):  # normalised name -> (name as written, version)
        return {re.sub(r"[-_.]+", "-", name).lower(): (name, version)
                for name, _, version in (item.partition("==") for item in items)}

    before, after = table(recorded), table(now)
    changed = [f"{after[k][0]} {before[k][1]} -> {after[k][1]}"
               for k in sorted(before.keys() & after.keys()) if before[k][1] != after[k][1]]
    return {"changed": changed, "added": ["==".join(after[k]) for k in sorted(after.keys() - before.keys())],
            "removed": ["==".join(before[k]) for k in sorted(before.keys() - after.keys())]}
