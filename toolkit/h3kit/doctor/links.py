"""`h3kit doctor`'s check of the collectives' links (issue 45): HCCL's timeouts as the workers will take them, and the
interface HCCL uses between hosts (HCCL_IF_IP / HCCL_SOCKET_IFNAME). The rules are comfy/multinpu_links.py's (the
workers apply them; this interpreter cannot import them without torch): tests/test_doctor_links.py pins the copies.
Unmeasured on hardware."""

from __future__ import annotations

import ipaddress

import psutil

from h3kit.doctor.base import Doctor
from h3kit.group import NPU_GROUP_TIMEOUT

EXEC_RANGE = (68, 17340)      # comfy.multinpu_links.EXEC_RANGE
CONNECT_RANGE = (120, 7200)   # comfy.multinpu_links.CONNECT_RANGE
CONNECT_SLACK = 20            # comfy.multinpu_links.CONNECT_SLACK
GROUP_TIMEOUT = NPU_GROUP_TIMEOUT  # what `h3kit start` gives an npu group unless --group-timeout says otherwise


def _seconds(d: Doctor, name: str, lo: int, hi: int, why: str):
    value = d.env.get(name)
    if not value:
        return None
    try:
        n = int(value.strip())
    except ValueError:
        n = None
    if n is None or not lo <= n <= hi:
        d.add("hccl", "error", f"{name}={value!r}: {why}; the service refuses to start with it",
              f"a whole number of seconds from {lo} to {hi}, or unset it (h3kit sets it from the group timeout)")
        return False
    return n


def check_timeouts(d: Doctor):
    ex = _seconds(d, "HCCL_EXEC_TIMEOUT", *EXEC_RANGE, "HCCL takes 68 to 17340 s, and on Atlas A2 a value under 68 "
                  "rounds down to 0, which turns HCCL's own timeout off")
    conn = _seconds(d, "HCCL_CONNECT_TIMEOUT", *CONNECT_RANGE, "HCCL takes 120 to 7200 s")
    if ex is False or conn is False:
        return
    chosen = ex is not None or conn is not None
    ex = (ex if ex is not None else (int(GROUP_TIMEOUT) - 1) // 68 * 68) // 68 * 68
    conn = conn if conn is not None else max(CONNECT_RANGE[0], min(600, ex - CONNECT_SLACK))
    if not chosen:
        d.add("hccl", "ok", "HCCL_EXEC_TIMEOUT and HCCL_CONNECT_TIMEOUT unset: the workers set them in order below the "
              f"group timeout ({GROUP_TIMEOUT:g} s, h3kit start's default on npu: exec {ex} s, connect {conn} s; "
              "docs/multinpu.md, 'Links, buffers and the HCCL settings in force')")
        return
    if not conn + CONNECT_SLACK <= ex < GROUP_TIMEOUT:
        d.add("hccl", "error", f"HCCL_CONNECT_TIMEOUT {conn} s (+{CONNECT_SLACK}), HCCL_EXEC_TIMEOUT {ex} s (HCCL rounds "
              f"to a multiple of 68) and the group timeout {GROUP_TIMEOUT:g} s are out of order",
              f"connect + {CONNECT_SLACK} <= exec < group timeout (h3kit start --group-timeout), or unset both")
    else:
        d.add("hccl", "ok", f"HCCL_CONNECT_TIMEOUT {conn} s, HCCL_EXEC_TIMEOUT {ex} s: in order below the group "
              f"timeout ({GROUP_TIMEOUT:g} s)")


def _addresses() -> dict:
    """{interface: [addresses]} of this host."""
    return {name: [a.address.split("%")[0] for a in addrs if a.family.name in ("AF_INET", "AF_INET6")]
            for name, addrs in psutil.net_if_addrs().items()}


def check_interface(d: Doctor, nnodes: int, addresses: dict = None):
    """Several hosts: HCCL's host-side sockets need the interface the hosts share, named by HCCL_IF_IP (an address of
    this host) or HCCL_SOCKET_IFNAME (an interface of this host, or a comma list / ^exclusions / =exact as CANN takes
    them: the first plain name is checked)."""
    addresses = _addresses() if addresses is None else addresses
    ip, ifname = d.env.get("HCCL_IF_IP"), d.env.get("HCCL_SOCKET_IFNAME")
    if ip:
        try:
            ipaddress.ip_address(ip)
            known = any(ip in addrs for addrs in addresses.values())
        except ValueError:
            known = False
        if not known:
            d.add("hccl", "error", f"HCCL_IF_IP={ip!r} is not an address of this host",
                  "one of: " + ", ".join(a for addrs in addresses.values() for a in addrs) or "no address found")
            return
        d.add("hccl", "ok", f"HCCL_IF_IP={ip}: an address of this host")
    if ifname:
        names = [n.lstrip("=") for n in ifname.split(",") if n and not n.startswith("^")]
        missing = [n for n in names if not any(i == n or i.startswith(n) for i in addresses)]
        if names and len(missing) == len(names):
            d.add("hccl", "error", f"HCCL_SOCKET_IFNAME={ifname!r}: no such interface on this host",
                  "one of: " + ", ".join(sorted(addresses)))
            return
        d.add("hccl", "ok", f"HCCL_SOCKET_IFNAME={ifname}: present on this host")
    if not ip and not ifname:
        if nnodes > 1:
            d.add("hccl", "error", f"{nnodes} hosts, and neither HCCL_IF_IP nor HCCL_SOCKET_IFNAME is set: HCCL may "
                  "pick an interface the other hosts cannot reach",
                  "export HCCL_SOCKET_IFNAME=<the interface the hosts share> (or HCCL_IF_IP=<this host's address "
                  "on it>) on every host before h3kit start")
        else:
            d.add("hccl", "info", "one host: HCCL_IF_IP / HCCL_SOCKET_IFNAME not needed (set one on every host "
                  "for several)")


def check_links(d: Doctor, nnodes: int = 1):
    if d.kind != "npu":  # HCCL's settings (NCCL on CUDA has its own, NCCL_SOCKET_IFNAME: not checked here)
        return
    check_timeouts(d)
    check_interface(d, nnodes)
