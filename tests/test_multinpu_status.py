"""`h3kit status` tells the truth about a process group: its exit code (service.status_code) is non-zero while
the group cannot run prompts, whatever the server process itself is doing."""

from __future__ import annotations

import pytest

from h3kit import service


def _st(state="ready", alive=(True, True), joined=(True, True), running=True, world_size=2):
    ranks = [{"rank": r, "alive": a, "joined": j} for r, (a, j) in enumerate(zip(alive, joined))]
    return {"running": running, "group": {"node_rank": 0, "state": state, "error": None, "world_size": world_size,
                                          "ranks": ranks}}


def test_a_ready_group_and_a_plain_server_exit_0():
    assert service.status_code(_st()) == 0
    assert service.status_code({"running": True}) == 0  # the thread transport: no group


def test_a_stopped_server_exits_1():
    assert service.status_code(_st(running=False)) == 1


@pytest.mark.parametrize("st", [_st(state="failed"), _st(state="forming"), _st(state="broken"),
                                _st(alive=(True, False)), _st(joined=(True, False)), _st(world_size=4)],
                         ids=["failed", "forming", "broken", "rank-dead", "rank-not-joined", "ranks-missing"])
def test_a_group_that_cannot_run_prompts_exits_4(st):
    assert service.status_code(st) == 4


def test_doctor_checks_dev_shm_for_the_process_transport():
    from h3kit import doctor
    GB = doctor.GB
    assert doctor.shm_verdict(16 * GB, True)[0] == "ok"
    severity, message, fix = doctor.shm_verdict(64 << 20, True)  # a container's default 64 MB
    assert severity == "error" and "0.1 GB free" in message and "4.5 GB" in message and "--shm-size" in fix
    assert doctor.shm_verdict(3 * GB, True)[0] == "warning"
    assert doctor.shm_verdict(64 << 20, False)[0] == "info"  # one device: nothing goes through it
    assert doctor.shm_verdict(None, True)[0] == "warning"
