"""Several servers of one tree (issue 46, items 1 and 2), against the stand-in server (tests/support/standin_server.py):
each server's own folder, ports and output/temp folders, the commands that need --port when several run, and a
planned stop that keeps the queue for the next start. The real-server case (two ComfyUI servers running prompts at
once) is in tests/test_service_servers_real.py.
"""

from __future__ import annotations

import itertools
import json
import os

import pytest

from tests.support import jsondoc
from tests.support.service_helpers import StandinHome, free_port, http_status, kill_started_under, wait_for

from h3kit import group, queuesave
from h3kit.errors import UsageError


# --------------------------------------------------------------------------------------------- ports (units)


def _ranges(devices: list[int]) -> list[range]:
    band = group.hccl_band(devices, env={})
    return [range(band, band + group.HCCL_BAND), group.store_ports(devices)]


def test_servers_on_disjoint_devices_get_disjoint_port_ranges():
    # every way an 8-device host (and a 16-device one) splits into servers: no port of one server's HCCL band or
    # store range is any other server's, nor the other kind's
    splits = [[[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]], [[d] for d in range(16)],
              [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]]
    for split in splits:
        ranges = [r for devices in split for r in _ranges(devices)]
        for a, b in itertools.combinations(ranges, 2):
            assert not set(a) & set(b), (split, a, b)
        assert all(r[-1] <= 65535 and r[0] >= 1024 for r in ranges)
    # the first server keeps what one server always had: HCCL's own default base port
    assert group.hccl_band([0, 1, 2, 3], env={}) == 60000 and group.hccl_band([4, 5, 6, 7], env={}) == 61024
    # the store range stays below the kernel's ephemeral ports, where outgoing connections would take them
    assert max(group.store_ports([15])) < 32768


def test_the_hccl_base_the_operator_sets_is_the_hosts_first_band():
    assert group.hccl_band([4, 5], env={group.HCCL_PORT_ENV: "50000"}) == 50000 + 4 * group.HCCL_BAND
    for bad in ("12", "sixty", "65000"):
        with pytest.raises(UsageError) as e:
            group.hccl_band([4], env={group.HCCL_PORT_ENV: bad})
        assert e.value.code == "bad_hccl_port" and group.HCCL_PORT_ENV in e.value.message


def test_the_store_port_is_a_free_one_of_the_servers_range():
    got = {group.choose_store_port("127.0.0.1", [4, 5, 6, 7]) for _ in range(20)}
    assert got <= set(group.store_ports([4]))
    assert len(got) > 1  # at random among the free ones: two starts at once seldom meet


# --------------------------------------------------------------------------------------------- the stand-in


@pytest.fixture
def two(tmp_path):
    """One stand-in tree and two ports; the second server's Home shares the tree and its runtime root."""
    first = StandinHome(tmp_path / "comfy", free_port(8410, 8469))
    second = StandinHome(tmp_path / "comfy", free_port(8410, 8469, exclude=(first.port,)))
    yield first, second
    kill_started_under(first.path)


def _json(r):
    return jsondoc.data(r.stdout, r.returncode)


def test_a_second_server_on_other_devices_gets_a_folder_and_folders_of_its_own(two):
    first, second = two
    assert first.start(devices="0").returncode == 0
    r = second.start("--json", devices="1")
    assert r.returncode == 0, r.stderr
    started = _json(r)
    own = first.root / "servers" / str(second.port)
    assert started["runtime_root"] == str(own) and (own / "server.json").is_file()
    assert json.loads((first.root / "server.json").read_text())["port"] == first.port  # the first one's, as before
    assert http_status(f"{first.url}/system_stats") == 200 and http_status(f"{second.url}/system_stats") == 200
    boots = {b["pid"]: b["argv"] for b in first.boots()}
    argv = boots[started["pid"]]
    assert argv[argv.index("--output-directory") + 1] == str(first.path / "output" / str(second.port))
    assert argv[argv.index("--temp-directory") + 1] == str(own)
    first_argv = boots[first.record()["pid"]]
    assert "--output-directory" not in first_argv and "--temp-directory" not in first_argv
    assert started["log"].startswith(str(own / "logs" / "comfyui-"))
    # status lists both; the exit code is 0 while both run
    r = first.run("status", "--json")
    assert r.returncode == 0, r.stderr
    listed = _json(r)["servers"]
    assert [s["port"] for s in listed] == [first.port, second.port] and all(s["running"] for s in listed)
    # a start again on the second port finds that server, in its folder
    again = second.start(devices="1")
    assert again.returncode == 0 and "already running" in again.stdout and len(first.boots()) == 2


def test_without_port_the_commands_are_refused_while_several_run(two):
    first, second = two
    assert first.start(devices="0").returncode == 0 and second.start(devices="1").returncode == 0
    for command in (["stop"], ["restart"], ["logs"], ["watch", "--max-seconds", "1"]):
        r = first.run(*command)
        assert r.returncode == 1 and "several_servers" in r.stderr, (command, r.stderr)
        assert str(first.port) in r.stderr and str(second.port) in r.stderr and "--port" in r.stderr
    assert http_status(f"{first.url}/system_stats") == 200 and http_status(f"{second.url}/system_stats") == 200
    r = first.run("logs", "--port", str(second.port))
    assert r.returncode == 0 and f"'port': {second.port}" in r.stdout
    r = first.run("stop", "--port", str(second.port))
    assert r.returncode == 0 and "stopped" in r.stdout, r.stderr
    assert http_status(f"{second.url}/system_stats") is None and http_status(f"{first.url}/system_stats") == 200
    r = first.run("stop")  # one left: as with one server
    assert r.returncode == 0 and "stopped" in r.stdout, r.stderr
    assert http_status(f"{first.url}/system_stats") is None


def test_plain_stop_says_how_many_prompts_it_discards(two):
    first, _ = two
    first.configure(queue=[1, 2])
    assert first.start(devices="0").returncode == 0
    r = first.run("stop", "--json")
    assert r.returncode == 0, r.stderr
    out = _json(r)
    assert out["queue"] == {"running": 1, "pending": 2} and out["discarded"] == 3 and out["kept"] is False
    assert not (first.root / queuesave.KEPT_NAME).exists()


def test_stop_keep_queue_then_start_queues_every_prompt_again(two):
    first, second = two
    first.configure(boots=[{"queue": [1, 2]}])  # the first boot of the tree runs r0, with p0 and p1 pending
    assert first.start(devices="0").returncode == 0
    assert second.start(devices="1").returncode == 0
    r = first.run("stop", "--keep-queue", "--port", str(first.port))
    assert r.returncode == 0, r.stderr
    assert "kept 2 pending and 1 running prompt(s)" in r.stdout
    kept = queuesave.load(first.root, queuesave.KEPT_NAME)
    assert [i.prompt_id for i in kept.running + kept.pending] == ["r0", "p0", "p1"]
    # the next start of the tree is on the first server's port: it takes the first folder back, with its queue
    r = first.start("--json", devices="0")
    assert r.returncode == 0, r.stderr
    started = _json(r)
    assert started["runtime_root"] == str(first.root)
    assert started["restored"]["restored"] == ["r0", "p0", "p1"]  # the running one first, then in order
    posted = [json.loads(ln) for ln in (first.path / "standin-prompts.jsonl").read_text().splitlines()]
    assert [(p["boot"], p["prompt_id"]) for p in posted] == [(2, "r0"), (2, "p0"), (2, "p1")]
    assert not (first.root / queuesave.KEPT_NAME).exists()  # queued once: a later start posts nothing again
    assert (first.root / queuesave.RESTORED_NAME).is_file()


def test_a_start_picks_the_folder_of_its_port_while_another_port_holds_the_first(two):
    first, second = two
    first.configure(boots=[{}, {"queue": [0, 1]}])
    assert first.start(devices="0").returncode == 0
    assert second.start(devices="1").returncode == 0
    assert first.run("stop", "--keep-queue", "--port", str(second.port)).returncode == 0
    assert first.run("stop").returncode == 0
    # the first folder is free now, but the second port's folder holds its kept queue: it goes back there
    r = second.start("--json", devices="1")
    assert r.returncode == 0, r.stderr
    assert _json(r)["runtime_root"] == str(first.root / "servers" / str(second.port))
    assert _json(r)["restored"]["restored"] == ["p0"]


def test_servers_share_the_tree_lock_which_install_holds_alone(tmp_path):
    """A start holds the tree lock shared (another server's start goes on meanwhile); install and revert take it
    alone, so they still wait for, and exclude, every server's start and stop."""
    import subprocess
    import sys

    from h3kit import locks

    home = tmp_path / "comfy"
    home.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path\n"
                               "from h3kit import locks\n"
                               "with locks.tree_lock(Path(sys.argv[1]), shared=True):\n"
                               "    print('held', flush=True); time.sleep(60)", str(home)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with locks.tree_lock(home, wait=0, shared=True):  # a second server's start
            pass
        with pytest.raises(locks.TreeBusy) as e:  # install
            with locks.tree_lock(home, wait=0):
                pass
        assert str(holder.pid) in e.value.message
    finally:
        holder.kill()
        holder.wait()
    with locks.tree_lock(home, wait=0, shared=True):
        with pytest.raises(RuntimeError):  # an exclusive hold never hides inside a shared one of this process
            with locks.tree_lock(home):
                pass
    with locks.tree_lock(home, wait=0):  # while demo holds it alone, the start it runs takes it again
        with locks.tree_lock(home, shared=True):
            pass


def test_keep_queue_on_a_server_that_no_longer_answers_keeps_watchs_last_save(two):
    """systemd's ExecStop must not fail on a wedged server: it is stopped, keeping what watch saved of it."""
    first, _ = two
    first.configure(queue_broken=True)
    assert first.start(devices="0").returncode == 0
    r = first.run("stop", "--keep-queue")  # no save: stopped all the same, and said
    assert r.returncode == 0 and "stopped" in r.stdout and "nothing kept" in r.stdout, r.stdout + r.stderr
    assert first.start(devices="0").returncode == 0
    rec = first.record()
    item = queuesave.Item(1, "p-saved", {"1": {}}, {"client_id": "c"})
    queuesave.save(first.root, queuesave.Saved(rec["pid"], rec["create_time"], first.url, "then", [], [item]))
    r = first.run("stop", "--keep-queue", "--json")
    assert r.returncode == 0, r.stderr
    assert _json(r)["kept"] and _json(r)["queue"] == {"running": 0, "pending": 1}
    assert [i.prompt_id for i in queuesave.load(first.root, queuesave.KEPT_NAME).pending] == ["p-saved"]


def test_a_bad_hccl_base_port_is_refused_before_anything_starts(tmp_path):
    home = StandinHome(tmp_path / "comfy", free_port(8410, 8469))
    env = dict(os.environ, **{group.HCCL_PORT_ENV: "65000"})
    r = home.run("start", "--devices", "4", "--device-type", "cpu", "--transport", "process", "--port", home.port,
                 env=env)
    assert r.returncode == 2 and "bad_hccl_port" in r.stderr and group.HCCL_PORT_ENV in r.stderr, r.stderr
    assert home.boots() == [] and not (home.root / "server.json").exists()


def test_keep_queue_after_a_crash_keeps_watchs_last_save(two):
    first, _ = two
    assert first.start(devices="0").returncode == 0
    rec = first.record()
    item = queuesave.Item(1, "p-crash", {"1": {}}, {"client_id": "c"})
    queuesave.save(first.root, queuesave.Saved(rec["pid"], rec["create_time"], first.url, "then", [], [item]))
    os.kill(rec["pid"], 9)
    wait_for(lambda: http_status(f"{first.url}/system_stats") is None, 30, "the server to die")
    r = first.run("stop", "--keep-queue")
    assert r.returncode == 0 and "not running" in r.stdout and "kept 1 pending" in r.stdout, r.stdout + r.stderr
    r = first.start("--json", devices="0")
    assert r.returncode == 0 and _json(r)["restored"]["restored"] == ["p-crash"], r.stdout + r.stderr
