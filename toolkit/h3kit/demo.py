"""h3kit demo: the whole deployment end to end, on tiny random weights, in minutes, on CPU or devices.

Stages: install (if the tree is not installed and verified), checkpoints (four tiny H3 components written
with the real upstream classes, h3kit.tiny_models), start (the service on N devices, simulated on CPU),
check-workflow (the shipped demo workflow, statically), prompt (POST /prompt, followed on /ws), parity
(N > 1: the same prompt with npu_count 1, latents compared), stop (unless kept running or not ours).
Every failure names its stage and, where the server was involved, the log line that explains it. The demo
holds the tree lock of its home from start to end (install and the service take it too, re-entrantly), and
Ctrl-C or SIGTERM stops the server it started before it exits.
With weights "int8" the DiT is the same tiny DiT with its block linears in INT8 (h3kit_tiny_dit_int8, as the
published H3 INT8 files), and the server log must show its INT8 linears ran on the NPU INT8 arm.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from h3kit import cliutil, comfyws, devices as h3devices, group, health, locks, logscan, outputs, paths, proc, progress
from h3kit import service
from h3kit.errors import H3kitError, UsageError
from h3kit.paths import repo_root

DEMO_WORKFLOW = Path("workflows/api/demo_t2va_tiny.json")
CONFIG_NODE = "MultiNPUParallelConfig"
# component: (models subfolder and file name, seed); the names the demo workflow's loaders use
TINY = {"dit": ("diffusion_models/h3kit_tiny_dit.safetensors", 1),
        "te": ("text_encoders/h3kit_tiny_te.safetensors", 2),
        "video_vae": ("vae/h3kit_tiny_video_vae.safetensors", 3),
        "audio_vae": ("vae/h3kit_tiny_audio_vae.safetensors", 4)}
# --weights int8: the demo DiT (same seed) with its block linears in INT8, in place of "dit"
TINY_INT8_DIT = ("dit_int8", ("diffusion_models/h3kit_tiny_dit_int8.safetensors", 1))
WEIGHTS = ("float", "int8")
# what comfy/npu_quant.py logs once its INT8 arm has served a call (reference kernels on cpu, torch_npu on npu)
INT8_ARM_LOG = "NPU INT8: int8 linears on "
PARITY_GATE = 1e-5  # the DiT parity gate (fp32), applied to the whole pipeline's latents
PROMPT_TIMEOUT = 900.0
HISTORY_WAIT = 30.0

# node class -> the stage a user thinks in
STAGES = (("load", ("Loader", CONFIG_NODE)), ("text encode", ("TextEncode", "ToVideo", "ImageToVideo")),
          ("sample", ("Sampler", "Guider", "Scheduler", "RandomNoise", "KSampler")),
          ("decode", ("VAEDecode",)), ("save", ("Save", "CreateVideo", "SeparateAVLatent")))


class DemoFailed(H3kitError):
    code = "demo_failed"


def stage_of(class_type: str) -> str:
    for name, needles in STAGES:
        if any(n in class_type for n in needles):
            return name
    return "other"


def stage_seconds(trace: comfyws.PromptTrace) -> dict[str, float]:
    out: dict[str, float] = {}
    for n in trace.nodes:
        out[stage_of(n.class_type)] = round(out.get(stage_of(n.class_type), 0.0) + n.seconds, 3)
    return out


@dataclass
class DemoOptions:
    comfy_home: Path
    device_type: str = "auto"
    npu_count: int = 2
    keep_running: bool = False
    source: str | None = None
    python: str | None = None
    port: int = service.DEFAULT_PORT
    timeout: float = PROMPT_TIMEOUT
    weights: str = "float"
    transport: str = "auto"


class _Stages:
    def __init__(self, log):
        self.log = log
        self.done: list[dict] = []
        self.server_log: str | None = None

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        entry = {"stage": name, "seconds": None, "detail": ""}
        self.log(f"{name} ...")
        try:
            yield entry
        except H3kitError as e:
            if e.details and "stage" in e.details:  # already named by an inner stage
                raise
            raise self._failed(name, e.message, hint=e.hint, cause=e.code, extra=e.details) from None
        except (OSError, ValueError, KeyError, subprocess.SubprocessError) as e:
            raise self._failed(name, f"{type(e).__name__}: {e}") from None
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        self.done.append(entry)
        self.log(f"{name}: {entry['seconds']} s {entry['detail']}".rstrip())

    def _failed(self, name, message, hint=None, cause=None, extra=None) -> DemoFailed:
        line = None
        if self.server_log:
            blk = logscan.first_error(self.server_log)
            line = blk.summary if blk else None
        text = f"stage {name!r} failed: {message}" + (f"\n  server log: {line}" if line else "")
        if hint is None and self.server_log:
            hint = f"the whole server log: {self.server_log}"
        return DemoFailed(text, hint=hint, details={"stage": name, "cause": cause, "log_line": line,
                                                   "log": self.server_log, "stages": self.done, "error": extra})


def tiny_components(weights: str = "float") -> dict:
    """{component: (models path, seed)} of the four files the demo runs with these weights."""
    if weights == "int8":
        return {TINY_INT8_DIT[0]: TINY_INT8_DIT[1], **{c: v for c, v in TINY.items() if c != "dit"}}
    return dict(TINY)


def write_tiny_checkpoints(home: Path, python: str, weights: str = "float") -> dict:
    """Write whichever tiny components are missing under <home>/models, in one ComfyUI interpreter."""
    models = home / "models"
    wanted = tiny_components(weights)
    missing = {c: (models / rel, seed) for c, (rel, seed) in wanted.items() if not (models / rel).is_file()}
    if not missing:
        return {"written": [], "present": sorted(wanted)}
    for path, _ in missing.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    script = (paths.h3kit_import_code() + "import sys, json\nfrom h3kit import tiny_models\n"
              "for comp, path, seed in json.loads(sys.argv[1]):\n"
              "    tmp = path + '.tmp'\n"
              "    tiny_models.write(comp, tmp, seed)\n"
              "    __import__('os').replace(tmp, path)\n")
    todo = json.dumps([[c, str(p), s] for c, (p, s) in missing.items()])
    env = dict(os.environ, PYTHONPATH=str(home))
    proc_ = cliutil.run_captured([python, "-c", script, todo], timeout=900, cwd=home, env=env)
    if proc_.returncode != 0:
        raise DemoFailed("writing the tiny checkpoints failed: " + (proc_.stderr.strip().splitlines() or ["?"])[-1],
                         hint=f"from {home}, PYTHONPATH={paths.package_dir().parent} {python} -m h3kit.tiny_models dit "
                              "/tmp/x.safetensors shows the whole error")
    return {"written": sorted(missing), "present": sorted(set(wanted) - set(missing))}


def demo_prompt(npu_count: int, tag: str, weights: str = "float") -> dict:
    """The shipped demo workflow (API format) with `npu_count` set, outputs named by `tag`, and with weights
    "int8" the tiny INT8 DiT in the UNETLoader."""
    prompt = json.loads((repo_root() / DEMO_WORKFLOW).read_text())
    for node in prompt.values():
        node.pop("_meta", None)
        if node["class_type"] == CONFIG_NODE:
            node["inputs"]["npu_count"] = npu_count
        if node["class_type"] == "UNETLoader" and weights == "int8":
            node["inputs"]["unet_name"] = Path(TINY_INT8_DIT[1][0]).name
        prefix = node["inputs"].get("filename_prefix")
        if isinstance(prefix, str):
            folder, _, name = prefix.rpartition("/")
            node["inputs"]["filename_prefix"] = f"{folder}/{tag}_{name}" if folder else f"{tag}_{name}"
    return prompt


def run_prompt(rec: service.Record, prompt: dict, timeout: float, log=None) -> tuple[comfyws.PromptTrace, dict]:
    """Submit `prompt` to the recorded server, follow it on /ws; (trace, history outputs). With `log`, its
    progress is shown as it runs (h3kit.progress: a bar on a terminal, lines through `log` otherwise)."""
    host = proc.probe_host(rec.listen)
    client_id = uuid.uuid4().hex
    ws = comfyws.WebSocket(host, rec.port, client_id)
    try:
        t0 = time.monotonic()
        try:
            answer = health.request_json(rec.url + "/prompt", method="POST",
                                         body={"prompt": prompt, "client_id": client_id}, timeout=60)
        except health.HttpError as e:
            body = e.body or {}
            errors = [f"node {nid} ({ne.get('class_type')}): " + "; ".join(x.get("message", "") + " " + x.get("details", "")
                                                                            for x in ne.get("errors", []))
                      for nid, ne in (body.get("node_errors") or {}).items()]
            msg = (body.get("error") or {}).get("message", str(e))
            raise DemoFailed(f"the server refused the prompt: {msg}" + ("; " + " | ".join(errors) if errors else ""),
                             details=body) from None
        classes = {k: v["class_type"] for k, v in prompt.items()}
        shown = progress.PromptProgress(classes, log) if log else None
        try:
            trace = comfyws.follow(ws, answer["prompt_id"], classes, t0, timeout, on_event=shown)
        finally:
            if shown:
                shown.close()
    finally:
        ws.close()
    if trace.status == "timeout":
        health.cancel_prompt(rec.url, trace.prompt_id)  # never leave it running on a shared server
        raise DemoFailed(f"prompt {trace.prompt_id} did not finish within {timeout:g} s; it was cancelled",
                         hint="raise --timeout (the first load of real H3 weights takes minutes)")
    if trace.status != "success":
        err = trace.error or {}
        raise DemoFailed(f"the prompt ended with {trace.status}: node {err.get('node_id')} "
                         f"({err.get('node_type')}): {str(err.get('exception_message', '')).strip()}")
    # execution_success is sent from inside the executor; the worker files the history entry just after
    deadline = time.monotonic() + HISTORY_WAIT
    while True:
        history = health.request_json(f"{rec.url}/history/{trace.prompt_id}", timeout=30) or {}
        if trace.prompt_id in history:
            return trace, history[trace.prompt_id].get("outputs", {})
        if time.monotonic() > deadline:
            raise DemoFailed(f"prompt {trace.prompt_id} finished but is not in /history after {HISTORY_WAIT:g} s")
        time.sleep(0.05)


def int8_arm_line(log: str) -> str:
    """The server log's line saying the INT8 linears ran on the NPU arm; DemoFailed when there is none."""
    try:
        text = Path(log).read_text(errors="replace")
    except OSError as e:
        raise DemoFailed(f"cannot read the server log {log}: {e}") from None
    line = next((ln for ln in text.splitlines() if INT8_ARM_LOG in ln), None)
    if line is None:
        raise DemoFailed("the INT8 DiT ran, but not on the NPU INT8 arm (no 'NPU INT8:' line in the server log)",
                         hint="the tree lacks npu-int8-linear.patch (h3kit install), or H3KIT_NPU_INT8=off is set")
    return line[line.index(INT8_ARM_LOG):].strip()


def _output_file(home: Path, outputs_: dict, node_id: str, key: str) -> Path:
    items = (outputs_.get(node_id) or {}).get(key) or []
    if not items:
        raise DemoFailed(f"node {node_id} reported no {key} output")
    item = items[0]
    return home / item.get("type", "output") / item.get("subfolder", "") / item["filename"]


def _node_id(prompt: dict, class_type: str, contains: str = "") -> str:
    for nid, node in prompt.items():
        if node["class_type"] == class_type and contains in str(node["inputs"].get("filename_prefix", "")):
            return nid
    raise DemoFailed(f"the demo workflow has no {class_type} node {contains}".strip())


def run_demo(opts: DemoOptions, log=lambda m: None) -> dict:
    from h3kit import install as installer

    home = Path(opts.comfy_home).expanduser().absolute()
    if opts.npu_count not in h3devices.ALLOWED_COUNTS:
        raise UsageError(f"--npu-count {opts.npu_count}: H3 runs on 1, 2, 4 or 8 devices")
    if opts.weights not in WEIGHTS:
        raise UsageError(f"--weights {opts.weights}: use one of {', '.join(WEIGHTS)}")
    installer.check_home_path(home)
    require_interpreter(home, service.resolve_python(home, opts.python),
                        h3devices.resolve_device_type(opts.device_type))
    fresh = not home.exists() or not any(home.iterdir())
    had_state_dir = (home / locks.STATE_DIR).exists()
    try:  # the lock lives in the home: an empty folder is still a fresh one for install
        home.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DemoFailed(f"cannot create {home}: {e.strerror or e}", hint="choose a folder you can write to") from None
    held = False  # never remove a lock another command holds (a refused demo did not take it)
    try:
        with locks.tree_lock(home, progress=log):
            held = True
            return _run_demo(opts, home, log)
    except BaseException:
        if held and not had_state_dir:
            _remove_own_lock(home, fresh)
        raise


# What the demo runs in the interpreter before ComfyUI's own start: the checkpoints stage writes safetensors files
# with torch; ComfyUI imports torchaudio at start-up.
DEMO_MODULES = ("torch", "torchaudio", "safetensors")


def require_interpreter(home: Path, python: str, device_type: str) -> None:
    """Refuse, before anything is created, an interpreter that lacks what the demo and ComfyUI import: torch,
    torchaudio, safetensors (torch-npu on npu) and, once the tree exists, its requirements.txt. The same
    metadata-only probe `h3kit start` refuses an interpreter without torch with (service.require_torch); the
    fix is the exact pip line `h3kit doctor` prints."""
    from h3kit import manifest, pairing, pyenv

    try:
        found = pyenv.probe(python, packages=True).get("packages") or []
    except pyenv.PythonEnvError as e:
        raise pyenv.PythonEnvError(e.message, hint="pass --python the interpreter that runs ComfyUI") from None
    have = {_norm(item.partition("==")[0]) for item in found}
    need = list(DEMO_MODULES) + (["torch-npu"] if device_type == "npu" else [])
    reqs = home / "requirements.txt"
    need += [name for name in _requirement_names(reqs) if name not in need]
    missing = [name for name in need if _norm(name) not in have]
    if not missing:
        return
    fixes = []
    if {"torch", "torchaudio", "torch-npu"} & set(missing):
        fixes.append(pairing.torch_install_line(manifest.load(), device_type, python))
    if set(missing) - {"torch", "torchaudio", "torch-npu"}:
        fixes.append(f"{python} -m pip install -r {reqs}" if reqs.is_file() else
                     f"{python} -m pip install -r requirements.txt of the ComfyUI pin (ComfyUI's requirements; "
                     "docs/deployment.md, section 0)")
    raise pyenv.PythonEnvError(f"{python} lacks {', '.join(missing)}: the demo and ComfyUI cannot run with it",
                               hint="; then ".join(fixes) + " (or pass --python the interpreter that runs ComfyUI)",
                               details={"python": python, "missing": missing})


def _norm(name: str) -> str:
    import re
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(path: Path) -> list[str]:
    """The distribution names of a requirements file whose markers apply here (torch's trio left unpinned)."""
    import packaging.requirements

    names = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return names
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        try:
            req = packaging.requirements.Requirement(line)
        except packaging.requirements.InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate():
            names.append(req.name)
    return names


def _remove_own_lock(home: Path, fresh: bool) -> None:
    """After a failed demo that created `home/.h3kit/` only for its lock: remove the lock file, the folder and,
    when the demo made the home itself, the empty home (install already removes what it wrote)."""
    state = home / locks.STATE_DIR
    if (state / "state.json").exists():
        return
    with contextlib.suppress(OSError):
        locks.lock_path(home).unlink()
        state.rmdir()
        if fresh:
            home.rmdir()


def _run_demo(opts: DemoOptions, home: Path, log) -> dict:
    device_type = h3devices.resolve_device_type(opts.device_type)
    devices = list(range(opts.npu_count))
    settings = group.resolve(device_type, opts.transport)
    report: dict = {"ok": False, "comfy_home": str(home), "device_type": device_type,
                    "npu_count": opts.npu_count, "devices": devices, "weights": opts.weights,
                    "transport": settings.transport}
    st = _Stages(log)
    python = _stage_install(st, opts, home, log)

    with st("checkpoints") as s:
        wrote = write_tiny_checkpoints(home, python, opts.weights)
        s["detail"] = f"wrote {', '.join(wrote['written'])}" if wrote["written"] else "all four present"

    root = service.runtime_root(home)
    spec = service.StartSpec(comfy_home=str(home), devices=devices, device_type=device_type, port=opts.port,
                             python=python, group=settings)
    started = _stage_start(st, opts, home, root, spec, log)
    rec = started.record
    report["service"] = {"url": rec.url, "log": rec.log, "started_by_demo": not started.already_running}

    try:
        tag = f"npu{opts.npu_count}" + ("_int8" if opts.weights == "int8" else "")
        prompt = demo_prompt(opts.npu_count, tag, opts.weights)
        _stage_check_workflow(st, home, devices, prompt)
        outs = _stage_prompt(st, opts, home, rec, prompt, report, log)
        if opts.npu_count > 1:
            _stage_parity(st, opts, home, rec, prompt, outs, report, log)
    finally:
        report["stages"] = st.done
        if not started.already_running and not opts.keep_running:
            with st("stop") as s:
                service.stop(started.root or root, progress=log)  # its own folder: another server may run
                s["detail"] = "stopped the server the demo started"
    report["stages"] = st.done
    report["ok"] = True
    return report


def _stage_install(st: "_Stages", opts: DemoOptions, home: Path, log) -> str:
    """Install (unless the tree is installed and verifies); the interpreter ComfyUI runs with."""
    from h3kit import install as installer

    with st("install") as s:
        state = installer.load_state(home) if home.is_dir() else None
        healthy = state is not None and installer.verify(home)["ok"]
        if not healthy:
            installer.install(installer.InstallOptions(comfy_home=home, source=opts.source, python=opts.python,
                                                       progress=sys.stderr.isatty()), log=log)
        s["detail"] = "already installed and verified" if healthy else "installed"
    return service.resolve_python(home, opts.python)


def _stage_start(st: "_Stages", opts: DemoOptions, home: Path, root: Path, spec: service.StartSpec, log):
    """Start the server (or use h3kit's server already running with the demo's devices)."""
    with st("start") as s:
        started = service.start(root, spec, progress=log)
        rec = started.record
        st.server_log = rec.log
        if started.already_running and (list(rec.devices) != spec.devices or rec.device_type != spec.device_type):
            raise DemoFailed(f"h3kit's server already runs here on {rec.device_type} devices {rec.devices}, "
                             f"not the {opts.npu_count} {spec.device_type} devices the demo asked for",
                             hint=f"h3kit stop --comfy-home {home}, or run the demo with --npu-count "
                                  f"{len(rec.devices)}")
        s["detail"] = (f"{rec.url} ({'already running' if started.already_running else 'started'}, "
                       f"{rec.transport} transport)")
    return started


def _stage_check_workflow(st: "_Stages", home: Path, devices: list[int], prompt: dict) -> None:
    from h3kit import workflow

    with st("check-workflow") as s:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(prompt, f)
        try:
            result = workflow.check_paths([f.name], devices=h3devices.format_device_list(devices),
                                          comfy_home=str(home))
        finally:
            os.unlink(f.name)
        errors = [x for x in result.findings if x.severity == "error"]
        if errors:
            raise DemoFailed("the demo workflow does not pass check-workflow: "
                             + "; ".join(f"{x.code} node {x.node}: {x.message}" for x in errors))
        s["detail"] = f"{len(result.findings)} finding(s), no error"


def _stage_prompt(st: "_Stages", opts: DemoOptions, home: Path, rec, prompt: dict, report: dict, log) -> dict:
    """Run the demo prompt; its video must have a video and an audio track. Returns the prompt's outputs."""
    with st("prompt") as s:
        trace, outs = run_prompt(rec, prompt, opts.timeout, log)
        video = _output_file(home, outs, _node_id(prompt, "SaveVideo"), "images")
        tracks = outputs.mp4_tracks(video)
        if "soun" not in tracks or "vide" not in tracks:
            raise DemoFailed(f"{video} lacks a video or an audio track (tracks: {tracks})")
        s["detail"] = ", ".join(f"{k} {v} s" for k, v in stage_seconds(trace).items())
        if opts.weights == "int8":
            report["int8_arm"] = int8_arm_line(rec.log)
            s["detail"] += f"; {report['int8_arm']}"
    report["run"] = trace.to_dict()
    report["prompt_stages"] = stage_seconds(trace)
    report["video"] = {"path": str(video), "tracks": tracks, "bytes": video.stat().st_size}
    return outs


def _stage_parity(st: "_Stages", opts: DemoOptions, home: Path, rec, prompt: dict, outs: dict, report: dict,
                  log) -> None:
    """The same prompt on one device: its latents against the several devices' within PARITY_GATE."""
    with st("parity") as s:
        single = demo_prompt(1, "npu1" + ("_int8" if opts.weights == "int8" else ""), opts.weights)
        _, outs1 = run_prompt(rec, single, opts.timeout, log)
        rows = {}
        for kind in ("video", "audio"):
            par = _output_file(home, outs, _node_id(prompt, "SaveLatent", f"{kind}_latent"), "latents")
            one = _output_file(home, outs1, _node_id(single, "SaveLatent", f"{kind}_latent"), "latents")
            (shape_p, vp), (shape_1, v1) = outputs.read_latent(par), outputs.read_latent(one)
            if shape_p != shape_1:
                raise DemoFailed(f"{kind} latents differ in shape: {shape_p} on {opts.npu_count} devices, "
                                 f"{shape_1} on one")
            try:
                rows[kind] = {**outputs.compare(v1, vp, shape_1, shape_p), "shape": shape_p}
            except outputs.OutputFormatError as e:
                raise DemoFailed(f"{kind} latents: {e.message}",
                                 hint="the prompt wrote no usable latent: check the server log") from None
        worst = max(r["max_rel"] for r in rows.values())
        passed = worst <= PARITY_GATE  # False for NaN as for a figure over the gate
        report["parity"] = {"npu_count": opts.npu_count, "against": 1, "gate_max_rel": PARITY_GATE,
                            "rows": rows, "max_rel": worst, "ok": passed}
        s["detail"] = (f"npu_count 1 vs {opts.npu_count}: " + ", ".join(
            f"{k} max_abs {r['max_abs']:.2e} max_rel {r['max_rel']:.2e}" for k, r in rows.items()))
        if not passed:
            raise DemoFailed(f"the {opts.npu_count}-device latents differ from one device by max_rel "
                             f"{worst:.3e} > {PARITY_GATE:g}", hint="run h3kit parity for each component "
                             "to find the one that drifts", details=report["parity"])
