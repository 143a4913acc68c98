"""Run a script inside the ComfyUI interpreter and read the JSON report it writes (parity, calibrate).

The worker runs in its own session with a deadline: on expiry, Ctrl-C or SIGTERM that session (the worker,
its rank threads and any rank processes it spawned) is killed, and nothing else. Its output goes to a log
whose tail is attached to every failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

from h3kit import cliutil, paths, testhooks
from h3kit.errors import H3kitError, UsageError


def run(cmd: list, *, timeout: float, what: str, timeout_code: str, env: dict | None = None) -> dict:
    """Run `cmd + ["--out", FILE]`; returns the JSON it wrote, with "log_tail" added.

    Raises UsageError when the interpreter cannot be started, H3kitError with `timeout_code` when the
    worker outlives `timeout`, and with "worker_failed" when it exits without a report. `what` names the
    worker in messages ("the parity worker").
    """
    env = dict(os.environ if env is None else env)
    # h3kit importable in the worker and the ranks it starts, and nothing else from where h3kit is installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(paths.import_root()), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="h3kit-worker-") as tmp:
        out, log = Path(tmp) / "report.json", Path(tmp) / "worker.log"
        with open(log, "wb") as logf:
            # Ctrl-C or SIGTERM while the worker is being started waits until `proc` exists and the cleanup
            # below is in place: else it could interrupt between the two, and the worker, in its own session,
            # would outlive h3kit holding the devices. The worker starts with the signals as they were.
            held = cliutil.hold_signals()
            try:
                proc = subprocess.Popen([*cmd, "--out", str(out)], stdout=logf, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True, env=env,
                                        preexec_fn=None if held is None else lambda: cliutil.release_signals(held))
            except BaseException as e:  # no worker: nothing to clean up, the signals as they were
                cliutil.release_signals(held)
                if isinstance(e, OSError):
                    raise UsageError(f"cannot run {cmd[0]}: {e}", code="bad_python",
                                     hint="pass --python with the interpreter that runs ComfyUI") from e
                raise
            try:
                testhooks.point("worker-started")
                cliutil.release_signals(held)  # a signal that came meanwhile is raised here, inside the cleanup's try
                rc = proc.wait(timeout=timeout)
            except BaseException as e:  # a timeout, Ctrl-C or SIGTERM: the worker holds the devices
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # our own session only
                except ProcessLookupError:
                    pass
                proc.wait()
                cliutil.release_signals(held)  # (again, if what failed came before the release: harmless otherwise)
                if not isinstance(e, subprocess.TimeoutExpired):
                    raise
                raise H3kitError(f"{what} did not finish within {timeout:g} s and was killed",
                                 code=timeout_code,
                                 details={"log_tail": tail(log)},
                                 hint="a device or collective hung: run with a larger --timeout only if it was merely slow")
        try:
            report = json.loads(out.read_text())
        except (OSError, ValueError):
            raise H3kitError(f"{what} exited with {rc} without a report", code="worker_failed",
                             details={"log_tail": tail(log)}, hint=f"read the log above; the interpreter was {cmd[0]}")
        report["log_tail"] = tail(log)
        return report


def tail(path: Path, lines: int = 40) -> list:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []
