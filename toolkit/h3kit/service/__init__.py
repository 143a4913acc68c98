"""Run the patched ComfyUI as a service: start, stop, restart and status, with a record on disk.

Layout under the runtime root (`<comfy-home>/.h3kit/run` unless overridden):

    server.json                  the record of the server h3kit started (the contract in docs/service.md)
    service.lock                 held (fcntl.flock) while a command starts or stops the server
    logs/comfyui-<stamp>.log     one file per start: the server's stdout and stderr
    logs/latest                  link to the newest log
    servers/<port>/              the same files for each further server of the tree (servers.py: several servers)

With the process transport (h3kit.group) the server is rank 0 of a process group and starts one worker per
other device; on the other hosts of a group the record names the host's agent instead of ComfyUI, and the
runtime keeps `ranks.json` (every rank's pid, start time, device, alive, joined) beside the record.

The record names the process by pid, start time and command line; every command re-checks all three
(h3kit.proc.verify), and that the process is the ComfyUI server of this tree (its main.py is the tree's,
its interpreter the one h3kit launched), before it trusts the pid. A record that fails the check is
"stale": reported, cleaned up by `stop` and `start`, and never acted on. Every field of a record is
validated when it is read (read_record): a record that is not what h3kit writes is `bad_record`, and
nothing is signalled on its word.

Locks: the tree lock of the ComfyUI home (h3kit.locks) first, then service.lock of the runtime root; every
command that starts or stops the server takes both in that order. After a failed start, or once the server has died, the
record stays behind naming the dead process, so `status` can show the last log's first error and `restart`
can start the same settings again.

This module never imports click; progress goes through an optional `progress(message)` callback.

Where each concern lives: records.py (the layout, server.json and its checks, the settings a server starts with,
service.lock, the constants and errors), process.py (start and stop), health.py (health checks, the wait for a
starting server, status), restart_policy.py (restart, keeping the queue), servers.py (several servers of one tree: their folders, which
one a command means, and what each has of its own). Import them from here: `h3kit.service`
is the interface the commands, supervise and the tests use.
"""

from __future__ import annotations

from h3kit.service.records import (  # noqa: F401
    DEFAULT_GRACE, DEFAULT_LISTEN, DEFAULT_PORT, DEFAULT_START_TIMEOUT, KILL_WAIT, LATEST, LOCK_NAME, LOCK_WAIT,
    LOG_DIR, PORT_WAIT, POLL_ENV, PROGRESS_EVERY, RECORD_FIELDS, RECORD_NAME, RUNTIME_ROOT_ENV, BadRecord, LockBusy,
    NotStarted, PortInUse, Progress, QueueBusy, Record, ServiceError, StartFailed, StartSpec, StopFailed,
    latest_log, read_record, record_path, remove_record, runtime_root, server_argv, server_owner, service_lock,
    write_record)
from h3kit.service.health import check, status, status_code, wait_healthy  # noqa: F401
from h3kit.service.process import (  # noqa: F401
    StartResult, StopResult, child_environment, is_public, require_torch, resolve_python, start, start_locked,
    stop, stop_locked, validate_listen, validated)
from h3kit.service.restart_policy import RestartResult, restart, start_keeping_queue  # noqa: F401
from h3kit.service.servers import (  # noqa: F401
    SERVERS_DIR, DevicesInUse, Entry, SeveralServers, list_servers, pick, server_root, server_roots)
