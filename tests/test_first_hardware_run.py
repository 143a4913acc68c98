"""tools/first-hardware-run.sh (issue 45 item 8): the sequence someone with a device runs first, against a stand-in
h3kit that records what it was asked (the real steps need an NPU or a GPU; none was available to this work)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "first-hardware-run.sh"
STANDIN = """#!/bin/sh
echo "$* | buffers=${H3KIT_HCCL_BUFFSIZE:-}" >> "$CALLS"
case "$1:${5:-}" in
  plan:*) echo '{"plans": [{"hccl": {"env": "H3KIT_HCCL_BUFFSIZE=561,200"}}]}' ;;
  parity:te) echo "te failed" >&2; exit 1 ;;
  logs:*) echo "[rank 1] MultiNPU: rank 1: progress: collective #12 completed"; echo "other line" ;;
  *) echo '{"ok": true}' ;;
esac
"""


def _run(tmp_path, *args):
    fake = tmp_path / "h3kit"
    fake.write_text(STANDIN)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, H3KIT=str(fake), CALLS=str(tmp_path / "calls"))
    env.pop("H3KIT_HCCL_BUFFSIZE", None)
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def test_the_first_run_runs_every_step_and_reports_each(tmp_path):
    wf = tmp_path / "long.json"
    wf.write_text("{}")
    out = tmp_path / "out"
    r = _run(tmp_path, "--comfy-home", str(tmp_path), "--device-type", "npu", "--npu-count", "4", "--workflow", str(wf),
             "--out", str(out))
    assert r.returncode == 1, "a failed step (the stand-in's te parity) makes the run fail, after every step ran"
    calls = [line.split(" | ") for line in (tmp_path / "calls").read_text().splitlines()]
    assert [c[0].split()[0] for c in calls] == ["doctor", "plan", "parity", "parity", "parity", "parity", "calibrate",
                                               "start", "bench", "logs", "stop"]
    assert "--devices 0,1,2,3" in calls[0][0] and "--frames 362 --npu-count 4" in calls[1][0]
    assert [c[0].split()[4] for c in calls[2:6]] == ["dit", "te", "vae", "dit"] and "--weights int8" in calls[5][0]
    assert all("--transport process" in c[0] for c in calls[2:6])
    assert calls[1][1] == "buffers=" and all(c[1] == "buffers=561,200" for c in calls[2:]), \
        "the plan's HCCL buffers are exported for every later step"
    report = (out / "report.md").read_text()
    assert "| parity-te | 1 |" in report and "| parity-dit | 0 |" in report and "| long-prompt | 0 |" in report
    assert "progress: collective #12 completed" in report and "other line" not in report
    assert (out / "parity-te.err").read_text() == "te failed\n"


def test_without_a_workflow_the_long_prompt_is_skipped_and_bad_input_is_refused(tmp_path):
    r = _run(tmp_path, "--comfy-home", str(tmp_path), "--device-type", "cuda", "--npu-count", "1", "--out",
             str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    report = (tmp_path / "o" / "report.md").read_text()
    assert "| long-prompt | skipped |" in report and "parity" not in report  # one device: nothing to compare
    assert "buffers=\n" in (tmp_path / "calls").read_text() + "\n", "CUDA: no HCCL buffers exported"
    for bad in (["--device-type", "cpu", "--npu-count", "2"], ["--device-type", "npu", "--npu-count", "3"],
                ["--device-type", "npu"]):
        r = _run(tmp_path, "--comfy-home", str(tmp_path), *bad)
        assert r.returncode == 2 and "first-hardware-run:" in r.stderr and "Traceback" not in r.stderr
