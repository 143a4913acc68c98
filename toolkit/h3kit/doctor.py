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
tree         `h3kit verify` of the installed tree
service      `h3kit status` of its service
models       the model files the shipped workflows load, in models/ and extra_model_paths.yaml, with
             their sizes; a truncated safetensors file is an error
disk, ram    free disk space where ComfyUI writes, host memory against the model files

Nothing here imports torch: the interpreter answers through envprobe.py in a subprocess. Nothing is
written: git runs with GIT_OPTIONAL_LOCKS=0, the service is only asked over HTTP, and no file is created.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from h3kit import devices as h3devices
from h3kit import cliutil, install, manifest, monitoring, pyenv, smi
from h3kit import service as h3service
from h3kit.errors import H3kitError
from h3kit.paths import repo_root
from h3kit.runtime import costmodel

CHECKS = ("interpreter", "torch", "cann", "metrics", "driver", "devices", "memory", "tree", "service", "models", "disk",
          "shm", "ram")
PROBE_TIMEOUT = 180.0          # importing torch_npu and touching every card can take a minute
GB = 1e9
DISK_ERROR_BYTES = 2 * GB      # below this ComfyUI cannot write a video, a log or its database
DISK_WARN_BYTES = 20 * GB
SAFETENSORS_HEADER_MAX = 100 * 1024 * 1024
SERVICE_TIMEOUT = 3.0
# The process transport hands each command's inputs and results between the server and worker rank 0 through
# /dev/shm. The largest is the VAE decode's result: every decoded temporal chunk at once (the upstream VAE's chunks
# of 7 latents, 28 frames, overlapping by 2 latents), at fp32 (the VAE's working dtype where fp16 is not used): 7.3 GB
# for 768p/15 s, whose video alone is about 4.5 GB. Containers default /dev/shm to 64 MB.
SHM_PATH = "/dev/shm"
VAE_CHUNK_LATENTS, VAE_TOKEN_DROP, VAE_TIME_STRIDE = 5, 3, 4  # comfy/ldm/minimax/vae.py: ceil(17 / 4), token_drop
VAE_CHUNK_OVERLAP = (-VAE_TOKEN_DROP) % VAE_CHUNK_LATENTS     # 2 latents each chunk shares with the next

@dataclass
class Finding:
    check: str
    severity: str
    message: str
    fix: str | None = None
    lines: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        out = {"check": self.check, "severity": self.severity, "message": self.message}
        if self.fix:
            out["fix"] = self.fix
        if self.lines:
            out["lines"] = self.lines
        return out


@dataclass
class Options:
    comfy_home: Path | None = None
    devices: str | None = None
    device_type: str = "auto"
    python: str | None = None
    runtime_root: str | None = None


def run(opts: Options) -> dict:
    """Every check; returns {"ok", "findings", "facts", ...}. Raises only for bad input (UsageError)."""
    return _Doctor(opts).run()


class _Doctor:
    def __init__(self, opts: Options):
        self.opts = opts
        self.env = dict(os.environ)
        self.home = Path(opts.comfy_home).expanduser().absolute() if opts.comfy_home else None
        self.kind = h3devices.resolve_device_type(opts.device_type)
        self.findings: list[Finding] = []
        self.facts: dict = {"device_type": self.kind}
        self.requested, self.requested_from = None, None
        self.service = None
        self.found_models: dict = {}

    def add(self, check, severity, message, fix=None, lines=()):
        self.findings.append(Finding(check, severity, message, fix, list(lines)))

    def run(self) -> dict:
        self.data = manifest.load()
        self._requested_devices()
        if self.home is not None:
            self._service()
        python = self._interpreter()
        info = self._probe(python) if python else None
        if info is not None:
            self._torch(python, info)
            if self.kind == "npu" or info.get("torch_npu"):
                self._cann(info)
            self.add("metrics", *monitoring.doctor_finding(info, python))  # prometheus_client, for GET /metrics
        smi_info = self._driver()
        self._devices(info, smi_info)
        self._memory(info, smi_info)
        if self.home is not None:
            self._tree()
            self._models()
        else:
            self.add("tree", "info", "no --comfy-home: the installed tree, its service and its models were not checked",
                     "pass --comfy-home DIR (or set H3KIT_COMFY_HOME)")
        self._disk()
        self._shm()
        self._ram()
        self.findings.sort(key=lambda f: CHECKS.index(f.check))
        errors = sum(f.severity == "error" for f in self.findings)
        warnings = sum(f.severity == "warning" for f in self.findings)
        return {"ok": errors == 0, "errors": errors, "warnings": warnings, "host": socket.gethostname(),
                "comfy_home": str(self.home) if self.home else None, "device_type": self.kind,
                "devices": self.requested, "devices_from": self.requested_from,
                "findings": [f.to_dict() for f in self.findings], "facts": self.facts}

    # ---- devices asked for ------------------------------------------------------------------------------

    def _requested_devices(self):
        if self.opts.devices is not None:
            self.requested, self.requested_from = h3devices.parse_device_list(self.opts.devices), "--devices"
            return
        var = h3devices.VISIBLE_ENV.get(self.kind)
        if self.kind != "cpu" and self.env.get(var):
            try:
                self.requested = h3devices.parse_device_list(self.env[var])
                self.requested_from = f"{var}={self.env[var]}"
            except H3kitError as e:
                self.add("devices", "error", f"{var}={self.env[var]!r} in this shell: {e.message}", e.hint)

    # ---- the interpreter and what it has ----------------------------------------------------------------

    def _interpreter(self) -> str | None:
        python, source = self.opts.python, "--python"
        if not python and self.home is not None:
            try:
                python = (install.load_state(self.home) or {}).get("python")
                source = str(install.state_path(self.home))
            except H3kitError as e:
                self.add("interpreter", "error", e.message, e.hint)
        if not python:
            python, source = sys.executable, "h3kit's own interpreter"
            self.add("interpreter", "warning", f"no interpreter recorded for ComfyUI: checking {python}, the one "
                     "h3kit runs in", "pass --python with the interpreter that runs ComfyUI (or run h3kit install "
                     "--python PY, which records it)")
        try:
            python = h3service.resolve_python(self.home or Path(tempfile.gettempdir()), python)
        except H3kitError as e:
            self.add("interpreter", "error", e.message, e.hint)
            return None
        self.facts["python"] = {"path": python, "from": source}
        return python

    def _probe(self, python: str) -> dict | None:
        env = dict(self.env)
        if self.requested is not None and self.kind != "cpu":
            env = h3service.child_environment(self.kind, self.requested, env)  # what `h3kit start` exposes
        cmd = [python, str(pyenv.PROBE), "--deep", "--device-type", self.kind]
        try:
            proc = cliutil.run_captured(cmd, timeout=PROBE_TIMEOUT, env=env)
        except subprocess.TimeoutExpired:
            self.add("interpreter", "error", f"{python} did not answer the probe within {PROBE_TIMEOUT:g} s",
                     "a device or driver call hangs: check the driver (npu-smi info / nvidia-smi) first")
            return None
        except OSError as e:
            proc = subprocess.CompletedProcess(cmd, 126, "", str(e))
        try:
            info = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            tail = " ".join(proc.stderr.strip().splitlines()[-3:])
            self.add("interpreter", "error", f"{python} could not run the environment probe (exit {proc.returncode}): "
                     f"{tail or 'no answer'}", "pass --python with a working interpreter (a wrapper script must "
                     "exec python \"$@\")")
            return None
        self.facts["probe"] = info
        version = ".".join(map(str, info.get("python", [])))
        self.add("interpreter", "ok", f"{info.get('executable') or python} (Python {version}), from "
                 f"{self.facts['python']['from']}")
        return info

    def _torch(self, python: str, info: dict):
        env = pyenv.evaluate(python, info, self.data)
        install_cmd = torch_install_line(self.data, self.kind, python)
        torch = info.get("torch")
        for message in env.errors:
            self.add("torch", "error", message, install_cmd)
        for message in env.warnings:
            if torch is None and message.startswith("torch is not installed"):
                continue  # said below, as the error it is, with the versions and the command
            if info.get("torchaudio") is None and message.startswith("torchaudio is not installed"):
                self.add("torch", "error", f"torchaudio is not installed in {python}: the pinned comfy/sd.py imports "
                         f"it at start-up, so ComfyUI will not start", torch_install_line(self.data, self.kind, python,
                                                                                          only_audio=True))
                continue
            self.add("torch", "warning", message)
        if torch is None:
            self.add("torch", "error", f"torch is not installed in {python}: ComfyUI will not start without it "
                     f"(this host needs {torch_versions(self.data, self.kind)})", install_cmd)
        imported = info.get("torch_import") or {}
        if torch is not None and not imported.get("ok", True):
            self.add("torch", "error", f"import torch fails in {python}: {imported.get('error')}",
                     f"reinstall torch into that interpreter: {install_cmd}")
        build = info.get("torch_build") or {}
        if self.kind == "cuda" and torch is not None and not build.get("cuda"):
            self.add("torch", "error", f"torch {torch} is not a CUDA build, but the device type is cuda",
                     "install a CUDA build of torch, or choose --device-type npu|cpu")
        if self.kind == "npu" and not info.get("torch_npu") and torch is not None:
            self.add("torch", "error", f"torch-npu is not installed in {python} (this host needs "
                     f"{torch_versions(self.data, self.kind)})", install_cmd)
        if torch is not None and not env.errors and imported.get("ok", True):
            what = pyenv.gpu_build(torch, build) or "CPU build"
            extra = f", torch-npu {info['torch_npu']}" if info.get("torch_npu") else ""
            self.add("torch", "ok", f"torch {torch}: {what}{extra}, torchaudio {info.get('torchaudio')}")

    def _cann(self, info: dict):
        cann = info.get("cann") or {}
        npu = info.get("torch_npu")
        entry = next((p for p in self.data["torch"]["npu"] if npu and pyenv._base(npu) == pyenv._base(p["torch_npu"])),
                     self.data["torch"]["npu"][0])
        want = f"CANN {entry['cann']}" + (f" ({', '.join(c + '.x' for c in entry.get('cann_compatible', []))} "
                                          "compatible)" if entry.get("cann_compatible") else "")
        setenv = "source CANN's set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh) in a wrapper script " \
                 "that execs python, and pass that script as --python"
        if not cann.get("version"):
            self.add("cann", "error", f"CANN not found (looked in {', '.join(cann.get('searched') or ['nothing'])}); "
                     f"torch-npu {npu or entry['torch_npu']} needs {want}", f"install {want}, then {setenv}")
        else:
            verdict = cann_pairing(cann["version"], entry)
            if verdict is None:
                self.add("cann", "error", f"CANN {cann['version']} (from {cann['file']}) is not paired with torch-npu "
                         f"{entry['torch_npu']}, which needs {want}", f"install {want}, or the torch-npu release made "
                         f"for CANN {cann['version']}")
            else:
                self.add("cann", "ok", f"CANN {cann['version']} at {cann['home']}: {verdict} for torch-npu "
                         f"{entry['torch_npu']}")
        imported = info.get("torch_npu_import")
        if imported and not imported.get("ok"):
            self.add("cann", "error", f"import torch_npu fails: {imported.get('error')}", setenv)

    # ---- driver and devices -----------------------------------------------------------------------------

    def _driver(self) -> dict | None:
        if self.kind == "cpu":
            return None
        tool = "npu-smi" if self.kind == "npu" else "nvidia-smi"
        answer = smi.query(self.kind)
        if answer is None:
            self.add("driver", "warning", f"{tool} is not on PATH: the driver's own view of the cards is missing",
                     f"install the {'Ascend driver (npu-smi comes with it)' if self.kind == 'npu' else 'NVIDIA driver'}"
                     f" or add its bin folder to PATH")
            return None
        if answer.get("error"):
            self.add("driver", "error", answer["error"], f"check that the driver is loaded: {tool} must list the cards")
            return None
        self.facts["driver"] = answer
        names = sorted({d["name"] for d in answer["devices"]})
        self.add("driver", "ok", f"{tool} {answer.get('version')}: {len(answer['devices'])} device(s) "
                 f"({', '.join(names)})")
        for i, d in enumerate(answer["devices"]):
            health = d.get("health", "OK")
            if health != "OK" and (self.requested is None or i in self.requested):
                self.add("driver", "warning" if health == "Warning" else "error",
                         f"{tool}: device {i} ({d.get('name')}) reports health {health}",
                         f"see `{tool} info -t health -i {d.get('npu', i)}` and the driver's log before using it")
        return answer

    def _devices(self, info: dict | None, smi_info: dict | None):
        if self.kind == "cpu":
            n = len(self.requested) if self.requested else None
            self.add("devices", "info", "cpu: devices are simulated (H3KIT_SIM_DEVICES), every rank runs on the host"
                     + (f"; {n} asked" if n else ""))
            return
        var = h3devices.VISIBLE_ENV[self.kind]
        if self.opts.devices is not None and self.env.get(var) and self.env[var] != self.opts.devices:
            self.add("devices", "warning", f"this shell sets {var}={self.env[var]}, but --devices is {self.opts.devices}: "
                     "h3kit start exposes --devices, while parity, calibrate and scripts run from this shell see "
                     f"{self.env[var]}", f"unset {var}, or set it to {self.opts.devices}")
        seen = (info or {}).get("devices") or {}
        listed = len(smi_info["devices"]) if smi_info else None
        if self.requested is not None and listed is not None:
            missing = [i for i in self.requested if i >= listed]
            if missing:
                self.add("devices", "error", f"device id(s) {', '.join(map(str, missing))} do not exist: "
                         f"{'npu-smi' if self.kind == 'npu' else 'nvidia-smi'} lists {listed} device(s)",
                         f"use ids 0..{listed - 1} in --devices")
        if seen.get("error") or "count" not in seen:
            if info is not None and (info.get("torch_import") or {}).get("ok"):
                self.add("devices", "error", f"torch sees no {self.kind} device: {seen.get('error', 'no answer')}",
                         "fix the torch / driver findings above first")
            return
        count = seen["count"]
        shown = f"{var}={','.join(map(str, self.requested))}" if self.requested is not None else f"{var} unset"
        if self.requested is not None and count < len(self.requested):
            self.add("devices", "error", f"{len(self.requested)} device(s) asked ({self.requested_from}), but torch sees "
                     f"only {count} with {shown}", "check the ids against npu-smi info / nvidia-smi; a busy or "
                     "unhealthy card, or a container exposing fewer cards, shows this way")
        elif count == 0:
            self.add("devices", "error", f"torch sees no {self.kind} device ({shown})", "check the driver findings")
        else:
            names = sorted({d.get("name") or "?" for d in seen["list"]})
            self.add("devices", "ok", f"torch sees {count} {self.kind} device(s) with {shown}: {', '.join(names)}")

    def _memory(self, info: dict | None, smi_info: dict | None):
        if self.kind == "cpu":
            return
        free = device_free_memory(self.kind, (info or {}).get("devices"), smi_info, self.requested)
        if not free:
            self.add("memory", "warning", "free device memory is unknown (torch and the driver tool could not say)",
                     "fix the findings above; doctor then compares it with what each tier needs")
            return
        self.facts["free_memory"] = free
        verdicts = tier_memory(free)
        self.facts["tiers"] = verdicts
        lines = [f"{v['npu_count']} device(s), {v['geometry']}: needs {v['need_bf16'] / GB:.1f} GB at BF16, "
                 f"{v['need_int8'] / GB:.1f} GB with INT8 weights"
                 + (f" (sharded: {v['need_bf16_sharded'] / GB:.1f} / {v['need_int8_sharded'] / GB:.1f} GB)"
                    if v["npu_count"] > 1 else "")
                 + f"; smallest free {v['free'] / GB:.1f} GB: {v['verdict']}" for v in verdicts]
        mine = [v for v in verdicts if v["npu_count"] == max(v["npu_count"] for v in verdicts)]
        short = next((v for v in mine if v["geometry"] == "768p/5s"), mine[0])
        held = " (the service holds memory on them now)" if self.service and self.service.get("running") else ""
        if short["verdict"] == "does not fit":
            self.add("memory", "error", f"{short['npu_count']} device(s) at {short['geometry']}: even INT8 weights "
                     f"need {short['need_int8'] / GB:.1f} GB, the devices have {short['free'] / GB:.1f} GB free{held}",
                     "free the cards (other processes: npu-smi info / nvidia-smi) or use cards with more memory",
                     lines)
        elif short["verdict"] != "fits":
            self.add("memory", "warning", f"{short['npu_count']} device(s) at {short['geometry']}: BF16 needs "
                     f"{short['need_bf16'] / GB:.1f} GB per device, {short['free'] / GB:.1f} GB free{held}: "
                     f"{short['verdict']}", "set weights sharded on MultiNPUParallelConfig (auto does it where a "
                     "replica does not fit), use INT8 DiT weights, or rely on ComfyUI's partial loading (slower); "
                     "docs/deployment.md section 2, 'Tiers' (h3kit plan --tiers)", lines)
        else:
            self.add("memory", "ok", f"every tier up to {short['npu_count']} device(s) fits 768p/5 s at BF16", lines=lines)

    # ---- tree, service, models ------------------------------------------------------------------------

    def _tree(self):
        try:
            with _no_git_locks():
                result = install.verify(self.home)
        except H3kitError as e:
            self.add("tree", "error", e.message, e.hint or f"h3kit install --comfy-home {self.home}")
            return
        for problem in result["problems"]:
            self.add("tree", "error", problem, f"h3kit install --comfy-home {self.home} (--force if files were edited)")
        for warning in result["warnings"][:10]:
            self.add("tree", "warning", warning)
        if result["ok"]:
            self.add("tree", "ok", f"installed at the pin {result['pin'][:12]} with {len(result['patches'])} patches "
                     "(h3kit verify: clean)")

    def _service(self):
        try:
            root = h3service.runtime_root(self.home, self.opts.runtime_root)
            status = h3service.status(root, timeout=SERVICE_TIMEOUT)
        except H3kitError as e:
            self.add("service", "warning", e.message, e.hint)
            return
        self.service = status
        if not status.get("record"):
            self.add("service", "info", "not running (no record)", f"h3kit start --comfy-home {self.home} --devices ...")
        elif not status.get("running"):
            self.add("service", "warning", f"recorded but not running: {status.get('stale')}",
                     f"h3kit restart --comfy-home {self.home} (h3kit status shows the last log's first error)")
        elif not status.get("healthy"):
            self.add("service", "error", f"pid {status.get('pid')} runs but does not answer at {status.get('url')}: "
                     f"{status.get('health')}", "h3kit logs --errors, then h3kit restart")
        else:
            self.add("service", "ok", f"running: pid {status['pid']} at {status['url']}, {status['device_type']} devices "
                     f"{','.join(map(str, status['requested_devices']))}")
            if self.requested is None:
                self.requested = list(status["requested_devices"])
                self.requested_from = "the running service"
            elif list(status["requested_devices"]) != self.requested:
                self.add("service", "warning", f"the service runs on devices {status['requested_devices']}, "
                         f"not {self.requested} ({self.requested_from})", "h3kit stop, then start with the devices you mean")

    def _models(self):
        from h3kit.workflow import models
        try:
            tree = models.open_install(str(self.home))
        except H3kitError as e:
            self.add("models", "error", e.message, e.hint)
            return
        needed = shipped_model_files()
        by_workflow: dict[str, list] = {}
        found, missing, broken = {}, {}, []
        for (kind, name), workflows in sorted(needed.items()):
            path = tree.find_model(kind, name)
            if path is None:
                missing[(kind, name)] = workflows
            else:
                found[(kind, name)] = (path, os.path.getsize(path))
                problem = safetensors_problem(path)
                if problem:
                    broken.append(f"{path}: {problem}")
            for wf in workflows:
                by_workflow.setdefault(wf, []).append((kind, name))
        ready = sorted(wf for wf, files in by_workflow.items() if all(f in found for f in files))
        self.found_models = {wf: sum(found[f][1] for f in files if f in found) for wf, files in by_workflow.items()}
        if missing:
            self._missing_models(tree, missing, ready)
        for problem in broken:
            self.add("models", "error", problem, "download the file again (compare its size and checksum with the source)")
        lines = [f"{kind}/{name}: {size / GB:.2f} GB at {path}" for (kind, name), (path, size) in sorted(found.items())]
        if found:
            self.add("models", "ok" if not missing and not broken else "info",
                     f"{len(found)} of {len(needed)} model file(s) found, {sum(s for _, s in found.values()) / GB:.1f} GB; "
                     f"workflows ready: {', '.join(ready) or 'none'}", lines=lines)

    def _missing_models(self, tree, missing: dict, ready: list):
        """One finding for every missing file, with one `h3kit models fetch` over the shipped workflows that
        need them (their installed copies when install put them in the tree) and each file's source in the
        words of `h3kit models list`."""
        from h3kit.weights import listing, sources

        users = sorted({wf for workflows in missing.values() for wf in workflows})
        paths = []
        for wf in users:
            copy = self.home / install.WORKFLOW_DEST / wf
            paths.append(str(copy if copy.is_file() else repo_root() / "workflows" / wf))
        known = {(w.kind, w.name): w for w in listing.collect(paths)}
        lines, unknown = [], []
        for (kind, name), workflows in missing.items():
            w = known.get((kind, name))
            src = w.sources if w is not None else sources.sources_for(kind, name)
            if not src:
                unknown.append(f"{kind}/{name}")
            lines.append(f"{kind}/{name} (needed by {', '.join(workflows)}; searched {tree.folders(kind)}); "
                         f"source: {sources.describe(src)}")
        fix = f"h3kit models fetch {' '.join(paths)} --comfy-home {self.home} (add --dry-run to see sizes and " \
              "free space first, --models-dir DIR for shared storage)"
        if unknown:
            fix += f"; no source is known for {', '.join(unknown)}: download it into models/<kind>/ or a folder " \
                   "listed in extra_model_paths.yaml"
        self.add("models", "warning" if ready else "error",
                 f"{len(missing)} model file(s) missing, needed by {', '.join(users)}", fix, lines)

    # ---- host ---------------------------------------------------------------------------------------------

    def _disk(self):
        places = {"temp": Path(tempfile.gettempdir())}
        if self.home is not None and self.home.is_dir():
            places["comfy-home"] = self.home
            for sub in ("models", "output"):
                if (self.home / sub).is_dir():
                    places[sub] = (self.home / sub).resolve()
        seen = {}
        for label, path in places.items():
            try:
                dev = path.stat().st_dev
                seen.setdefault(dev, (label, path, shutil.disk_usage(path).free))
            except OSError:
                continue
        for label, path, free in seen.values():
            if free < DISK_ERROR_BYTES:
                self.add("disk", "error", f"{label} ({path}): {free / GB:.1f} GB free", "free disk space: ComfyUI writes "
                         "outputs, temp files and its database there")
            elif free < DISK_WARN_BYTES:
                self.add("disk", "warning", f"{label} ({path}): {free / GB:.1f} GB free", "free some space before long runs")
            else:
                self.add("disk", "ok", f"{label} ({path}): {free / GB:.0f} GB free")

    def _shm(self):
        try:
            st = os.statvfs(SHM_PATH)
            free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        except OSError:
            free = total = None
        several = self.kind in ("npu", "cuda") or (self.requested is not None and len(self.requested) > 1)
        try:
            needs = shm_needs()
        except Exception as e:  # a shipped workflow that does not parse is the models check's finding
            needs = shm_needs(workflows=False)
            needs["note"] = f"shipped workflows not read ({type(e).__name__})"
        severity, message, fix = shm_verdict(free, several, needs, total)
        self.facts["shm"] = {"path": SHM_PATH, "free": free, "size": total,
                             "needs": {k: v for k, v in needs.items() if k != "note"}}
        self.add("shm", severity, message, fix)

    def _ram(self):
        total = _meminfo("MemTotal")
        if total is None:
            return
        biggest = max(self.found_models.values(), default=0)
        message = f"host memory {total / GB:.0f} GB"
        if biggest and total < biggest:
            self.add("ram", "warning", f"{message}, less than the {biggest / GB:.0f} GB of model files one shipped "
                     "workflow loads: ComfyUI reads them into host memory first", "expect reloads between prompts; "
                     "INT8 files, or a host with more memory")
        else:
            self.add("ram", "ok", message + (f" ({biggest / GB:.0f} GB of model files per workflow)" if biggest else ""))


# ---- pieces with their own tests -------------------------------------------------------------------------

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


def torch_install_line(data: dict, kind: str, python: str, only_audio: bool = False) -> str:
    """The exact pip command that puts source_deps_info.json's pairing for `kind` into `python` (the commands
    of docs/deployment.md, section 0). torchaudio goes in with --no-deps: the newest on the registry declares
    an older torch but imports and resamples fine with the paired one."""
    cpu = data["torch"]["cpu"]
    py = shlex.quote(str(python))
    audio = f"{py} -m pip install --no-deps torchaudio=={cpu['torchaudio']}"
    if only_audio:
        return audio
    index = "--index-url https://download.pytorch.org/whl/cpu"
    if kind == "npu":
        entry = data["torch"]["npu"][0]
        return (f"{py} -m pip install torch=={entry['torch']} {index} && {py} -m pip install "
                f"torch-npu=={entry['torch_npu']} && {audio}; then install CANN {entry['cann']} and pass --python a "
                "wrapper that sources its set_env.sh (docs/deployment.md, 'A new machine')")
    if kind == "cuda":
        return (f"{py} -m pip install torch=={cpu['torch']} torchvision=={cpu['torchvision']} (the CUDA build "
                f"for this driver: https://pytorch.org/get-started/locally/) && {audio}")
    return f"{py} -m pip install torch=={cpu['torch']} torchvision=={cpu['torchvision']} {index} && {audio}"


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
            mem = costmodel.memory_per_device(seq, n, "bf16")
            act = mem["activations"] + mem["communicators"]  # and the HCCL communicators' buffers
            bf16, int8 = costmodel.weight_bytes("bf16") + act, costmodel.weight_bytes("int8") + act
            sharded = {w: costmodel.memory_per_device(seq, n, "bf16", weights=w, sharding="sharded")["total"]
                       for w in ("bf16", "int8")}
            verdict = ("fits" if bf16 <= smallest else "INT8 weights fit; BF16 only with partial loading"
                       if int8 <= smallest else "BF16 and INT8 only with partial loading" if act < smallest
                       else "does not fit")
            out.append({"npu_count": n, "geometry": name, "seq_len": seq, "need_bf16": bf16, "need_int8": int8,
                        "need_bf16_sharded": sharded["bf16"], "need_int8_sharded": sharded["int8"],
                        "free": smallest, "verdict": verdict})
    return out


def shipped_model_files() -> dict:
    """{(kind, file name): [workflow file names]} for every model file the shipped workflows load."""
    from h3kit.workflow import graph as graph_mod, load, models, resolve
    from h3kit.workflow.catalog import load_catalog
    catalog = load_catalog()
    out: dict = {}
    for path in sorted((repo_root() / "workflows").glob("*.json")):
        graph = graph_mod.build_graph(load.read_workflow(str(path)), catalog)
        for _node, _input, kind, name in models.model_references(graph, resolve.value):
            users = out.setdefault((kind, name), [])
            if path.name not in users:
                users.append(path.name)
    return out


def safetensors_problem(path: str) -> str | None:
    """Why a .safetensors file cannot be whole (a truncated download), or None. Reads only its header."""
    if not path.endswith(".safetensors"):
        return None
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{size} bytes: too short for a safetensors header"
            n = int.from_bytes(head, "little")
            if n > SAFETENSORS_HEADER_MAX or 8 + n > size:
                return f"header of {n} bytes does not fit in the file's {size} bytes (truncated or not safetensors)"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        return f"unreadable header ({type(e).__name__})"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
            and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2]
    want = 8 + n + max(ends, default=0)
    if size < want:
        return f"truncated: {size} of {want} bytes"
    return None


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@contextlib.contextmanager
def _no_git_locks():
    # `git status` refreshes the index when it can; doctor must not write anything
    saved = os.environ.get("GIT_OPTIONAL_LOCKS")
    os.environ["GIT_OPTIONAL_LOCKS"] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("GIT_OPTIONAL_LOCKS", None)
        else:
            os.environ["GIT_OPTIONAL_LOCKS"] = saved
