"""A rank that fails keeps its exception's type on every supported Python.

ThreadGroup.run re-raises the failing rank's own exception with a note naming the rank, so an OOM on rank 2
still reads as an OOM to ComfyUI's handler (which then unloads models to recover). BaseException.add_note only
exists from Python 3.11: on 3.10 the note must not turn the OOM into an AttributeError. make test runs this
file on 3.10 and 3.13 as well (the torch-free runs), where tests/support/rank_failure_probe.py stands in for
torch; here it runs with the real one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parent / "support" / "rank_failure_probe.py"


def test_rank_failure_keeps_the_original_exception_type():
    out = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["python"] == list(sys.version_info[:2])
    assert report["raised"] == "MemoryError", report
    assert report["message"] == "simulated out of memory on rank 2"
    assert report["notes"] == ["raised on rank 2 (cpu) of 3"]
