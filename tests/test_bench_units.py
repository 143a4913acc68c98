"""h3kit bench's seeds and its flag for a run that measured nothing, without a server."""

from __future__ import annotations

from h3kit import bench

PROMPT = {"3": {"class_type": "KSampler", "inputs": {"seed": 5, "steps": 2}},
          "8": {"class_type": "RandomNoise", "inputs": {"noise_seed": bench.SEED_LIMIT - 1}},
          "9": {"class_type": "Other", "inputs": {"seed": True}}}


def test_seeds_move_per_run_and_per_invocation():
    a, b = bench.new_seed_offset(), bench.new_seed_offset()
    assert len({a, b, *(bench.new_seed_offset() for _ in range(3))}) > 1 and min(a, b) > 0  # drawn anew
    run1, changed = bench.vary_seed(PROMPT, 0, a)
    assert changed == ["3.seed", "8.noise_seed"]  # a bool is not a seed
    assert run1["3"]["inputs"]["seed"] == 5 + a
    assert run1["8"]["inputs"]["noise_seed"] == a - 1  # wraps within ComfyUI's seed range
    assert bench.vary_seed(PROMPT, 1, a)[0]["3"]["inputs"]["seed"] == 6 + a
    assert PROMPT["3"]["inputs"]["seed"] == 5  # the workflow itself is not changed


def row(run, kind, seconds, executed):
    return {"run": run, "kind": kind, "end_to_end_s": seconds, "executed_nodes": executed, "models_loaded": 0}


def test_a_run_that_executed_no_node_is_flagged_and_left_out():
    runs = [row(1, "cold", 0.01, 0), row(2, "warm", 4.0, 7), row(3, "warm", 0.02, 0), row(4, "warm", 6.0, 7)]
    s = bench.summarize(runs)
    assert s["cold_s"] is None and s["warm_median_s"] == 5.0 and s["flagged_runs"] == [1, 3]
    assert runs[0]["flag"] == bench.NOTHING_EXECUTED and "flag" not in runs[1]
