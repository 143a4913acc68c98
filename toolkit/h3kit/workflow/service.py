"""The running service of a --comfy-home, as check-workflow sees it: its devices, its node types.

The server h3kit started is found the way every other h3kit command finds it: the record under the
runtime root (`<comfy-home>/.h3kit/run/server.json` by default, h3kit.service), trusted only when its
process is still the one recorded (pid, start time, command line), and queried through h3kit.health
(standard library, no proxies: a proxy set for downloads must not hide a local server). The devices are
what `GET /system_stats` lists, except on a CPU server in simulation mode, where /system_stats shows the
one CPU and the simulated devices are the record's device list. A service with the process transport runs
one rank per device on every host of its group: the devices are the ranks (the hosts times their devices).
"""

from __future__ import annotations

from h3kit import health
from h3kit import service as h3service
from h3kit.errors import H3kitError

STATS_TIMEOUT_S = 3.0
OBJECT_INFO_TIMEOUT_S = 10.0   # /object_info is 1.5 MB at the pin


class Service:
    """What a reachable service told us. `devices` None when it could not say."""

    def __init__(self, record: h3service.Record, system_stats: dict | None):
        self.record = record
        self.base_url = record.url
        self.system_stats = system_stats

    @property
    def devices(self) -> list[int] | None:
        if self.record.transport == "process":
            return list(range(len(self.record.devices) * self.record.nnodes))
        if self.record.device_type == "cpu":
            return list(self.record.devices)
        stats_devices = (self.system_stats or {}).get("devices")
        if isinstance(stats_devices, list):
            return list(range(len(stats_devices)))
        return None

    @property
    def device_memory(self) -> float | None:
        """GB of the smallest card /system_stats lists (vram_total), or None: a CPU server (its "device" is the
        host's memory, not a card) or no figures."""
        if self.record.device_type == "cpu":
            return None
        totals = [d.get("vram_total") for d in (self.system_stats or {}).get("devices") or [] if isinstance(d, dict)]
        totals = [t for t in totals if isinstance(t, (int, float)) and t > 0]
        return min(totals) / 1e9 if totals else None

    @property
    def args(self) -> list[str]:
        argv = ((self.system_stats or {}).get("system") or {}).get("argv")
        out = [str(a) for a in argv] if isinstance(argv, list) else []
        return out + [str(a) for a in self.record.extra_args]

    def object_info(self) -> dict | None:
        try:
            data = health.request_json(self.base_url + "/object_info", timeout=OBJECT_INFO_TIMEOUT_S)
        except health.HttpError:
            return None
        return data if isinstance(data, dict) else None


def connect(comfy_home: str, root: str | None = None, port: int | None = None) -> tuple[Service | None, str]:
    """The running service of this home (the one on `port` when several run), or None and why not."""
    try:
        rroot = h3service.pick(h3service.runtime_root(comfy_home, root), port, comfy_home)
        record = h3service.read_record(rroot)
    except H3kitError as e:
        return None, e.message
    if record is None:
        return None, f"no service record in {rroot}"
    verdict = record.verify()
    if not verdict.alive:
        return None, f"the service recorded in {rroot} is not running ({verdict.reason})"
    try:
        stats = health.request_json(record.url + "/system_stats", timeout=STATS_TIMEOUT_S)
    except health.HttpError:
        return None, f"the service recorded in {rroot} does not answer at {record.url}"
    return Service(record, stats if isinstance(stats, dict) else None), record.url
