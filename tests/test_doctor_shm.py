"""`h3kit doctor`'s /dev/shm check: free space against the largest hand-off the process transport makes for the
shipped workflows and the deployment tiers (the VAE decode's chunks at fp32).

The /dev/shm the doctor reads is a real tmpfs of a chosen size, mounted over /dev/shm in a private mount namespace
(`unshare -m`, root or CAP_SYS_ADMIN); without the privilege those tests skip with the reason (a failure under
H3KIT_REQUIRE_UPSTREAM=1, as in CI).
"""

from __future__ import annotations

import ast
import json
import math
import os
import shutil
import subprocess
import sys
import types

from h3kit import doctor
from h3kit.runtime import costmodel
from tests.conftest import PIN, ROOT
from tests.support import jsondoc, requires

GB = 1e9


def doctor_with_shm(size: str) -> tuple:
    """(exit code, the shm finding, facts["shm"]) of `h3kit doctor --json` for 2 CPU devices, /dev/shm a tmpfs of
    `size` (mount's size= syntax)."""
    if shutil.which("unshare") is None:
        requires.skip_or_fail("needs unshare (util-linux) to mount a tmpfs over /dev/shm in a private mount namespace")
    script = f'mount -t tmpfs -o size={size} h3kit-test /dev/shm && exec "$@"'
    env = dict(os.environ, PYTHONPATH=str(ROOT / "toolkit"))
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", sys.executable, "-m", "h3kit", "doctor", "--json",
                           "--device-type", "cpu", "--devices", "0,1", "--python", "/bin/true"],
                          capture_output=True, text=True, env=env, timeout=120)
    if proc.returncode not in (0, 1) and ("mount" in proc.stderr or "unshare" in proc.stderr):
        requires.skip_or_fail(f"needs root or CAP_SYS_ADMIN to mount a tmpfs over /dev/shm: {proc.stderr.strip()}")
    assert "Traceback" not in proc.stderr, proc.stderr
    doc = jsondoc.document(proc.stdout, proc.returncode)
    found = [f for f in doc["data"]["findings"] if f["check"] == "shm"]
    assert len(found) == 1, doc["data"]["findings"]
    return proc.returncode, found[0], doc["data"]["facts"]["shm"]


def test_a_dev_shm_smaller_than_the_shipped_workflows_hand_off_fails():
    """2 GiB (2.1 GB): the shipped 768p/5 s workflows hand 2.4 GB of decoded chunks back, so their prompts would
    fail: an error naming the sizes and the fix. (Before: a warning, "less than the 5 GB a long video needs".)"""
    code, finding, facts = doctor_with_shm("2g")
    assert code == 1 and finding["severity"] == "error", finding
    message = finding["message"]
    assert message.startswith("/dev/shm: 2.1 GB free of 2.1 GB"), message
    assert "2.4 GB for fl2va_8steps_lora.json" in message and "7.3 GB at 768p/15s" in message, message
    assert "video alone 4.5 GB" in message, message
    assert "--shm-size 8g" in finding["fix"] and "mount -o remount,size=8G /dev/shm" in finding["fix"], finding
    assert facts["free"] == 2 << 30 and facts["needs"]["workflows"][1] == doctor.shm_handoff_bytes(1344, 768, 124)


def test_a_dev_shm_that_fits_the_workflows_but_not_15_s_warns():
    code, finding, _ = doctor_with_shm("4g")
    assert finding["severity"] == "warning", finding
    assert "a 768p/15s prompt would fail" in finding["message"] and "--shm-size" in finding["fix"], finding


def test_a_dev_shm_that_fits_15_s_is_ok():
    code, finding, _ = doctor_with_shm("8g")
    assert finding["severity"] == "ok" and "7.3 GB at 768p/15s" in finding["message"], finding


def test_verdicts_against_given_needs():
    needs = {"tier": ("768p/15s", 7 * GB), "video": 4 * GB, "workflows": ("t2va.json", 2 * GB)}
    assert doctor.shm_verdict(8 * GB, True, needs, 10 * GB)[0] == "ok"
    assert doctor.shm_verdict(3 * GB, True, needs, 10 * GB)[0] == "warning"
    severity, message, fix = doctor.shm_verdict(1 * GB, True, needs, 10 * GB)
    assert severity == "error" and "1.0 GB free of 10.0 GB" in message and "2.0 GB for t2va.json" in message
    assert "--shm-size 16g" in fix, fix  # what is used (9 GB) plus the largest hand-off (7 GB), in GiB, + 1
    assert doctor.shm_verdict(1 * GB, False, needs, 10 * GB)[0] == "info"  # one device: nothing goes through it
    assert doctor.shm_verdict(None, True, needs)[0] == "warning"


def _pin_vae(comfy_source) -> types.SimpleNamespace:
    """The pin's MiniMaxH3VideoVAE chunking: its __init__ defaults, the chunk settings its __init__ derives from
    them, and its own _decode_temporal_chunks, compiled from the pin's source."""
    flag = "--git-dir" if os.path.isdir(os.path.join(comfy_source, "objects")) else "-C"
    text = subprocess.run(["git", flag, comfy_source, "show", f"{PIN}:comfy/ldm/minimax/vae.py"], check=True,
                          capture_output=True, text=True).stdout
    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "MiniMaxH3VideoVAE")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    names = [a.arg for a in init.args.args[-len(init.args.defaults):]]
    scope = {name: ast.literal_eval(d) for name, d in zip(names, init.args.defaults)
             if isinstance(d, (ast.Constant, ast.Tuple))}
    vae = types.SimpleNamespace()
    wanted = {"vae_ratio_t", "clip_length", "token_drop", "frame_pre_padding", "tokens_chunk_size", "token_overlap"}
    for stmt in init.body:
        if (isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Attribute)
                and stmt.targets[0].attr in wanted):
            exec(compile(ast.Module(body=[stmt], type_ignores=[]), "<pin vae>", "exec"),
                 {"math": math, "self": vae, **scope})
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_decode_temporal_chunks")
    ns = {}
    exec(compile(ast.Module(body=[method], type_ignores=[]), "<pin vae>", "exec"), ns)
    vae.chunks = lambda z_len: ns["_decode_temporal_chunks"](vae, z_len)
    return vae


def test_the_hand_off_size_follows_the_pins_vae_chunking(comfy_source):
    """Chunks per decode from the pin's own _decode_temporal_chunks, each (chunk + overlap) latents x the temporal
    stride frames, every one at fp32: what doctor.shm_handoff_bytes predicts, at both tiers and odd lengths."""
    vae = _pin_vae(comfy_source)
    assert (doctor.VAE_CHUNK_LATENTS, doctor.VAE_CHUNK_OVERLAP, doctor.VAE_TOKEN_DROP, doctor.VAE_TIME_STRIDE) == (
        vae.tokens_chunk_size, vae.token_overlap, vae.token_drop, vae.vae_ratio_t)
    for w, h, frames in [*costmodel.GEOMETRIES.values(), (1344, 768, 5), (768, 1344, 22), (1024, 1024, 241)]:
        latents = costmodel.video_latent_t(costmodel.align_frame_count(frames))
        _, chunks = vae.chunks(latents)
        chunk_frames = (vae.tokens_chunk_size + vae.token_overlap) * vae.vae_ratio_t
        assert doctor.shm_handoff_bytes(w, h, frames) == chunks * chunk_frames * w * h * 3 * 4, (w, h, frames)
    assert round(doctor.shm_handoff_bytes(*costmodel.GEOMETRIES["768p/15s"]) / GB, 1) == 7.3
    assert round(doctor.video_bytes(*costmodel.GEOMETRIES["768p/15s"]) / GB, 1) == 4.5
