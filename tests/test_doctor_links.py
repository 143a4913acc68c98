"""h3kit doctor's hccl check (issue 45 item 7): HCCL's timeouts as the workers take them, and the interface several
hosts need (toolkit/h3kit/doctor/links.py), with the rules pinned to the workers' copy (comfy/multinpu_links.py)."""

from __future__ import annotations

from pathlib import Path

from h3kit import group
from h3kit.doctor import links as dl
from h3kit.doctor.base import Doctor, Options
from tests.support import requires

ROOT = Path(__file__).resolve().parents[1]
ADDRS = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.5"], "enp1s0f0": ["192.168.1.7"]}


def _doctor(**env):
    d = Doctor(Options(device_type="cpu"))
    d.kind = "npu"
    d.env = {k: v for k, v in env.items()}
    return d


def _findings(d):
    return [(f.severity, f.message) for f in d.findings]


def test_timeouts_unset_are_in_order_and_bad_values_are_errors():
    d = _doctor()
    dl.check_timeouts(d)
    assert _findings(d) == [("ok", "HCCL_EXEC_TIMEOUT and HCCL_CONNECT_TIMEOUT unset: the workers set them in order "
                             "below the group timeout (900 s, h3kit start's default on npu: exec 884 s, connect 600 s; "
                             "docs/multinpu.md, 'Links, buffers and the HCCL settings in force')")]
    for env, words in (({"HCCL_EXEC_TIMEOUT": "30"}, "rounds down to 0"), ({"HCCL_EXEC_TIMEOUT": "x"}, "68 to 17340"),
                       ({"HCCL_CONNECT_TIMEOUT": "900"}, "out of order"),
                       ({"HCCL_CONNECT_TIMEOUT": "60"}, "120 to 7200")):
        d = _doctor(**env)
        dl.check_timeouts(d)
        assert d.findings[0].severity == "error" and words in d.findings[0].message and d.findings[0].fix, env
    d = _doctor(HCCL_EXEC_TIMEOUT="204", HCCL_CONNECT_TIMEOUT="150")
    dl.check_timeouts(d)
    assert d.findings[0].severity == "ok"
    d = _doctor(HCCL_EXEC_TIMEOUT="952")  # 14 x 68: not below the default 900 s group timeout
    dl.check_timeouts(d)
    assert d.findings[0].severity == "error" and "--group-timeout" in d.findings[0].fix


def test_several_hosts_need_the_interface_and_a_wrong_one_is_named():
    d = _doctor()
    dl.check_interface(d, 2, ADDRS)
    assert d.findings[0].severity == "error" and "HCCL_SOCKET_IFNAME" in d.findings[0].fix
    d = _doctor()
    dl.check_interface(d, 1, ADDRS)
    assert d.findings[0].severity == "info"
    d = _doctor(HCCL_IF_IP="10.0.0.9")
    dl.check_interface(d, 2, ADDRS)
    assert d.findings[0].severity == "error" and "10.0.0.5" in d.findings[0].fix
    d = _doctor(HCCL_IF_IP="10.0.0.5")
    dl.check_interface(d, 2, ADDRS)
    assert _findings(d) == [("ok", "HCCL_IF_IP=10.0.0.5: an address of this host")]
    d = _doctor(HCCL_SOCKET_IFNAME="ib0")
    dl.check_interface(d, 2, ADDRS)
    assert d.findings[0].severity == "error" and "eth0" in d.findings[0].fix
    d = _doctor(HCCL_SOCKET_IFNAME="^docker0,enp1s0")  # CANN's forms: exclusions, prefixes
    dl.check_interface(d, 2, ADDRS)
    assert d.findings[0].severity == "ok"


def test_the_rules_are_the_workers():
    requires.module("torch", requires.NO_TORCH_REASON)
    import sys
    sys.path.insert(0, str(ROOT / "patches" / "src"))
    try:
        import comfy.multinpu as mn
        import comfy.multinpu_links as links
    finally:
        sys.path.remove(str(ROOT / "patches" / "src"))
    assert (dl.EXEC_RANGE, dl.CONNECT_RANGE, dl.CONNECT_SLACK) == (links.EXEC_RANGE, links.CONNECT_RANGE,
                                                                  links.CONNECT_SLACK)
    d = _doctor()
    dl.check_timeouts(d)
    t = links.hccl_timeouts(dl.GROUP_TIMEOUT, {})
    assert f"exec {t['HCCL_EXEC_TIMEOUT']} s, connect {t['HCCL_CONNECT_TIMEOUT']} s" in d.findings[0].message
    assert group.DEFAULT_GROUP_TIMEOUT == mn.DEFAULT_TIMEOUT  # threads, cuda and cpu groups: the runtime's own


def test_an_npu_group_gets_hccls_advised_connect_timeout_in_order(tmp_path):
    """Issue 45 item 3: HCCL_CONNECT_TIMEOUT 600 s (torch_npu's advice), below the group timeout and in order with
    HCCL_EXEC_TIMEOUT, as a worker of `h3kit start --device-type npu` takes them: the settings h3kit writes, read as
    the runtime reads them (until 2026-12-06 the group timeout stayed at 300 s and the connect timeout fell to
    252 s). An operator's --group-timeout reaches the workers the same way."""
    requires.module("torch", requires.NO_TORCH_REASON)
    import json
    import sys
    sys.path.insert(0, str(ROOT / "patches" / "src"))
    try:
        import comfy.multinpu_links as links
        import comfy.multinpu_wire as wire
    finally:
        sys.path.remove(str(ROOT / "patches" / "src"))
    for asked, timeout, connect, exec_s in ((None, 900.0, 600, 884), (1800.0, 1800.0, 600, 1768),
                                            (300.0, 300.0, 252, 272)):
        settings = group.resolve("npu", "process", group_timeout=asked)
        env = group.environment(settings, "npu", [0, 1], tmp_path, "0" * 64, [])
        spec = wire.GroupSpec.from_json(env[group.GROUP_ENV])
        assert spec.timeout == timeout
        hccl = links.hccl_environment(spec, 1)
        assert (int(hccl["HCCL_CONNECT_TIMEOUT"]), int(hccl["HCCL_EXEC_TIMEOUT"])) == (connect, exec_s), asked
        assert int(hccl["HCCL_CONNECT_TIMEOUT"]) + links.CONNECT_SLACK <= int(hccl["HCCL_EXEC_TIMEOUT"]) < spec.timeout
    assert json.loads(group.environment(group.resolve("cuda", "process"), "cuda", [0], tmp_path, "0" * 64,
                                        [])[group.GROUP_ENV])["timeout"] == group.DEFAULT_GROUP_TIMEOUT


def test_only_npu_gets_the_hccl_check():
    for kind, found in (("npu", True), ("cuda", False), ("cpu", False)):
        d = _doctor(HCCL_EXEC_TIMEOUT="30")
        d.kind = kind
        dl.check_links(d, 2)
        assert bool(d.findings) is found, kind
