"""The toolkit's side of monitoring (toolkit/h3kit/monitoring.py, issue 39): the restarts h3kit watch and restart
count, in the record the server's /metrics reads and as a node_exporter textfile; doctor's word on prometheus_client;
the names both sides share. Torch-free. Restarts made by the real commands: tests/test_service_standin.py."""

from __future__ import annotations

import ast
import re
import time

import pytest

from h3kit import monitoring
from tests.conftest import ROOT

SERVER_SIDE = (ROOT / "patches" / "src" / "comfy" / "multinpu_metrics.py").read_text()


def test_restarts_are_counted_by_reason_in_both_records(tmp_path):
    assert monitoring.restarts(tmp_path) == {}
    monitoring.count_restart(tmp_path, "died")
    monitoring.count_restart(tmp_path, "died")
    assert monitoring.count_restart(tmp_path, "manual") == {"died": 2, "manual": 1}
    assert monitoring.restarts(tmp_path) == {"died": 2, "manual": 1}
    text = (tmp_path / "metrics" / monitoring.TEXTFILE).read_text()
    # every reason from 0: the first restart is an increase for H3kitCrashLoop (a series born at 1 is none)
    assert text.splitlines()[1:5] == ["# TYPE h3kit_service_restarts_total counter",
                                      'h3kit_service_restarts_total{reason="died"} 2',
                                      'h3kit_service_restarts_total{reason="manual"} 1',
                                      'h3kit_service_restarts_total{reason="unhealthy"} 0']
    stamp = float(text.splitlines()[-1].split()[-1])
    assert text.splitlines()[-1].startswith("h3kit_service_last_restart_timestamp_seconds ")
    assert abs(stamp - time.time()) < 3600
    assert sorted(p.name for p in (tmp_path / "metrics").iterdir()) == [".lock", "h3kit_service.prom", "restarts.json"]


def test_a_restart_is_never_failed_by_its_count(tmp_path):
    (tmp_path / "metrics").write_text("a file where the folder goes")
    assert monitoring.count_restart(tmp_path, "unhealthy") == {}
    with pytest.raises(ValueError):
        monitoring.count_restart(tmp_path, "because")


def test_the_server_reads_what_the_toolkit_writes():
    # the server's module runs in ComfyUI's interpreter, which may lack h3kit: the names are written twice, pinned here
    files = re.search(r'RESTARTS_FILE = os.path.join\("(\w+)", "([\w.]+)"\)', SERVER_SIDE).groups()
    assert files == (monitoring.METRICS_DIR, monitoring.RESTARTS_FILE)
    assert f'RUNTIME_ROOT_ENV = "{monitoring.RUNTIME_ROOT_ENV}"' in SERVER_SIDE
    assert ast.literal_eval(re.search(r"RESTART_REASONS = (\(.*?\))", SERVER_SIDE).group(1)) == monitoring.REASONS
    runtime = (ROOT / "toolkit" / "requirements" / "comfy-runtime-cpu.txt").read_text().splitlines()
    assert monitoring.PROMETHEUS_CLIENT in runtime


def test_doctor_names_prometheus_client():
    assert monitoring.doctor_finding({"prometheus_client": "0.26.0"}, "/py")[0] == "ok"
    severity, message, fix = monitoring.doctor_finding({}, "/opt/py")
    assert severity == "warning" and "503" in message
    assert fix.startswith(f"/opt/py -m pip install {monitoring.PROMETHEUS_CLIENT}")
