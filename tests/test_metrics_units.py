"""GET /metrics without a server (patches/src/comfy/multinpu_metrics.py, issue 39): the text a scrape returns parsed
back with prometheus_client's own parser, the families and labels, failures and replacements by cause, the time to
recovery, the heartbeats and memory read from a driver's state without its lock, the restarts record, and the 503
when prometheus_client is missing. The real server, Prometheus and a fault: tests/test_metrics_prometheus.py."""

from __future__ import annotations

import json
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from tests.support import requires

torch = requires.module("torch", requires.NO_TORCH_REASON, allow_module_level=True)
prometheus_client = requires.module("prometheus_client", "prometheus_client is not installed in this interpreter: "
                                    "run the tests with the environment from tools/ensure-venv.sh (make test)",
                                    allow_module_level=True)
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "patches" / "src"))
import comfy.multinpu as multinpu  # noqa: E402  (namespace package: patches/src/comfy)
import comfy.multinpu_members as members  # noqa: E402
import comfy.multinpu_metrics as metrics  # noqa: E402
import comfy.multinpu_process as mp  # noqa: E402
import comfy.multinpu_wire as wire  # noqa: E402


@pytest.fixture
def record(monkeypatch):
    fresh = metrics.Record()
    monkeypatch.setattr(metrics, "RECORD", fresh)
    monkeypatch.setattr(metrics, "_REGISTRY", None)
    monkeypatch.setattr(metrics, "MIN_INTERVAL", 0.0)
    monkeypatch.setattr(metrics, "_LAST", {})
    monkeypatch.setattr(mp, "get_runtime", lambda: FakeDriver())
    return fresh


class FakeDriver:
    """What a GroupRuntime keeps that a scrape reads: members, state, the progress watch's newest beats, the hosts.
    Its _lock is held by another thread in the tests: a scrape must never wait for it."""

    def __init__(self, state="ready", beats=None, since=None):
        self.spec = wire.GroupSpec(nnodes=2, node_rank=0, local_size=1, device_type="cpu", join_timeout=240,
                                   timeout=450)
        self.world_size = 2
        self.state = state
        self.generation = 3
        self.members = {0: 101, 1: 202}
        self._progress = types.SimpleNamespace(_beats=beats or {}, _since=since or {}, bound=60.0)
        self._local = types.SimpleNamespace(info={0: {"host": "node0"}})
        self._remote_seen = {1: {"host": "node1", "pid": 202}}
        self._lock = threading.RLock()


def scrape(server=None, root=None) -> dict:
    """{family name: [(sample name, labels, value)]} of one exposition, parsed by prometheus_client."""
    status, content_type, body = metrics.exposition(server)
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4"), (status, body[:300])
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        out[family.name] = [(s.name, s.labels, s.value) for s in family.samples]
    return out


def value(families, name, sample=None, **labels):
    for s_name, s_labels, v in families[name]:
        if s_name == (sample or name) and all(s_labels.get(k) == str(want) for k, want in labels.items()):
            return v
    raise AssertionError(f"no {sample or name} {labels} in {families[name]}")


@pytest.mark.parametrize("exception_type, message, cause", [
    ("torch.OutOfMemoryError", "MultiNPU: rank 1 (cpu), pid 7 ran out of memory in dit_forward: ...", "oom"),
    ("RuntimeError", "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4611686018427387904", "oom"),
    ("comfy.multinpu_wire.RankDied", "MultiNPU: rank 1 (cpu) died during dit_forward (pid 7: killed by SIGKILL)",
     "rank_died"),
    ("comfy.multinpu_wire.RankHung", "MultiNPU: rank 1 (cpu) hung during dit_forward (pid 7: hung: ...)", "rank_hung"),
    ("comfy.multinpu_wire.SharedMemoryFull", "MultiNPU: /dev/shm has 1 MiB free", "shm_full"),
    ("comfy.multinpu_wire.GroupError", "MultiNPU: the process group did not form within 300 s: timeout", "timeout"),
    ("ValueError", "npu_count is 2 but ...", "other"),
])
def test_a_failed_prompt_is_counted_by_its_cause(exception_type, message, cause):
    assert metrics.failure_cause(exception_type, message) == cause


@pytest.mark.parametrize("why, cause", [
    ("MultiNPU: rank 1 (cpu), host vm, pid 7 ran out of memory in dit_forward: boom", "oom"),
    ("rank 1 (cpu) no heartbeat for 16 s (hung)", "rank_hung"),
    ("MultiNPU: rank 1 (cpu) hung during dit_forward (pid 7: hung: no progress for 61 s ...)", "rank_hung"),
    ("MultiNPU: rank 0 (cpu) died during te_forward (pid 7: killed by signal 9)", "rank_died"),
    ("rank 1 (cpu) exited with code 1", "rank_died"),
    ("the group's store ended", "store"),
    ("generation 3 did not form", "join"),
    ("MultiNPU: rank 0 failed in vae_decode: RuntimeError: injected", "other"),
])
def test_a_group_replacement_is_counted_by_its_cause(why, cause):
    assert metrics.replacement_cause(why) == cause


DYN = types.SimpleNamespace(get_node=lambda nid: {"c": {"class_type": "CheckpointLoaderSimple"},
                                                  "u": {"class_type": "UNETLoader"},
                                                  "g": {"class_type": "CFGGuider"},
                                                  "k": {"class_type": "BasicScheduler"},
                                                  "n": {"class_type": "RandomNoise"},
                                                  "s": {"class_type": "SamplerCustomAdvanced"},
                                                  "d": {"class_type": "VAEDecodeHunyuan3D"}}[nid])


def run_prompt(prompt_id, nodes, success=True, messages=(), created=None, seconds=None):
    """A prompt through the worker's hooks (main.py, execution.py): nodes [(id, seconds, cached)]."""
    metrics.prompt_started(prompt_id, {} if created is None else {"create_time": created})
    for nid, took, cached in nodes:
        metrics.node_done(DYN, nid, took, cached)
    metrics.prompt_done(success, list(messages), sum(t for _, t, _ in nodes) if seconds is None else seconds)


def test_prompts_failures_and_outcomes_appear_with_their_labels(record):
    run_prompt("a", [], True, [("execution_start", {}), ("execution_success", {})], seconds=166.0)
    run_prompt("b", [], False, [("execution_error", {"exception_type": "torch.OutOfMemoryError",
                                                     "exception_message": "ran out of memory"})], seconds=3.0)
    run_prompt("c", [], False, [("execution_interrupted", {})], seconds=1.0)
    got = scrape()
    assert {o: value(got, "h3kit_prompts", "h3kit_prompts_total", outcome=o) for o in metrics.OUTCOMES} == \
        {"success": 1, "error": 1, "interrupted": 1}
    assert value(got, "h3kit_prompt_failures", "h3kit_prompt_failures_total", cause="oom") == 1
    assert sum(v for n, _, v in got["h3kit_prompt_failures"] if n.endswith("_total")) == 1
    assert value(got, "h3kit_prompt_seconds", "h3kit_prompt_seconds_count", outcome="success") == 1
    assert value(got, "h3kit_prompt_seconds", "h3kit_prompt_seconds_count", outcome="error") == 1
    assert value(got, "h3kit_prompt_seconds", "h3kit_prompt_seconds_sum", outcome="error") == 3.0
    # 166 s falls between 150 and 180 (issue 47: 120 -> 300 read p50 210 s): fine buckets from 60 s to 15 minutes
    assert value(got, "h3kit_prompt_seconds", "h3kit_prompt_seconds_bucket", outcome="success", le="150.0") == 0
    assert value(got, "h3kit_prompt_seconds", "h3kit_prompt_seconds_bucket", outcome="success", le="180.0") == 1
    bounds = [float(s["le"]) for n, s, _ in got["h3kit_prompt_seconds"]
              if n.endswith("_bucket") and s["outcome"] == "success" and s["le"] != "+Inf"]
    within = [b for b in bounds if 60 <= b <= 900]
    assert len(within) >= 12 and max(b / a for a, b in zip(within, within[1:])) <= 1.5, within
    assert value(got, "h3kit_build_info", torch=torch.__version__) == 1


def test_each_stage_is_timed_once_per_prompt_summed_over_its_nodes_without_cache_hits(record):
    """Issue 47: "sample" is five nodes (guider, scheduler, noise, sampler; the sampler re-run after a pending
    result), and a cache hit is no work: one observation per prompt and stage, the sum of its nodes' real runs."""
    run_prompt("p1", [("c", 30.0, False), ("u", 12.0, False), ("g", 0.5, False), ("k", 0.25, False),
                      ("n", 0.25, False), ("s", 1.0, False), ("s", 98.0, False), ("d", 20.0, False)])
    run_prompt("p2", [("c", 0.01, True), ("u", 0.01, True), ("g", 0.5, False), ("k", 0.5, True),
                      ("n", 0.5, False), ("s", 99.0, False), ("d", 20.0, False)])
    got = scrape()
    assert value(got, "h3kit_stage_seconds", "h3kit_stage_seconds_count", stage="sample") == 2
    assert value(got, "h3kit_stage_seconds", "h3kit_stage_seconds_sum", stage="sample") == 100.0 + 100.0
    assert value(got, "h3kit_stage_seconds", "h3kit_stage_seconds_count", stage="load") == 1  # p2 loaded nothing
    assert value(got, "h3kit_stage_seconds", "h3kit_stage_seconds_sum", stage="load") == 42.0
    assert value(got, "h3kit_stage_seconds", "h3kit_stage_seconds_bucket", stage="sample", le="90.0") == 0
    assert value(got, "h3kit_stage_seconds", "h3kit_stage_seconds_bucket", stage="sample", le="120.0") == 2
    metrics.node_done(DYN, "s", 5.0)  # no prompt running (a node outside the worker): nothing to add it to
    assert value(scrape(), "h3kit_stage_seconds", "h3kit_stage_seconds_count", stage="sample") == 2


def test_queue_wait_end_to_end_and_the_running_prompt(record, monkeypatch):
    clock = {"wall": 1000.0, "mono": 50.0}
    monkeypatch.setattr(metrics.time, "time", lambda: clock["wall"])
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock["mono"])
    # queued at 1000 - 40 s (ComfyUI's create_time, ms), taken now
    metrics.prompt_started("p", {"create_time": int((1000.0 - 40.0) * 1000)})
    clock["wall"] += 600.0
    clock["mono"] += 600.0
    queue = types.SimpleNamespace(queue=[(1, "q1", {}, {"create_time": int((1000.0 + 100.0) * 1000)}, [], {}),
                                         (2, "q2", {}, {"create_time": int((1000.0 + 500.0) * 1000)}, [], {})],
                                  currently_running={7: 1})
    got = scrape(types.SimpleNamespace(prompt_queue=queue))
    assert value(got, "h3kit_prompt_running_seconds") == 600.0
    assert value(got, "h3kit_queue_oldest_pending_age_seconds") == 500.0
    assert value(got, "h3kit_queue_pending") == 2
    assert value(got, "h3kit_prompt_queue_wait_seconds", "h3kit_prompt_queue_wait_seconds_sum") == 40.0
    # H3kitPromptStuck's bounds, as this server runs them: longer than the ranks' longest weight read by default
    assert value(got, "h3kit_rank_stall_bound_seconds") == 1800.0 >= wire.LOAD_TIMEOUT
    assert value(got, "h3kit_prompt_stuck_bound_seconds") == 7200.0
    metrics.prompt_done(True, [], 600.0)
    queue.queue, queue.currently_running = [], {}
    got = scrape()
    assert value(got, "h3kit_prompt_e2e_seconds", "h3kit_prompt_e2e_seconds_sum", outcome="success") == 640.0
    assert value(got, "h3kit_prompt_running_seconds") == 0
    assert value(got, "h3kit_queue_oldest_pending_age_seconds") == 0


def test_commands_steps_model_cache_and_loads(record, monkeypatch):
    import comfy.model_cache as model_cache
    for seconds in (2.0, 2.5, 3.0):
        multinpu.notify(multinpu.COMMAND_LISTENERS, "dit_forward", seconds)
    with multinpu.timed("vae_decode"):
        pass
    installed = {0: 101}
    with multinpu.timed("install", installed):
        pass  # the ranks held it already: no install
    with multinpu.timed("install", installed):
        installed[1] = 202
    with pytest.raises(RuntimeError), multinpu.timed("te_forward"):
        raise RuntimeError("a failed command is the failures' to count")
    monkeypatch.setattr(model_cache, "_entries", model_cache.collections.OrderedDict())
    monkeypatch.setattr(model_cache, "_stats", {"hits": 0, "misses": 0, "evictions": 0})
    monkeypatch.setattr(model_cache, "make_key", lambda kind, paths, args=(), kwargs=None: (kind, tuple(paths)))
    monkeypatch.setattr(model_cache, "_size", lambda value: 1000)
    for _ in range(2):
        model_cache.load("vae", ["v.safetensors"], lambda: object())
    got = scrape()
    assert value(got, "h3kit_command_seconds", "h3kit_command_seconds_count", program="dit_forward") == 3
    assert value(got, "h3kit_command_seconds", "h3kit_command_seconds_sum", program="dit_forward") == 7.5
    assert value(got, "h3kit_command_seconds", "h3kit_command_seconds_count", program="vae_decode") == 1
    assert value(got, "h3kit_command_seconds", "h3kit_command_seconds_count", program="install") == 1
    assert {s["program"] for _, s, _ in got["h3kit_command_seconds"]} == {"dit_forward", "vae_decode", "install"}
    assert value(got, "h3kit_sampling_steps", "h3kit_sampling_steps_total") == 3
    assert value(got, "h3kit_model_cache_hits", "h3kit_model_cache_hits_total") == 1
    assert value(got, "h3kit_model_cache_misses", "h3kit_model_cache_misses_total") == 1
    assert value(got, "h3kit_model_cache_entries") == 1 and value(got, "h3kit_model_cache_size_bytes") == 1000
    assert value(got, "h3kit_model_load_seconds", "h3kit_model_load_seconds_count", kind="vae") == 1


def test_buckets_are_set_by_environment_for_other_hardware(caplog):
    env = {"H3KIT_METRICS_BUCKETS_PROMPT": "1,2,4", "H3KIT_METRICS_BUCKETS_STAGE": "5,3"}
    assert metrics.buckets("PROMPT", env) == (1.0, 2.0, 4.0)
    assert metrics.buckets("STAGE", env) == metrics.DEFAULT_BUCKETS["STAGE"]  # not increasing: the default, said
    assert "H3KIT_METRICS_BUCKETS_STAGE" in caplog.text
    assert metrics.Record(env).prompt_seconds["success"].buckets == (1.0, 2.0, 4.0)


def test_a_replacement_and_the_recovery_time_to_the_next_generation(record):
    record.group_state("forming", now=0.0)
    record.group_state("ready", now=1.0)  # the first formation is no recovery
    record.group_state("broken", "MultiNPU: rank 1 (cpu), pid 7 ran out of memory in dit_forward", now=10.0)
    record.group_state("forming", now=10.1)
    record.group_state("broken", "generation 2 did not form", now=20.0)  # still down: counted from the first
    record.group_state("ready", now=32.5)
    got = scrape()
    assert value(got, "h3kit_group_replacements", "h3kit_group_replacements_total", cause="oom") == 1
    assert value(got, "h3kit_group_replacements", "h3kit_group_replacements_total", cause="join") == 1
    assert value(got, "h3kit_group_recovery_seconds", "h3kit_group_recovery_seconds_count") == 1
    assert value(got, "h3kit_group_recovery_seconds", "h3kit_group_recovery_seconds_sum") == 22.5


def test_the_time_since_the_group_last_served(record, monkeypatch):
    driver = FakeDriver(state="forming")
    monkeypatch.setattr(mp, "get_runtime", lambda: driver)
    monkeypatch.setattr(record, "started", time.monotonic() - 50.0)  # never served since the server started
    assert 50.0 <= value(scrape(), "h3kit_group_unready_seconds") < 52.0
    driver.state = "ready"  # ready before monitoring heard of it (its listener came later): serving is serving
    assert value(scrape(), "h3kit_group_unready_seconds") == 0
    record.group_state("broken", "rank 1 died", now=time.monotonic() - 20.0)
    driver.state = "broken"
    assert 20.0 <= value(scrape(), "h3kit_group_unready_seconds") < 22.0  # from the break, not the server's start
    record.group_state("forming", now=time.monotonic() - 10.0)  # still down: counted from the first
    assert 20.0 <= value(scrape(), "h3kit_group_unready_seconds") < 22.0
    record.group_state("ready")
    driver.state = "ready"
    assert value(scrape(), "h3kit_group_unready_seconds") == 0


def test_the_driver_notifies_monitoring_at_each_state(record, monkeypatch):
    assert metrics._group_state in members.LISTENERS
    seen = []
    monkeypatch.setattr(members, "LISTENERS", [lambda state, why: seen.append((state, why))])
    driver = types.SimpleNamespace(state="broken", generation=3, error=None, members={},
                                   _mon=types.SimpleNamespace(put=lambda *a: None))
    members.GroupMonitor._put_state(driver, "rank 1 died")
    assert seen == [("broken", "rank 1 died")]


def test_ranks_heartbeats_and_memory_come_from_the_driver_without_its_lock(record, monkeypatch):
    now = time.monotonic()
    gib = 1024 ** 3
    beats = {(0, 101): ({"g": 1, "physical_device": "4", "memory": {"allocated": 5, "reserved": 6, "peak": 7,
                                                                    "used": 20 * gib, "capacity": 32 * gib,
                                                                    "host_rss": 3 * gib}}, now - 0.5),
             (1, 202): ({"g": 1, "physical_device": "5", "memory": {"allocated": 8, "reserved": 9, "peak": 10,
                                                                    "used": 21 * gib, "capacity": 32 * gib,
                                                                    "host_rss": 2 * gib}}, now - 3.0),
             (1, 999): ({"g": 0, "memory": {"allocated": 1}}, now)}  # a retired worker: not a member
    since = {(0, 101): ((1, 4, 80, 0, True), now - 2.0), (1, 202): ((1, 4, 79, 0, False), now - 700.0)}
    driver = FakeDriver(beats=beats, since=since)
    monkeypatch.setattr(mp, "get_runtime", lambda: driver)
    held = threading.Event()
    release = threading.Event()

    def hold():
        with driver._lock:
            held.set()
            release.wait(30)
    threading.Thread(target=hold, daemon=True).start()
    held.wait(5)
    try:
        t0 = time.monotonic()
        got = scrape()
        assert time.monotonic() - t0 < 1.0
    finally:
        release.set()
    assert value(got, "h3kit_group_ranks", state="joined") == 2
    assert value(got, "h3kit_group_ranks", state="missing") == 0
    assert 0.4 < value(got, "h3kit_rank_heartbeat_age_seconds", rank=0, host="node0") < 2.0
    assert 2.9 < value(got, "h3kit_rank_heartbeat_age_seconds", rank=1, host="node1") < 5.0
    # seconds since the device last advanced: since the beats' progress position last changed (the watch's record)
    assert 700.0 <= value(got, "h3kit_rank_progress_age_seconds", rank=1, host="node1") < 702.0
    assert value(got, "h3kit_rank_info", rank=1, host="node1", device="cpu", physical_device="5", pid=202) == 1
    assert len(got["h3kit_rank_info"]) == 2
    # use and capacity each their own family (Prometheus' naming guide), labelled with the physical device
    assert value(got, "h3kit_device_memory_used_bytes", rank=0, physical_device="4") == 20 * gib
    assert value(got, "h3kit_device_memory_capacity_bytes", rank=1, physical_device="5") == 32 * gib
    assert value(got, "h3kit_device_memory_reserved_bytes", rank=1) == 9
    assert value(got, "h3kit_device_memory_allocated_bytes", rank=1) == 8
    assert value(got, "h3kit_worker_resident_memory_bytes", rank=0) == 3 * gib
    assert "h3kit_device_memory_bytes" not in got
    assert value(got, "h3kit_group_generation") == 3 and value(got, "h3kit_group_state", state="ready") == 1
    assert sum(v for _, _, v in got["h3kit_group_state"]) == 1 and value(got, "h3kit_group_unready_seconds") == 0
    assert value(got, "h3kit_group_join_timeout_seconds") == 240
    assert value(got, "h3kit_group_heartbeat_timeout_seconds") == wire.HEARTBEAT_STALE
    assert value(got, "h3kit_group_progress_bound_seconds") == 60.0
    assert value(got, "h3kit_group_collective_timeout_seconds") == 450
    driver.state, driver.members = "broken", {}  # replaced: nobody joined
    got = scrape()
    assert value(got, "h3kit_group_ranks", state="joined") == 0
    assert value(got, "h3kit_group_ranks", state="missing") == 2
    assert value(got, "h3kit_group_state", state="broken") == 1


def test_each_prompts_memory_peak_from_the_beats_reset_per_prompt(record, monkeypatch):
    """A worker's beat carries its allocator's peak since its previous beat (memory_stats(reset_peak=True)); the
    server keeps each rank's largest while a prompt runs, and starts again with the next prompt."""
    now = time.monotonic()
    driver = FakeDriver(beats={(0, 101): ({"memory": {}}, now), (1, 202): ({"memory": {}}, now)})
    monkeypatch.setattr(mp, "get_runtime", lambda: driver)
    assert metrics._beat in multinpu.BEAT_LISTENERS

    def beat(rank, peak, used):
        multinpu.notify(multinpu.BEAT_LISTENERS, rank, {"memory": {"peak": peak, "used": used}})
    beat(1, 999, 999)  # no prompt running: nobody's peak
    metrics.prompt_started("p1", {})
    for peak, used in ((30, 40), (90, 95), (20, 41)):
        beat(1, peak, used)
    beat(0, 10, 12)
    got = scrape()
    assert value(got, "h3kit_device_memory_prompt_peak_bytes", rank=1, source="allocated") == 90
    assert value(got, "h3kit_device_memory_prompt_peak_bytes", rank=1, source="used") == 95
    metrics.prompt_done(True, [], 1.0)
    assert value(scrape(), "h3kit_device_memory_prompt_peak_bytes", rank=1, source="allocated") == 90  # the last
    metrics.prompt_started("p2", {})
    beat(1, 25, 30)
    got = scrape()
    assert value(got, "h3kit_device_memory_prompt_peak_bytes", rank=1, source="allocated") == 25  # reset
    assert not [s for _, s, _ in got["h3kit_device_memory_prompt_peak_bytes"] if s["rank"] == "0"]


def test_queue_shm_and_restarts(record, tmp_path, monkeypatch):
    monkeypatch.setattr(mp, "get_runtime", lambda: FakeDriver())
    server = types.SimpleNamespace(prompt_queue=types.SimpleNamespace(queue=[1, 2, 3], currently_running={7: 1}))
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "restarts.json").write_text(json.dumps({"restarts": {"died": 2, "manual": 1},
                                                                    "prompts_lost": {"crash": 1},
                                                                    "prompts_requeued": {"pending": 3}}))
    monkeypatch.setenv(metrics.RUNTIME_ROOT_ENV, str(tmp_path))
    monkeypatch.setenv("H3KIT_SHM_DIR", str(tmp_path))
    got = scrape(server)
    assert value(got, "h3kit_queue_pending") == 3
    assert value(got, "h3kit_queue_running") == 1
    assert 0 < value(got, "h3kit_shm_free_bytes") <= value(got, "h3kit_shm_capacity_bytes")
    assert value(got, "h3kit_service_restarts", "h3kit_service_restarts_total", reason="died") == 2
    assert value(got, "h3kit_service_restarts", "h3kit_service_restarts_total", reason="manual") == 1
    # the prompts a restart's restore could not queue again, and those it did (issue 47), every label from 0
    assert {s["reason"]: v for n, s, v in got["h3kit_prompts_lost"] if n.endswith("_total")} == \
        {"crash": 1, "dropped": 0, "refused": 0}
    assert {s["state"]: v for n, s, v in got["h3kit_prompts_requeued"] if n.endswith("_total")} == \
        {"running": 0, "pending": 3}
    (tmp_path / "metrics" / "restarts.json").write_text("{not json")  # a damaged record: no series, no error
    monkeypatch.setattr(metrics, "_REGISTRY", None)
    assert {s["reason"]: v for n, s, v in scrape(server)["h3kit_service_restarts"] if n.endswith("_total")} == \
        {"died": 0, "unhealthy": 0, "manual": 0}


def test_without_a_process_group_the_servers_own_devices(record, monkeypatch):
    monkeypatch.setattr(mp, "get_runtime", lambda: None)  # threads, or one device
    devices = types.SimpleNamespace(get_devices=lambda: [torch.device("cpu")] * 2)
    monkeypatch.setitem(sys.modules, "comfy.multidevice", devices)
    got = scrape()
    assert value(got, "h3kit_group_ranks", state="joined") == 2
    assert {s["rank"] for _, s, _ in got["h3kit_device_memory_used_bytes"]} == {"0", "1"}
    assert not got["h3kit_rank_heartbeat_age_seconds"]  # ranks as threads do not beat
    assert "h3kit_group_state" not in got  # no process group
    monkeypatch.setenv("H3KIT_DEVICES", "6,7")
    got = scrape()
    assert {s["physical_device"] for _, s, _ in got["h3kit_rank_info"]} == {"6", "7"}


def test_the_memory_a_worker_beats_with():
    got = multinpu.memory_stats(torch.device("cpu"))
    assert set(got) == {"allocated", "reserved", "peak", "used", "capacity", "host_rss"}
    assert 0 < got["allocated"] <= got["peak"] < got["capacity"] and 0 < got["used"] < got["capacity"]
    assert multinpu.memory_stats(torch.device("meta")) == {}  # unreadable: nothing, never an error


def test_the_cpu_twin_resets_its_peak_as_the_allocator_does():
    """On cpu the peak is the process's largest resident set since the last reset (VmHWM, reset through
    /proc/self/clear_refs), as torch's max_memory_allocated is since reset_peak_memory_stats on a device."""
    block = bytearray(256 * 1024 * 1024)  # touched: resident
    block[::4096] = b"x" * len(block[::4096])
    high = multinpu.memory_stats(torch.device("cpu"))["peak"]
    del block
    assert multinpu.memory_stats(torch.device("cpu"), reset_peak=True)["peak"] > high - 16 * 1024 * 1024  # read, reset
    after = multinpu.memory_stats(torch.device("cpu"))
    assert after["peak"] < high - 128 * 1024 * 1024, (high, after)  # the reset's resident set, not the block's


@pytest.mark.parametrize("environ, index, physical", [
    ({"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}, 1, "5"), ({"CUDA_VISIBLE_DEVICES": "2,3"}, 0, "2"),
    ({"H3KIT_DEVICES": "1"}, 0, "1"), ({}, 3, "3"), ({"ASCEND_RT_VISIBLE_DEVICES": "4"}, 2, "2")])
def test_the_physical_device_from_the_visible_devices(environ, index, physical):
    assert multinpu.physical_device(index, environ) == physical


def test_a_storm_of_scrapes_renders_once_per_interval(record, monkeypatch):
    monkeypatch.setattr(metrics, "MIN_INTERVAL", 30.0)
    first = metrics.exposition()[2]
    metrics.prompt_done(True, [], 1.0)
    assert metrics.exposition()[2] == first  # within the interval: the same text
    assert metrics.exposition(accept="application/openmetrics-text; version=1.0.0")[2].endswith(b"# EOF\n")
    monkeypatch.setattr(metrics, "MIN_INTERVAL", 0.0)
    assert b'h3kit_prompts_total{outcome="success"} 1.0' in metrics.exposition()[2]


def test_the_pacer_answers_a_storm_one_per_pace_first_come_first_served():
    """GET /metrics' Pacer: 8 clients each asking again as soon as answered get their answers no closer than `every`
    apart, each answered before any is answered twice. Lower bounds: a loaded host spaces them further, never closer."""
    import asyncio
    pacer, answers = metrics.Pacer(0.02), []

    async def client(i):
        for _ in range(3):
            async with pacer.turn():
                answers.append((time.monotonic(), i))

    async def storm():
        pacer._last = pacer.clock()  # a scrape just answered: the storm's first client waits, the others queue behind
        await asyncio.gather(*(client(i) for i in range(8)))
    asyncio.run(storm())
    times = [t for t, _ in answers]
    assert len(answers) == 24 and min(b - a for a, b in zip(times, times[1:])) >= 0.02 - 0.002
    assert [i for _, i in answers] == list(range(8)) * 3


def test_the_pacer_counts_its_interval_from_an_answer_that_failed():
    import asyncio
    pacer = metrics.Pacer(30.0, clock=lambda: 100.0)

    async def failing():
        with pytest.raises(RuntimeError):
            async with pacer.turn():
                raise RuntimeError("the render failed")
    asyncio.run(failing())
    assert pacer._last == 100.0  # the next scrape waits its turn after a failed one too


def test_without_prometheus_client_metrics_answers_503_naming_the_fix(record, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    status, content_type, body = metrics.exposition()
    assert status == 503 and content_type.startswith("text/plain")
    assert b"prometheus_client" in body and b"pip install prometheus-client" in body


def test_the_collectors_passes_are_timed_by_generation_without_a_lock(record, monkeypatch):
    """h3kit_gc_pause_seconds: each pass of the collector, which holds every route of the server while it walks
    (docs/performance.md, "Monitoring": upstream's gc.collect() after prompts was the stall of a replacement)."""
    ticks = iter([10.0, 10.3, 20.0, 20.002, 30.0])
    pauses = metrics.GcPauses(clock=lambda: next(ticks))
    monkeypatch.setattr(metrics, "GC_PAUSES", pauses)
    pauses("start", {"generation": 2})
    pauses("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
    pauses("start", {"generation": 0})
    pauses("stop", {"generation": 0, "collected": 5, "uncollectable": 0})
    pauses("stop", {"generation": 1, "collected": 0, "uncollectable": 0})  # no start seen: not counted
    got = scrape()
    assert value(got, "h3kit_gc_pause_seconds", "h3kit_gc_pause_seconds_count", generation=2) == 1
    assert value(got, "h3kit_gc_pause_seconds", "h3kit_gc_pause_seconds_sum", generation=2) == pytest.approx(0.3)
    assert value(got, "h3kit_gc_pause_seconds", "h3kit_gc_pause_seconds_bucket", generation=2, le="0.25") == 0
    assert value(got, "h3kit_gc_pause_seconds", "h3kit_gc_pause_seconds_bucket", generation=2, le="0.5") == 1
    assert value(got, "h3kit_gc_pause_seconds", "h3kit_gc_pause_seconds_bucket", generation=0, le="0.005") == 1
    assert value(got, "h3kit_gc_pause_seconds", "h3kit_gc_pause_seconds_count", generation=1) == 0
    # attached once, whatever the number of servers a process builds; a real pass of the collector is counted
    import gc
    real = metrics.GcPauses()
    monkeypatch.setattr(metrics, "GC_PAUSES", real)
    try:
        metrics.watch_gc()
        metrics.watch_gc()
        assert gc.callbacks.count(real) == 1
        gc.collect()
    finally:
        while real in gc.callbacks:
            gc.callbacks.remove(real)
    assert real.by_generation[2].count == 1 and real.by_generation[2].sum > 0
