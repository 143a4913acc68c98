"""The running service of a --comfy-home, as check-workflow sees it: its devices, its node types.

The service h3kit started leaves a record at `<runtime-root>/server.json` ({"port", "listen",
"device_type", "devices", "extra_args", ...}; runtime root `<comfy-home>/.h3kit/run` by default). The
devices are what `GET /system_stats` lists, except on a CPU server in simulation mode, where /system_stats
shows the one CPU and the simulated devices are the record's "devices" list. A record whose server does
not answer is stale and says nothing. `requests` is imported only here, only when a record exists.
"""

from __future__ import annotations

import json
import os

CONNECT_TIMEOUT_S = 1.0   # a local server answers at once or not at all
READ_TIMEOUT_S = 10.0     # /object_info is 1.5 MB at the pin


class Service:
    """What a reachable service told us. `devices` None when it could not say."""

    def __init__(self, record: dict, base_url: str, system_stats: dict | None):
        self.record = record
        self.base_url = base_url
        self.system_stats = system_stats

    @property
    def devices(self) -> list[int] | None:
        if self.record.get("device_type") == "cpu":
            devices = self.record.get("devices")
            if isinstance(devices, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in devices):
                return devices
        stats_devices = (self.system_stats or {}).get("devices")
        if isinstance(stats_devices, list):
            return list(range(len(stats_devices)))
        return None

    @property
    def args(self) -> list[str]:
        argv = ((self.system_stats or {}).get("system") or {}).get("argv")
        extra = self.record.get("extra_args")
        out = [str(a) for a in argv] if isinstance(argv, list) else []
        out += [str(a) for a in extra] if isinstance(extra, list) else []
        return out

    def object_info(self) -> dict | None:
        return _get_json(self.base_url + "/object_info")


def runtime_root(comfy_home: str, override: str | None = None) -> str:
    return override or os.path.join(comfy_home, ".h3kit", "run")


def read_record(root: str) -> dict | None:
    path = os.path.join(root, "server.json")
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def base_url(record: dict) -> str | None:
    port = record.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    host = record.get("listen") if isinstance(record.get("listen"), str) else "127.0.0.1"
    host = host.split(",")[0].strip()
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def connect(comfy_home: str, root: str | None = None) -> tuple[Service | None, str]:
    """The running service of this home, or None and why not."""
    rroot = runtime_root(comfy_home, root)
    record = read_record(rroot)
    if record is None:
        return None, f"no service record in {rroot}"
    url = base_url(record)
    if url is None:
        return None, f"the service record in {rroot} has no valid port"
    stats = _get_json(url + "/system_stats")
    if stats is None:
        return None, f"the service recorded in {rroot} does not answer at {url}"
    return Service(record, url, stats), url


def _get_json(url: str):
    import requests

    try:
        response = requests.get(url, timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S))
        if response.status_code != 200:
            return None
        data = response.json()
    except (requests.RequestException, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None
