"""`h3kit parity --component dit` on the CPU simulation, in a tree patched with patches/series.

The worker samples a tiny random-weight H3 DiT on one device and through the MultiNPUParallelConfig
node on N simulated devices (real node, wrapper, block replacements and attention override; real
sampler), for t2va, fl2va and ref2va, with Ulysses and K/V-gather attention. Every row must pass the
gate, the injected fault must fail it, and the bytes the threads moved must equal the cost model's.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from h3kit.runtime import costmodel
from h3kit.runtime import parity as parity_lib
from h3kit.runtime import parity_worker
from tests.support.service_helpers import h3kit
from tests.support import jsondoc

pytestmark = [pytest.mark.upstream, pytest.mark.slow]
LAYOUTS = {"t2va", "fl2va", "ref2va"}




def _expected_bytes(row):
    tiny = parity_worker.TINY
    ex = costmodel.exchange_elements(row["seq_len"], row["npu_count"], hidden=tiny["hidden_size"],
                                     heads=tiny["num_attention_heads"], head_dim=tiny["attention_head_dim"],
                                     blocks=tiny["num_layers"], attention=row["attention"])
    return ex["total"] * 4 * row["forwards"]  # fp32


def _check_rows(rows, n):
    assert {r["layout"] for r in rows} == LAYOUTS
    assert {(r["layout"], r["attention"]) for r in rows} == {(lay, a) for lay in LAYOUTS for a in ("ulysses", "kv_gather")}
    for r in rows:
        assert r["seq_len"] % n != 0, f"{r['layout']}: S={r['seq_len']} divides by {n}; the test must cover uneven shards"
        assert r["forwards"] == 4 and r["parallel_forwards"] == 4, r  # 2 steps x (cond, uncond)
        assert r["max_rel"] <= 1e-5 and r["pass"], r
        assert r["cos"] > 0.999999 and r["rel_rms"] <= 1e-5, r
        assert r["bytes_moved"] > 0
        assert r["bytes_moved"] == _expected_bytes(r), f"{r['layout']}/{r['attention']}: moved vs cost model"


def test_parity_two_devices_and_cost_model(installed_tree, comfy_python):
    report = parity_lib.run(installed_tree, "dit", "cpu", 2, python=comfy_python, timeout=600)
    assert report["ok"]
    _check_rows(report["rows"], 2)
    cfg = report["config"]
    assert cfg["devices"] == ["cpu", "cpu"] and cfg["dtype"] == "float32"
    # the cost model's parameter formula, on the tiny config, counts the loaded checkpoint exactly
    tiny = parity_worker.TINY
    model = dict(costmodel.H3, blocks=tiny["num_layers"], hidden=tiny["hidden_size"], heads=tiny["num_attention_heads"],
                 head_dim=tiny["attention_head_dim"], ffn=tiny["ffn_hidden_size"], text_dim=tiny["text_dim"],
                 refiner_blocks=tiny["token_refiner_num_layers"], t_in=tiny["timestep_input_dim"],
                 t_hidden=tiny["time_embed_hidden_size"], t_dim=tiny["time_embed_dim"],
                 rope_inv_freq=tiny["rope_inv_freq_len"])
    assert costmodel.parameter_counts(model)["total"] == cfg["params"]


def test_parity_four_devices_cli(installed_tree, comfy_python):
    proc = h3kit("parity", "--comfy-home", str(installed_tree), "--component", "dit", "--device-type", "cpu",
                "--npu-count", "4", "--python", comfy_python, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = jsondoc.data(proc.stdout, proc.returncode)
    _check_rows(rows, 4)
    assert "parity passed: 6 row(s)" in proc.stderr


def test_injected_fault_fails_the_gate(installed_tree, comfy_python):
    proc = h3kit("parity", "--comfy-home", str(installed_tree), "--device-type", "cpu", "--npu-count", "4",
                "--python", comfy_python, "--inject-fault")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "parity FAILED: 6 of 6 row(s)" in proc.stderr
    assert proc.stdout.count("FAIL") == 6


def test_parity_refuses_an_unpatched_tree(pin_tree, comfy_python):
    proc = h3kit("parity", "--comfy-home", str(pin_tree), "--device-type", "cpu", "--npu-count", "2",
                "--python", comfy_python, "--json")
    assert proc.returncode == 1
    error = jsondoc.error(proc.stdout, proc.returncode)
    assert error["code"] == "not_patched" and "h3kit install" in error["fix"]


def test_a_terminated_parity_run_takes_its_worker_with_it(installed_tree, tmp_path):
    """SIGTERM (a scheduler's timeout, a service manager) must not leave the worker holding the devices."""
    import os
    import signal
    import time

    import psutil

    pidfile = tmp_path / "worker.pid"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec sleep 300\n")
    fake.chmod(0o755)
    cli = subprocess.Popen([sys.executable, "-m", "h3kit", "parity", "--comfy-home", str(installed_tree),
                            "--component", "dit", "--device-type", "cpu", "--npu-count", "2",
                            "--python", str(fake), "--timeout", "600"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (pidfile.is_file() and pidfile.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    worker = int(pidfile.read_text())
    assert psutil.pid_exists(worker)
    cli.send_signal(signal.SIGTERM)
    out, err = cli.communicate(timeout=30)
    assert cli.returncode != 0 and "Traceback" not in err
    deadline = time.monotonic() + 10
    while psutil.pid_exists(worker) and psutil.Process(worker).status() != psutil.STATUS_ZOMBIE \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = psutil.pid_exists(worker) and psutil.Process(worker).status() != psutil.STATUS_ZOMBIE
    if alive:
        os.kill(worker, signal.SIGKILL)
    assert not alive, "the parity worker outlived h3kit"
