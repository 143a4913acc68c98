"""`h3kit calibrate` on the CPU simulation (small sizes), its analysis, and `h3kit plan --calibration`."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest

from h3kit.cli import main
from h3kit.errors import H3kitError
from h3kit.runtime import calibration, costmodel
from tests.support import jsondoc
from tests.support import requires


@pytest.fixture(scope="module")
def measured(installed_tree, comfy_python, tmp_path_factory):
    """One real small calibration on 4 simulated devices (about 15 s on 2 cores), shared by the tests here."""
    out = tmp_path_factory.mktemp("calibrate") / "cal.json"
    proc = subprocess.run([sys.executable, "-m", "h3kit", "calibrate", "--comfy-home", str(installed_tree),
                           "--device-type", "cpu", "--npu-count", "4", "--repeats", "1", "--python", comfy_python,
                           "--out", str(out), "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert jsondoc.data(proc.stdout, proc.returncode) == json.loads(out.read_text())
    return json.loads(out.read_text()), out


def test_small_run_measures_every_stage_at_the_plans_message_sizes(measured):
    rep, _ = measured
    assert rep["kind"] == "h3kit-calibration" and rep["device_type"] == "cpu" and rep["simulated"]
    assert "scaled down" in rep["note"] and rep["dims"]["hidden"] == 384 and rep["sizes"] == "small"
    lengths = {g["name"]: g["seq_len"] for g in rep["geometries"]}
    assert lengths == {"768p/5s": round(38010 / 32), "768p/15s": round(109362 / 32)}
    # every ordered pair of the 4 devices, and every tier copying at once
    assert sorted((p["src"], p["dst"]) for p in rep["copy"]["pairs"]) == [(i, j) for i in range(4) for j in range(4) if i != j]
    assert [r["world"] for r in rep["copy"]["ring"]] == [2, 4]
    # three collectives x two geometries x tiers 2 and 4, on both transports; analyse() already refused any
    # row whose counted bytes differ from the plan's (test_a_collective_moving_other_bytes_fails below)
    for transport in ("threads", "process"):
        rows = rep["collectives"][transport]
        assert sorted((r["op"], r["world"], r["geometry"]) for r in rows) == sorted(
            (op, n, g) for op in ("scatter", "gather", "final") for n in (2, 4) for g in lengths)
        assert all(r["seconds"] > 0 and r["bytes"] > 0 for r in rows)
    assert rep["collectives"]["process_skipped"] is None and rep["backend"] == "gloo"
    # the block at each tier's shard: rank 0's share of the sequence
    for b in rep["blocks"]:
        assert b["shard"] == costmodel.shard_sizes(lengths[b["geometry"]], b["world"])[0] and b["seconds"] > 0
    assert sorted((b["geometry"], b["world"]) for b in rep["blocks"]) == sorted((g, n) for g in lengths for n in (1, 2, 4))


def test_projection_per_tier(measured):
    rep, _ = measured
    fit = rep["fit"]
    assert fit["compute"]["tflops_linear"] > 0 and fit["compute"]["tflops_attention"] > 0
    assert set(fit["exchange"]) == {"threads", "process"}
    for t in rep["tiers"]:
        block = next(b for b in rep["blocks"] if (b["geometry"], b["world"]) == (t["geometry"], t["world"]))
        for transport in ("threads", "process"):
            if t["world"] == 1:
                assert t["speedup"][transport] == 1.0 and t["forward_s"][transport] == 50 * block["seconds"]
            else:  # the exchange only adds time to 50 blocks
                assert t["forward_s"][transport] > 50 * block["seconds"] and math.isfinite(t["speedup"][transport])


def test_text_output_and_plan_with_the_calibration(measured, runner):
    rep, path = measured
    r = runner.invoke(main, ["plan", "--width", "1344", "--height", "768", "--frames", "362", "--npu-count", "1",
                             "--npu-count", "4", "--calibration", str(path)])
    assert r.exit_code == 0, r.output
    assert "calibrated from: 4 simulated cpu device(s), small sizes" in r.output and "CPU calibration" in r.output
    assert "speed-up vs 1 device (threads)" in r.output and "step (process)" in r.output
    r = runner.invoke(main, ["plan", "--width", "1344", "--height", "768", "--frames", "362", "--npu-count", "1",
                             "--npu-count", "4", "--calibration", str(path), "--json"])
    one, four = jsondoc.data(r.stdout, r.exit_code)["plans"]
    assert one["calibrated"]["exchange_s_step"] == {"threads": 0.0, "process": 0.0}
    assert one["calibrated"]["speedup"] == {"threads": 1.0, "process": 1.0}
    assert four["calibrated"]["step_s"]["threads"] > four["calibrated"]["compute_s_step"] > 0


def _calibration(tflops_linear=100.0, tflops_attention=50.0, gbs=20.0, latency=1e-4):
    line = {"latency_s": latency, "gbs": gbs, "points": 2, "max_rel_err": 0.0}
    return {"kind": calibration.KIND, "schema": calibration.SCHEMA, "device_type": "npu", "simulated": False,
            "npu_count": 4, "sizes": "real", "dtype": "bf16", "date": "2026-12-01T00:00:00",
            "machine": {"host": "h", "device_name": "Ascend910B3"},
            "fit": {"compute": {"tflops_linear": tflops_linear, "tflops_attention": tflops_attention, "max_rel_err": 0.0},
                    "exchange": {"threads": {"all_to_all": line, "all_gather": line},
                                 "process": {"all_to_all": dict(line, gbs=2 * gbs), "all_gather": dict(line, gbs=2 * gbs)}}}}


def test_calibrated_plan_follows_the_measured_figures():
    plan = costmodel.plan(1344, 768, 124, 4)
    base = calibration.apply(plan, _calibration())
    faster = calibration.apply(plan, _calibration(tflops_linear=200.0, tflops_attention=100.0))
    assert faster["compute_s_step"] == pytest.approx(base["compute_s_step"] / 2)
    assert faster["exchange_s_step"] == base["exchange_s_step"]
    # the process transport's fit has twice the bandwidth: less exchange time, the same latency count
    assert base["exchange_s_step"]["process"] < base["exchange_s_step"]["threads"]
    slow_link = calibration.apply(plan, _calibration(gbs=2.0))
    assert slow_link["exchange_s_step"]["threads"] > 5 * base["exchange_s_step"]["threads"]
    assert base["step_s"]["threads"] == pytest.approx(base["compute_s_step"] + base["exchange_s_step"]["threads"])
    assert "Ascend910B3" in base["from"]


def test_fits_recover_what_made_the_points():
    pts = [(n, 2e-4 + n / 25e9) for n in (1e6, 4e6, 16e6, 64e6)]
    fit = calibration.fit_line(pts)
    assert fit["gbs"] == pytest.approx(25.0) and fit["latency_s"] == pytest.approx(2e-4) and fit["max_rel_err"] < 1e-9
    blocks = [{"flops_linear": lin, "flops_attention": att, "seconds": lin / 80e12 + att / 30e12}
              for lin, att in ((1e12, 1e12), (2e12, 8e12), (4e12, 4e12), (1e12, 16e12))]
    fit = calibration.fit_compute(blocks)
    assert fit["tflops_linear"] == pytest.approx(80.0) and fit["tflops_attention"] == pytest.approx(30.0)
    same_mix = [{"flops_linear": f, "flops_attention": f, "seconds": 2 * f / 50e12} for f in (1e12, 2e12)]
    fit = calibration.fit_compute(same_mix)  # degenerate: one throughput for all FLOPs
    assert fit["tflops_linear"] == fit["tflops_attention"] == pytest.approx(50.0)


def _raw_from(rep):
    """The worker's raw answer, rebuilt from an analysed report."""
    keep = ("op", "world", "geometry", "seconds", "bytes_counted", "counted_for")
    return {"devices": rep["devices"], "simulated": rep["simulated"], "torch": rep["machine"]["torch"],
            "copy": {"pairs": rep["copy"]["pairs"], "ring": rep["copy"]["ring"]},
            "threads": [{k: r[k] for k in keep} for r in rep["collectives"]["threads"]],
            "process": {"rows": [{k: r[k] for k in keep} for r in rep["collectives"]["process"]]},
            "blocks": [{k: b[k] for k in ("geometry", "world", "shard", "seq_len", "seconds")} for b in rep["blocks"]]}


def test_a_collective_moving_other_bytes_fails(measured):
    rep, _ = measured
    cfg = calibration.config("cpu", 4, "small")
    again = calibration.analyse(_raw_from(rep), cfg)
    assert again["tiers"] == rep["tiers"] and again["fit"] == rep["fit"]
    raw = _raw_from(rep)
    row = next(r for r in raw["process"]["rows"] if r["op"] == "gather" and r["world"] == 4)
    row["bytes_counted"] -= 4 * 48  # one head row of one token missing: an uneven shard moved wrong
    with pytest.raises(H3kitError) as e:
        calibration.analyse(raw, cfg)
    assert e.value.code == "bytes_mismatch" and "process gather on 4 devices at 768p/" in e.value.message


def test_ulysses_stand_in_gives_the_attention_one_rank_runs():
    torch = requires.module("torch", requires.NO_TORCH_REASON)
    spec = importlib.util.spec_from_file_location("calibrate_worker", calibration.WORKER)
    cw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cw)
    seen = []

    def attention(q, k, v, heads, skip_reshape=False, **kwargs):
        seen.append((tuple(q.shape), heads, skip_reshape))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)        # [1, H/P, S, D]
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)         # [1, S, H/P*D]

    q = torch.randn(1, 8, 25, 16)
    out = cw.UlyssesCompute(4, 100)(attention, q, q, q, 8, skip_reshape=True)
    assert seen == [((1, 2, 100, 16), 2, True)] and tuple(out.shape) == (1, 25, 8 * 16)


def test_bad_input_is_refused_before_anything_runs(runner, tmp_path):
    r = runner.invoke(main, ["calibrate", "--comfy-home", str(tmp_path), "--device-type", "cpu", "--npu-count", "4",
                             "--sizes", "real"])
    assert r.exit_code == 2 and "--sizes real on cpu" in r.output and "TFLOP" in r.output and "GB of activations" in r.output
    assert "fix: use --sizes small on cpu" in r.output
    bad = tmp_path / "not-a-report.json"
    bad.write_text(json.dumps({"kind": "something else"}))
    for extra in ([], ["--tflops", "100"]):
        r = runner.invoke(main, ["plan", "--width", "1344", "--height", "768", "--frames", "124", "--npu-count", "4",
                                 "--calibration", str(bad), *extra])
        assert r.exit_code == 2 and "Traceback" not in r.output
    assert "not an h3kit calibration report" in runner.invoke(main, [
        "plan", "--width", "1344", "--height", "768", "--frames", "124", "--npu-count", "4", "--calibration", str(bad)]).output


def test_plot_without_matplotlib_says_how_before_measuring(runner, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails, installed or not
    r = runner.invoke(main, ["calibrate", "--comfy-home", str(tmp_path), "--device-type", "cpu", "--npu-count", "2",
                             "--plot", str(tmp_path / "p.png")])
    assert r.exit_code == 1 and "[no_matplotlib]" in r.output and "pip install 'h3kit[plot]'" in r.output
    assert "python -m h3kit.runtime.calplot REPORT.json OUT.png" in r.output
    assert not (tmp_path / ".h3kit").exists()  # nothing measured, nothing written


def test_exchange_messages_are_the_plans_bytes():
    """The per-rank messages calibrate times add up to plan's busiest-device exchange."""
    for seq, world in ((38010, 2), (38010, 4), (109362, 4), (1188, 4)):
        m = costmodel.exchange_messages(seq, world)
        e = costmodel.exchange_elements(seq, world, hidden=5376, heads=56, head_dim=128, blocks=50)
        assert 50 * (m["scatter"] + m["gather"]) + m["final"] == e["per_device_max"]
