"""h3kit demo end to end on CPU (N = 2 with its parity run, then N = 1), h3kit bench on the demo workflow,
and a demo failure that names its stage and the server's log line. Needs the upstream mirror."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from h3kit.demo import PARITY_GATE, demo_prompt
from tests.support.comfy_server import free_port

pytestmark = [pytest.mark.upstream, pytest.mark.slow]
STAGES_N2 = ["install", "checkpoints", "start", "check-workflow", "prompt", "parity"]


def h3kit(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "h3kit", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def demo_home(tmp_path_factory, comfy_source, comfy_python):
    os.environ.setdefault("H3KIT_COMFY_SOURCE", comfy_source)
    return tmp_path_factory.mktemp("demo") / "ComfyUI", comfy_python


def audio_streams(python, video):
    code = ("import av, sys; c = av.open(sys.argv[1]); "
            "print(sum(s.type == 'audio' for s in c.streams), sum(s.type == 'video' for s in c.streams))")
    out = subprocess.run([python, "-c", code, str(video)], capture_output=True, text=True, check=True).stdout
    return tuple(int(x) for x in out.split())


def test_demo_on_two_devices_then_bench_cold_and_warm(demo_home, tmp_path):
    home, python = demo_home
    port = free_port(8320, 8330)
    r = h3kit("demo", "--comfy-home", home, "--device-type", "cpu", "--npu-count", "2", "--port", port,
              "--python", python, "--keep-running", "--json")
    try:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        rep = json.loads(r.stdout)
        assert rep["ok"] and [s["stage"] for s in rep["stages"]] == STAGES_N2
        assert all(s["seconds"] is not None for s in rep["stages"])
        assert rep["stages"][0]["detail"] == "installed"  # a fresh folder: the demo installed it
        video = Path(rep["video"]["path"])
        assert video.is_file() and video.name.startswith("npu2_video")
        assert audio_streams(python, video) == (1, 1)  # a video file with an audio track
        assert set(rep["prompt_stages"]) >= {"load", "text encode", "sample", "decode", "save"}
        parity = rep["parity"]
        assert parity["ok"] and parity["max_rel"] <= PARITY_GATE
        assert parity["rows"]["video"]["shape"][:2] == [1, 24] and parity["rows"]["audio"]["shape"][:3] == [1, 32, 2]
        assert "MultiNPU: MiniMax H3 DiT sequence-parallel on 2 simulated cpu devices" in Path(rep["service"]["log"]).read_text()

        # bench the demo workflow on the server the demo kept running: one cold run with loads, warm ones without
        wf = tmp_path / "demo_api.json"
        wf.write_text(json.dumps(demo_prompt(2, "bench")))
        b = h3kit("bench", wf, "--comfy-home", home, "--runs", "3", "--json")
        assert b.returncode == 0, b.stdout[-2000:] + b.stderr[-2000:]
        bench = json.loads(b.stdout)
        kinds = [(x["kind"], x["models_loaded"]) for x in bench["runs"]]
        assert kinds[0][0] == "cold" and kinds[0][1] == 4  # the four tiny files are read again after /free
        assert [k for k in kinds[1:]] == [("warm", 0), ("warm", 0)]
        assert bench["summary"]["warm_models_loaded"] == 0
        assert all(x["end_to_end_s"] > 0 and x["executed_nodes"] > 0 for x in bench["runs"])
        assert all(x["peak_device_memory"] for x in bench["runs"])
        assert bench["varied_inputs"] == ["8.noise_seed"]
    finally:
        h3kit("stop", "--comfy-home", home)
    assert json.loads(h3kit("status", "--comfy-home", home, "--json").stdout)["running"] is False


def test_demo_on_one_device_and_a_failure_naming_its_stage(demo_home):
    home, python = demo_home
    port = free_port(8320, 8330)
    installed_before = (home / ".h3kit" / "state.json").is_file()  # by the two-device test, when it ran first
    r = h3kit("demo", "--comfy-home", home, "--device-type", "cpu", "--npu-count", "1", "--port", port, "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(r.stdout)
    assert [s["stage"] for s in rep["stages"]] == ["install", "checkpoints", "start", "check-workflow", "prompt", "stop"]
    if installed_before:
        assert rep["stages"][0]["detail"] == "already installed and verified"
        assert rep["stages"][1]["detail"] == "all four present"
    assert "parity" not in rep
    assert Path(rep["video"]["path"]).name.startswith("npu1_video")
    assert json.loads(h3kit("status", "--comfy-home", home, "--json").stdout)["running"] is False

    # a damaged checkpoint: the demo fails in the prompt stage and quotes the server's error line
    te = home / "models" / "text_encoders" / "h3kit_tiny_te.safetensors"
    te.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}  " + b"\x00" * 64)
    r = h3kit("demo", "--comfy-home", home, "--device-type", "cpu", "--npu-count", "1", "--port", port, "--json")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    err = json.loads(r.stdout)["error"]
    assert err["code"] == "demo_failed" and err["details"]["stage"] == "prompt"
    assert "stage 'prompt' failed" in err["message"] and "CLIPLoader" in err["message"]
    assert err["details"]["log_line"], err
    assert "Traceback" not in r.stderr
    assert json.loads(h3kit("status", "--comfy-home", home, "--json").stdout)["running"] is False
    te.unlink()  # the next demo writes it again


def test_demo_refuses_a_bad_count_and_bench_needs_a_server(tmp_path):
    r = h3kit("demo", "--comfy-home", tmp_path / "x", "--npu-count", "3")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    wf = tmp_path / "w.json"
    wf.write_text(json.dumps(demo_prompt(1, "b")))
    r = h3kit("bench", wf, "--comfy-home", tmp_path / "x", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "not_running"
    ui = tmp_path / "ui.json"
    ui.write_text(json.dumps({"nodes": [], "links": []}))
    r = h3kit("bench", ui, "--comfy-home", tmp_path / "x")
    assert r.returncode == 2 and "UI-format" in r.stderr
