"""`h3kit parity` over the process group on the CPU simulation (--transport process): the parity worker drives two
worker processes on gloo, as the server does (comfy.multinpu_process), and every rank is a worker process.

The DiT's, the text encoder's and the VAE's rows over the group, and the faults that must reach the workers, with
the gates of the thread transport (tests/test_parity_dit.py, tests/test_parity_te_vae.py, whose checks these
tests apply). All five runs share one parity worker and its one group of two worker processes
(parity.run_jobs), one run after the other, each still a run of its own.
"""

from __future__ import annotations

import pytest

from tests.support import parity_runs
from tests.support.parity_runs import run
from tests.test_parity_dit import _check_rows
from tests.test_parity_te_vae import _check_vae

pytestmark = [pytest.mark.upstream, pytest.mark.slow]
# the faults the worker processes are reached by (rope: every rank > 0): shard-offset when a worker builds its
# slices, shard-order in its gather of block 0, the 1e-6 noise on its attention and MLP outputs
PROCESS_FAULTS = ("noise-attention", "noise-mlp", "rope", "shard-offset", "shard-order")
JOBS = {
    "dit": dict(component="dit", npu_count=2),
    "dit_faults": dict(component="dit", npu_count=2, extra_args=("--faults", ",".join(PROCESS_FAULTS), "--dtypes",
                                                                 "float32", "--layouts", "t2va", "--no-lora")),
    "te": dict(component="te", npu_count=2, extra_args=("--dtypes", "float32")),
    "te_fault": dict(component="te", npu_count=2, fault="reduce", extra_args=("--dtypes", "float32", "--no-lora")),
    "vae": dict(component="vae", npu_count=2),
}


@pytest.fixture(scope="module")
def process_runs(installed_tree, comfy_python):
    return parity_runs.runs(installed_tree, comfy_python, JOBS, "process", timeout=2400)


def test_parity_over_the_process_group(process_runs):
    """--transport process: the worker is rank 0 of two processes on gloo and the node runs over the group; the
    same rows and gates as the threads (fp32 and the LoRA, which reaches the worker over the group; bf16 rows
    need this process's CPU loader patch, and an attention override is refused there): exact against one device,
    now that the weights a worker maps from the file are aligned as the CPU kernels need. Every rank counted its
    own forwards, LoRA verdict and bytes, which equal the cost model's, as with the threads."""
    report = run(process_runs, "dit")
    assert report["ok"], report["log_tail"][-3000:]
    rows = report["rows"]
    _check_rows(rows, 2, variants={("float32", False, False), ("float32", True, False)})
    assert {r["transport"] for r in rows} == {"process"}
    # every worker process loaded with its own shard's estimate, and emptied its own cache
    assert all(len(set(r["memory_used"])) == 1 and r["memory_used"][0] > 0 for r in rows)


def test_a_fault_on_a_worker_process_fails_the_gate(process_runs):
    # the faults strike the last rank only (rope: every rank > 0): a worker process, reached through the hook sent
    # with each forward (PROCESS_FAULTS)
    faults = PROCESS_FAULTS
    rows = run(process_runs, "dit_faults")["rows"]
    assert {r["fault"] for r in rows} == set(faults)
    assert {(r["fault"], r["sharding"]) for r in rows} >= {("shard-offset", "sharded"), ("shard-order", "sharded")}
    for r in rows:
        assert r["fault_fired"] > 0 and not r["pass"] and r["split"], r


def test_te_parity_over_processes(process_runs):
    """The workers hold the layers (worker rank 0 no embeddings), the server's copy the embeddings and the vision
    tower: the rows pass the same gates as with threads."""
    report = run(process_runs, "te")
    assert report["ok"]
    rows = report["rows"]
    assert {r["transport"] for r in rows if not r["lora"]} == {"process"}
    assert len([r for r in rows if not r["lora"]]) == 6
    for r in rows:
        assert r["pass"], r
        if not r["lora"] and r["mode"] == "layers":
            assert r["max_abs"] == 0


def test_te_injected_fault_fails_the_gate_over_processes(process_runs):
    """The fault travels to the workers with each forward (comfy.multinpu_te.fault_hook): patched in the server
    alone, it reached no collective, and every row passed."""
    report = run(process_runs, "te_fault")
    rows = report["rows"]
    assert not report["ok"] and len(rows) == 6
    assert all(not r["pass"] and r["failed"][0].startswith("max_rel > 1e-05") for r in rows), rows


def test_vae_parity_over_processes(process_runs):
    """The workers decode (a single frame too, on worker rank 0), the server's copy holds the encoder: bit-identical."""
    report = run(process_runs, "vae")
    assert report["ok"]
    _check_vae(report["rows"], 2)
    assert {r["transport"] for r in report["rows"]} == {"process"}
