"""`h3kit parity --component dit` on the CPU simulation, in a tree patched with patches/series.

The worker samples a tiny random-weight H3 DiT on one device and through the MultiNPUParallelConfig
node on N simulated devices (real node, wrapper, block replacements and attention override; real
sampler; the ranks are threads running the worker programs the process transport's workers run), for t2va,
fl2va and ref2va, with Ulysses and K/V-gather attention, in fp32, in bf16 and with a random LoRA, with
replicated and with sharded weights, on 2, 4 and 8 devices (a user attention override is refused by the node on
both transports: tests/test_multinpu_node.py). Every
row must equal one device exactly (cpu) on each output of each forward with the work really split (counted by
each rank on itself), every sharded row must equal its replicated twin exactly, each injected
fault must fail the gate of every row it reaches, and the bytes the threads moved, in all and per device, the
weight bytes each rank held and the bytes its weight gathers received must equal the cost model's.

The runs the tests read through the library share one parity worker (THREAD_JOBS: parity.run_jobs), each still
a run of its own; test_parity_four_devices_cli starts `h3kit parity`. The rows over the process group (every rank
a worker process) are in tests/test_parity_process.py, with the text encoder's and the VAE's.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from h3kit.runtime import costmodel
from h3kit.runtime import parity_worker
from tests.support.service_helpers import h3kit, pid_running, wait_for
from tests.support import jsondoc
from tests.support.parity_runs import run
from tests.support import parity_runs

pytestmark = [pytest.mark.upstream, pytest.mark.slow]
LAYOUTS = {"t2va", "fl2va", "ref2va"}
VARIANTS = {("float32", False, False), ("bfloat16", False, False),
            ("float32", True, False)}  # (dtype, LoRA, attention override)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
WEIGHTS = {"float32": ("fp32", "fp32"), "bfloat16": ("bf16", "bf16"), "int8": ("int8", "fp32")}  # (weights, other)
# the packed latent the tiny rows sample: video 24 x 2 x 8 x 12 and audio 32 x 2 x 8 elements
LATENT_ELEMENTS = 24 * 2 * 8 * 12 + 32 * 2 * 8
# the library-driven runs with threads, in one parity worker (parity.run_jobs: one interpreter and ComfyUI
# import for them all), each still a run of its own; the process transport's: tests/test_parity_process.py
THREAD_JOBS = {
    "two": dict(component="dit", npu_count=2),
    "eight": dict(component="dit", npu_count=8, extra_args=("--dtypes", "float32", "--layouts", "t2va")),
    # t2va: the other layouts pass through the same code (the clean runs show them exact); bf16 at 2 devices
    "faults2": dict(component="dit", npu_count=2, extra_args=("--faults", ",".join(parity_worker.DIT_FAULTS),
                                                              "--dtypes", "float32,bfloat16", "--layouts", "t2va")),
    "faults4": dict(component="dit", npu_count=4, extra_args=("--faults", ",".join(parity_worker.DIT_FAULTS),
                                                              "--dtypes", "float32", "--layouts", "t2va")),
}


@pytest.fixture(scope="module")
def thread_runs(installed_tree, comfy_python):
    return parity_runs.runs(installed_tree, comfy_python, THREAD_JOBS, "threads")


def tiny_cfg():
    """The cost model's configuration of the parity worker's tiny DiT."""
    tiny = parity_worker.TINY
    return dict(costmodel.H3, blocks=tiny["num_layers"], hidden=tiny["hidden_size"], heads=tiny["num_attention_heads"],
                head_dim=tiny["attention_head_dim"], ffn=tiny["ffn_hidden_size"], text_dim=tiny["text_dim"],
                refiner_blocks=tiny["token_refiner_num_layers"], t_in=tiny["timestep_input_dim"],
                t_hidden=tiny["time_embed_hidden_size"], t_dim=tiny["time_embed_dim"],
                rope_inv_freq=tiny["rope_inv_freq_len"])


def check_weights(r, n):
    """The weights a row's ranks held and what their gathers received, measured in the run, against the plan; a
    sharded row equals its replicated twin exactly; ComfyUI sized each rank's load by its shard of the latent and
    every rank gave its cached memory back after sampling."""
    weights, other = WEIGHTS[r["weights"] if r["weights"] == "int8" else r["dtype"]]
    plan = costmodel.weights_per_device(n, weights, r["sharding"], tiny_cfg(), other=other)
    assert r["resident_bytes"] == [plan["resident"]] * n, f"{r['sharding']}: resident per rank vs the plan"
    assert r["weight_bytes_received"] == [plan["received_per_forward"] * r["forwards"]] * n, "gathers vs the plan"
    assert r["weight_bytes"] == plan["moved_per_forward"] * r["forwards"]
    if r["sharding"] == "sharded":
        assert r["max_abs_vs_replicated"] == 0 and r["weight_bytes"] > 0
        assert r["resident_bytes"][0] < costmodel.weight_bytes(weights, tiny_cfg(), other=other)
    one, sizes = r["memory_estimate_one_device"], costmodel.shard_sizes(LATENT_ELEMENTS, n)
    for k in range(2):  # memory_required, minimum_memory_required: upstream's estimate at each rank's shard
        assert [e[k] for e in r["memory_estimates"]] == pytest.approx([one[k] * s / LATENT_ELEMENTS for s in sizes])
    # every rank loads with its own shard's estimate, on both transports
    assert r["memory_used"] == pytest.approx([r["memory_estimates"][i][0] for i in range(n)], abs=1)
    assert r["caches_emptied"] == [1] * n


def _exchange(row):
    tiny = parity_worker.TINY
    return costmodel.exchange_elements(row["seq_len"], row["npu_count"], hidden=tiny["hidden_size"],
                                       heads=tiny["num_attention_heads"], head_dim=tiny["attention_head_dim"],
                                       blocks=tiny["num_layers"], attention=row["attention"])


def _check_rows(rows, n, variants=VARIANTS, layouts=LAYOUTS):
    # every variant with replicated weights in both attention modes, and with sharded weights (Ulysses); the LoRA
    # and the attention override on the first layout
    assert {(r["layout"], r["attention"], r["dtype"], r["lora"], r["attention_override"], r["sharding"])
            for r in rows} == \
        {(lay, a, d, lo, ov, w) for lay in layouts for a in ("ulysses", "kv_gather") for d, lo, ov in variants
         for w in ("replicated", "sharded") if (lay == "t2va" or not (lo or ov)) and (w == "replicated" or a == "ulysses")}
    for r in rows:
        assert r["seq_len"] % n != 0, f"{r['layout']}: S={r['seq_len']} divides by {n}; the test must cover uneven shards"
        assert r["forwards"] == 4 and r["parallel_forwards"] == 4, r  # 2 steps x (cond, uncond)
        # counted by each rank on itself: every block of every forward, and data received
        assert r["split"] and r["rank_forwards"] == [4] * n, "every device ran every forward"
        assert all(b > 0 for b in r["bytes_received"])
        assert r["pass"] and r["failed"] == [], r
        # exact on cpu, both outputs of every forward, fp32 and bf16 alike
        assert r["max_abs"] == 0 and r["max_rel"] == 0 and r["gate"].startswith("max_abs == 0"), r
        assert set(r["outputs"]) == {"video", "audio"} and all(o["max_abs"] == 0 for o in r["outputs"].values())
        if r["lora"]:
            assert r["lora_ranks"] == ["once"] * n  # each rank hashed the weights its blocks computed with
        if r["attention_override"]:
            assert r["override_calls"] == [4 * parity_worker.TINY["num_layers"]] * n, "every rank ran the override"
        # bytes, as measured by the transport on each rank, against the cost model (the sharded weights' gathers
        # apart, checked in check_weights): the worker's own check, and here once more from the formula
        ex, e = _exchange(r), DTYPE_BYTES[r["dtype"]]
        moved = r["bytes_moved"] - r["weight_bytes"]
        assert moved == ex["total"] * e * r["forwards"], f"{r['layout']}/{r['attention']}: moved vs model"
        # per device too, which is where the final gather shows: it lands on rank 0 alone
        assert [b - w for b, w in zip(r["bytes_received"], r["weight_bytes_received"], strict=True)] == \
            [x * e * r["forwards"] for x in ex["per_device"]] == r["bytes_received_plan"]
        check_weights(r, n)


def _check_config(cfg, n, dtypes=("float32", "bfloat16")):
    assert cfg["devices"] == ["cpu"] * n and cfg["dtypes"] == list(dtypes)
    assert cfg["lora"]["keys"] > 0 and cfg["gate"] == parity_worker.DIT_GATES["cpu"]
    # the floor, measured and reported: one device is deterministic run to run, and another attention backend moves
    # its output (by about one rounding of the dtype): the exact gate is far below it
    floor = cfg["floor"]
    assert set(floor) == {f"{d}/{lay}" for d in dtypes for lay in LAYOUTS}
    assert all(f["run_to_run"] == 0 and 0 < f["attention_variant"] for f in floor.values())
    assert max(f["attention_variant"] for k, f in floor.items() if k.startswith("float32")) < 1e-6


def test_parity_two_devices_and_cost_model(thread_runs):
    report = run(thread_runs, "two")
    assert report["ok"]
    _check_rows(report["rows"], 2)
    cfg = report["config"]
    _check_config(cfg, 2)
    # the cost model's parameter formula, on the tiny config, counts the loaded checkpoint exactly
    assert costmodel.parameter_counts(tiny_cfg())["total"] == cfg["params"]
    # the cost model's packed sequence is the length upstream's PackedLayout built for the run (t2va; fl2va's two
    # keyframes); the tiny latent is 2 x 8 x 12 = 5 frames of 192 x 128 pixels
    seq = {r["layout"]: r["seq_len"] for r in report["rows"]}
    text = parity_worker.TEXT_LEN
    assert cfg["text_len"] == text
    assert costmodel.packed_sequence(192, 128, 5, text_tokens=text)["seq_len"] == seq["t2va"]
    assert costmodel.packed_sequence(192, 128, 5, text_tokens=text, keyframes=2)["seq_len"] == seq["fl2va"]


def test_parity_four_devices_cli(installed_tree, comfy_python):
    proc = h3kit("parity", "--comfy-home", str(installed_tree), "--component", "dit", "--device-type", "cpu",
                "--npu-count", "4", "--python", comfy_python, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = jsondoc.data(proc.stdout, proc.returncode)
    _check_rows(rows, 4)
    assert "parity passed: 21 row(s) within max_abs == 0" in proc.stderr


def test_parity_eight_devices(thread_runs):
    """8 devices (the node offers 1, 2, 4 and 8): a longer prompt there, so that each rank's shard is 12 rows or
    more, and still every row exact, fp32 and with the LoRA."""
    report = run(thread_runs, "eight")
    assert report["ok"] and report["config"]["text_len"] == parity_worker.TEXT_LEN_8
    _check_rows(report["rows"], 8, variants={("float32", False, False), ("float32", True, False)}, layouts={"t2va"})
    assert all(min(costmodel.shard_sizes(r["seq_len"], 8)) >= 12 for r in report["rows"])


@pytest.mark.parametrize("n, dtypes", [(2, "float32,bfloat16"), (4, "float32")])
def test_every_fault_fails_every_row_it_reaches(thread_runs, n, dtypes):
    faults = list(parity_worker.DIT_FAULTS)
    job = f"faults{n}"
    assert THREAD_JOBS[job]["extra_args"][3] == dtypes  # the run of this n: these dtypes, every fault, t2va
    rows = run(thread_runs, job)["rows"]
    assert {r["fault"] for r in rows} == set(faults)
    for fault in faults:
        hit = [r for r in rows if r["fault"] == fault]
        assert hit, f"{fault}: no row ran it"
        if fault.startswith("shard-"):  # the sharded weights' own faults reach the sharded rows only
            assert {r["sharding"] for r in hit} == {"sharded"} and all(r["max_abs_vs_replicated"] > 0 for r in hit)
        for r in hit:
            assert r["fault_fired"] > 0, f"{fault} did not strike in {r['layout']}/{r['attention']}"
            assert not r["pass"] and r["failed"], f"{fault} passed the gate in {r['layout']}/{r['attention']}: {r}"
            assert r["split"], "the fault, not a missing split, fails the row"
    assert {r["dtype"] for r in rows} == set(dtypes.split(","))
    # the 1e-6 faults fail every fp32 row (bf16 cannot hold them: below one rounding step), and do so on the figure
    # itself, a hundred times below what the 1e-4 one moves the output by
    for fault in ("noise-attention", "noise-mlp"):
        hit = [r for r in rows if r["fault"] == fault]
        assert {r["dtype"] for r in hit} == {"float32"} and all(r["max_abs"] > 0 for r in hit)
    noise = min(r["max_rel"] for r in rows if r["fault"] == "noise" and r["dtype"] == "float32")
    small = max(r["max_rel"] for r in rows if r["fault"] in ("noise-attention", "noise-mlp"))
    assert noise > 10 * small > 0, "the 1e-4 fault misses an exact gate by far more than the 1e-6 ones, which fail it"
    lora = {r["fault"]: r["lora_ranks"] for r in rows if r["fault"].startswith("lora") and r["sharding"] == "replicated"}
    assert lora["lora-missing"][-1] == "missing" and lora["lora-twice"][-1] == "wrong"
    assert lora["lora-missing"][:-1] == lora["lora-twice"][:-1] == ["once"] * (n - 1), "each rank judged itself"
    assert {r["attention"] for r in rows if r["fault"] == "heads"} == {"ulysses"}


def test_parity_refuses_an_unpatched_tree(pin_tree, comfy_python):
    proc = h3kit("parity", "--comfy-home", str(pin_tree), "--device-type", "cpu", "--npu-count", "2",
                "--python", comfy_python, "--json")
    assert proc.returncode == 1
    error = jsondoc.error(proc.stdout, proc.returncode)
    assert error["code"] == "not_patched" and "h3kit install" in error["fix"]


def _gone(pid: int, within: float) -> bool:
    """Whether `pid` has exited (a zombie counts) within `within` s; a survivor is killed, then reported."""
    import os
    import signal

    try:
        wait_for(lambda: not pid_running(pid), within, f"pid {pid} to end")
        return True
    except AssertionError:
        os.kill(pid, signal.SIGKILL)
        return False


def test_a_terminated_parity_run_takes_its_worker_with_it(installed_tree, comfy_python, tmp_path):
    """SIGTERM (a scheduler's timeout, a service manager) must not leave the worker holding the devices. The
    interpreter answers h3kit's package probe as the real one does, so the pid written is the worker's."""
    import signal
    import time

    pidfile = tmp_path / "worker.pid"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\ncase "$1" in *envprobe.py) exec {comfy_python} "$@";; esac\n'
                    f'echo "$$ $*" > {pidfile}\nexec sleep 300\n')
    fake.chmod(0o755)
    cli = subprocess.Popen([sys.executable, "-m", "h3kit", "parity", "--comfy-home", str(installed_tree),
                            "--component", "dit", "--device-type", "cpu", "--npu-count", "2",
                            "--python", str(fake), "--timeout", "600"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (pidfile.is_file() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline and cli.poll() is None, \
            f"the parity worker never wrote its pid (h3kit: {cli.poll()})"
        time.sleep(0.05)
    worker, args = pidfile.read_text().split(" ", 1)
    assert "--out" in args.split(), f"not the parity worker: {args}"
    worker = int(worker)
    cli.send_signal(signal.SIGTERM)
    out, err = cli.communicate(timeout=30)
    assert cli.returncode == 143 and "Traceback" not in err, err
    assert _gone(worker, 10), "the parity worker outlived h3kit"


def test_a_signal_while_the_interpreter_starts_leaves_nothing_running(installed_tree, tmp_path):
    """The interpreter h3kit probes sends h3kit SIGTERM the moment it runs, so the signal lands while the child is
    being started or just after: h3kit exits 143 and the child is gone. Before, a signal inside Popen's start
    raised out of it with the child running and nobody to kill it (CI saw it: the test above, whose pid was then
    the probe's); with the probe run as before, this test failed 4 runs of 6 here."""
    pidfile = tmp_path / "probe.pid"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nkill -TERM $PPID\nexec sleep 300\n")
    fake.chmod(0o755)
    proc = subprocess.run([sys.executable, "-m", "h3kit", "parity", "--comfy-home", str(installed_tree),
                           "--component", "dit", "--device-type", "cpu", "--npu-count", "2", "--python", str(fake)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr
    pid = wait_for(lambda: pidfile.is_file() and pidfile.read_text().strip(), 10, "the probed interpreter's pid")
    assert _gone(int(pid), 10), "the probed interpreter outlived h3kit"


MAPPING = r"""
import json, struct, sys
import torch
sys.path.insert(0, sys.argv[1])
import comfy.cli_args
comfy.cli_args.args.cpu = True
import comfy.multinpu_models as mm
path = sys.argv[2]
values = {"a": torch.arange(16.0), "b": torch.arange(3.0) + 100, "c": torch.arange(16.0) + 200}
# a at 0 and b at 64 bytes from the data's start, which the header's padding puts on a 64-byte boundary; c at 76
offsets, blob = {}, b""
for k, t in values.items():
    offsets[k] = [len(blob), len(blob) + 4 * t.numel()]
    blob += t.numpy().tobytes()
header = json.dumps({k: {"dtype": "F32", "shape": [t.numel()], "data_offsets": offsets[k]} for k, t in values.items()})
header += " " * ((-8 - len(header)) % 64)
with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header.encode() + blob)
out = {}
for aligned_only in (True, False):
    m = torch.nn.Module()
    for k, t in values.items():
        m.register_parameter(k, torch.nn.Parameter(t.clone(), requires_grad=False))
    out[str(aligned_only)] = {"shared": mm.map_file_weights(m, [path], aligned_only=aligned_only),
                              "misaligned": [k for k, p in m.named_parameters() if p.data_ptr() % mm.ALIGNMENT]}
out["default_on_cpu"] = mm.computes_on_host()
print(json.dumps(out))
"""


def test_weights_mapped_from_the_file_keep_the_cpu_kernels_alignment(installed_tree, comfy_python, tmp_path):
    """A safetensors file aligns its tensors to 8 bytes only; on a host that computes on its CPU only the weights
    whose mapped data is 64-byte aligned are pointed at the file (the CPU kernels round misaligned data differently:
    the process transport was 3.8e-7 off one device), the others keep their private copies."""
    proc = subprocess.run([comfy_python, "-c", MAPPING, str(installed_tree), str(tmp_path / "w.safetensors")],
                          cwd=installed_tree, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    assert out["True"] == {"shared": 4 * (16 + 3), "misaligned": []}
    assert out["False"] == {"shared": 4 * (16 + 3 + 16), "misaligned": ["c"]}
    assert out["default_on_cpu"] is True
