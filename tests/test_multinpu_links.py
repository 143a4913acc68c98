"""Every link at join, transfers sized for HCCL (issue 45 items 3 and 7; comfy/multinpu_links.py). Unmeasured on
hardware: on gloo the pairs and groups are recorded as torch.distributed is called; HCCL (torch_npu 7.1.0 on) and
NCCL make a send/recv pair's communicator at its first use, a group's at its first collective."""

from __future__ import annotations

import resource
import subprocess
import sys
import types

import pytest

from tests.support import requires

torch = requires.torch_module()
from tests.test_multinpu_process import _env, drive  # noqa: E402

import comfy.multinpu_links as links  # noqa: E402
import comfy.multinpu_wire as wire  # noqa: E402


def test_a_prompt_forms_no_link_the_join_did_not(tmp_path):
    """3 ranks (a middle one has both relay neighbours). The join warms every collective and the programs' pairs on
    both groups; a prompt running the programs' patterns (Ulysses all-to-all, the DiT's last gather, the VAE's chunks
    to rank 0, the text encoder's relays r -> r+1, its broadcast and outputs, the side group's gathers) then forms no
    pair and no group on any rank. Before (the join ran one all_reduce per group), every pair formed in the prompt."""
    r = drive(tmp_path, "links", "--world", 3)
    assert r["prompt"]["ok"], r["prompt"]
    rep = r["report"]["value"]
    assert [c[0] for c in rep["counts"]] == [0, 0, 0], f"pairs formed inside the prompt: {rep['pairs']}"
    assert [c[1] for c in rep["counts"]] == [0, 0, 0], f"groups formed inside the prompt: {rep['groups']}"
    assert [name for name, _ in rep["groups"]] == ["init_process_group", "new_group"]
    mine = sorted((a, b) for group, a, b, cmd in rep["pairs"] if group == "main" and cmd is None)
    assert mine == [tuple(k) for k in links.pair_communicators(3)[0]] == [(0, 1), (0, 2)]
    assert [c[2] for c in rep["counts"]] == [len(links.pair_communicators(3)[k]) for k in range(3)] == [2, 2, 2]
    env = rep["env"]
    assert env["HCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert int(env["HCCL_CONNECT_TIMEOUT"]) == 120 and int(env["HCCL_EXEC_TIMEOUT"]) == 68  # a 20 s test group


def test_program_pairs_and_the_communicators_they_make():
    assert links.program_pairs(1) == []
    assert links.program_pairs(2) == [(0, 1), (1, 0)]
    per = links.pair_communicators(8)
    assert len(per[0]) == 7 and len(per[7]) == 2 and all(len(per[r]) == 3 for r in range(2, 7)) and len(per[1]) == 2


def test_hccl_timeouts_in_order_and_refusals(monkeypatch):
    assert links.hccl_timeouts(300, {}) == {"HCCL_EXEC_TIMEOUT": 272, "HCCL_CONNECT_TIMEOUT": 252}
    assert links.hccl_timeouts(900, {}) == {"HCCL_EXEC_TIMEOUT": 884, "HCCL_CONNECT_TIMEOUT": 600}
    t = links.hccl_timeouts(3600, {})
    assert t["HCCL_CONNECT_TIMEOUT"] == 600 and t["HCCL_CONNECT_TIMEOUT"] + 20 <= t["HCCL_EXEC_TIMEOUT"] < 3600
    with pytest.raises(wire.GroupError, match=r"HCCL_EXEC_TIMEOUT='30' is refused: .*rounds down to 0.*Fix: "):
        links.hccl_timeouts(300, {"HCCL_EXEC_TIMEOUT": "30"})
    with pytest.raises(wire.GroupError, match="HCCL_EXEC_TIMEOUT='abc' is refused"):
        links.hccl_timeouts(300, {"HCCL_EXEC_TIMEOUT": "abc"})
    with pytest.raises(wire.GroupError, match="out of order"):
        links.hccl_timeouts(300, {"HCCL_CONNECT_TIMEOUT": "600"})  # its real wait 620 s past the exec and group's
    with pytest.raises(wire.GroupError, match="out of order"):
        links.hccl_timeouts(300, {"HCCL_EXEC_TIMEOUT": "1800"})
    assert links.hccl_timeouts(400, {"HCCL_EXEC_TIMEOUT": "300"}) == {"HCCL_EXEC_TIMEOUT": 272, "HCCL_CONNECT_TIMEOUT": 252}
    with pytest.raises(wire.GroupError, match="out of order"):  # 200 rounds down to 136: no room for 120 + 20
        links.hccl_timeouts(300, {"HCCL_EXEC_TIMEOUT": "200"})
    # the driver refuses at start (wire.check_timeouts), naming the setting
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "67")
    with pytest.raises(wire.GroupError, match="HCCL_EXEC_TIMEOUT='67'"):
        wire.check_timeouts(wire.GroupSpec(device_type="npu", timeout=300))


def test_group_buffer_options_only_where_the_backend_takes_them(monkeypatch):
    assert links.buffer_sizes({}) == {"group": None, "side": None}
    assert links.buffer_sizes({links.BUFFSIZE_ENV: "640, 1400"}) == {"group": 640, "side": 1400}
    assert links.buffer_sizes({links.BUFFSIZE_ENV: "700"}) == {"group": 700, "side": 700}
    with pytest.raises(wire.GroupError, match="H3KIT_HCCL_BUFFSIZE='lots' is refused"):
        links.buffer_sizes({links.BUFFSIZE_ENV: "lots"})
    assert links.group_options("gloo", 640) is None and links.group_options("nccl", 640) is None

    class Options:
        hccl_config = None
    fake = types.ModuleType("torch_npu")
    fake._C = types.SimpleNamespace(_distributed_c10d=types.SimpleNamespace(
        ProcessGroupHCCL=types.SimpleNamespace(Options=Options)))
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    opts = links.group_options("hccl", 640)
    assert isinstance(opts, Options) and opts.hccl_config == {"hccl_buffer_size": 640}
    assert links.group_options("hccl", None) is None


def test_core_dumps_off_unless_asked():
    code = ("import resource, comfy.multinpu_links as l, os; r = l.limit_core_dumps(); "
            "print(r, resource.getrlimit(resource.RLIMIT_CORE)[0])")
    env = _env()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "0"]
    env[links.CORE_ENV] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == "False" and int(out.split()[1]) == resource.getrlimit(resource.RLIMIT_CORE)[0]


def test_a_replacement_waits_for_its_devices_memory():
    """A scripted mem_get_info: the predecessor's memory comes back on the fourth read; the replacement starts then.
    Never back: it goes on after the bound, saying so."""
    now = [0.0]
    reads = iter([(10, 100), (20, 100), (40, 100), (80, 100), (90, 100)])
    out = links.wait_for_memory(lambda: next(reads), {}, sleep=lambda s: now.__setitem__(0, now[0] + s),
                                clock=lambda: now[0])
    assert out == {"waited": 1.5, "free": 80, "total": 100, "ok": True}
    now[0] = 0.0
    out = links.wait_for_memory(lambda: (10, 100), {links.MEMORY_WAIT_ENV: "5"},
                                sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0])
    assert out["ok"] is False and out["waited"] == 5.0
    assert links.before_device(torch.device("cpu"), {links.CORE_ENV: "1", links.REPLACEMENT_ENV: "1"}) == \
        {"core_dumps_off": False}, "no reader on the CPU: no wait"


def test_one_rank_warms_only_its_all_reduce():
    class One:
        world_size, rank, device = 1, 0, torch.device("cpu")

        def all_reduce(self, x):
            return x
    comm = One()
    assert links.warm(comm, links.program_pairs(1)) == ["all_reduce"] and comm.warmed_pairs == set()
