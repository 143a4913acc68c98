"""What every check group of `h3kit doctor` shares: a finding, the options, and the `Doctor` a check adds its
findings and facts to."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from h3kit import devices as h3devices
from h3kit.errors import H3kitError

CHECKS = ("interpreter", "torch", "cann", "metrics", "driver", "devices", "memory", "hccl", "tree", "service", "models",
          "disk", "shm", "ram")
GB = 1e9


@dataclass
class Finding:
    check: str
    severity: str
    message: str
    fix: str | None = None
    lines: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        out = {"check": self.check, "severity": self.severity, "message": self.message}
        if self.fix:
            out["fix"] = self.fix
        if self.lines:
            out["lines"] = self.lines
        return out


@dataclass
class Options:
    comfy_home: Path | None = None
    devices: str | None = None
    device_type: str = "auto"
    python: str | None = None
    runtime_root: str | None = None
    verify_hash: bool = False
    nnodes: int = 1



class Doctor:
    """The state of one doctor run: its options, the findings and facts so far, and what earlier checks learnt
    (the devices asked for, the service's status, the model files found) for later ones."""

    def __init__(self, opts: Options):
        self.opts = opts
        self.env = dict(os.environ)
        self.home = Path(opts.comfy_home).expanduser().absolute() if opts.comfy_home else None
        self.kind = h3devices.resolve_device_type(opts.device_type)
        self.findings: list[Finding] = []
        self.facts: dict = {"device_type": self.kind}
        self.requested, self.requested_from = None, None
        self.service = None
        self.found_models: dict = {}

    def add(self, check, severity, message, fix=None, lines=()):
        self.findings.append(Finding(check, severity, message, fix, list(lines)))

    def requested_devices(self):
        if self.opts.devices is not None:
            self.requested, self.requested_from = h3devices.parse_device_list(self.opts.devices), "--devices"
            return
        var = h3devices.VISIBLE_ENV.get(self.kind)
        if self.kind != "cpu" and self.env.get(var):
            try:
                self.requested = h3devices.parse_device_list(self.env[var])
                self.requested_from = f"{var}={self.env[var]}"
            except H3kitError as e:
                self.add("devices", "error", f"{var}={self.env[var]!r} in this shell: {e.message}", e.hint)
