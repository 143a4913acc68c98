"""start, stop, restart, status, logs, watch: the click layer over h3kit.service and h3kit.supervise.

Exit codes: 0 done (and `start` when our server already runs on that port; `status` when it runs),
1 the operation failed (or `status`: not running), 2 bad input. Progress goes to stderr.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from h3kit import devices as h3devices
from h3kit import group, logscan, service, supervise
from h3kit.cliutil import comfy_home_option, emit_json, err, handle_errors, json_option
from h3kit.errors import NotAComfyTree

runtime_root_option = click.option(
    "--runtime-root", metavar="DIR", envvar=service.RUNTIME_ROOT_ENV, type=click.Path(),
    help=f"Where the record, lock and logs live (env {service.RUNTIME_ROOT_ENV}; "
         "default <comfy-home>/.h3kit/run).")
grace_option = click.option("--grace", type=click.FloatRange(min=0), default=service.DEFAULT_GRACE,
                            show_default=True, metavar="S", help="Seconds between SIGTERM and SIGKILL.")
port_option = click.option(
    "--port", type=click.IntRange(1, 65535), default=None, metavar="PORT",
    help="The server of this tree on PORT (needed when several of its servers run; h3kit status lists them).")
timeout_option = click.option("--timeout", type=click.FloatRange(min=1), default=service.DEFAULT_START_TIMEOUT,
                              show_default=True, metavar="S", help="Seconds to wait for the server to be healthy.")


def _progress(message: str) -> None:
    err(f"h3kit: {message}")


def _gib(n) -> str:
    return f"{n / 1024 ** 3:.1f} GiB" if isinstance(n, (int, float)) else "?"


def _device_lines(devs: list[dict]) -> list[str]:
    return [f"  {d.get('name')}: {_gib(d.get('vram_total'))} total, {_gib(d.get('vram_free'))} free"
            for d in devs]


def _rank_lines(ranks: list[dict]) -> list[str]:
    return [f"  rank {r.get('rank')}: pid {r.get('pid')} on {r.get('host')} {r.get('device')}, "
            f"{'alive' if r.get('alive') else 'NOT ALIVE'}, {'joined' if r.get('joined') else 'not joined'}"
            + (f", {r.get('restarts')} restart(s) (last: {r.get('last_exit')})" if r.get("restarts") else "")
            for r in ranks]


def _error_lines(blk: dict, title: str, max_lines: int = 12) -> list[str]:
    kind = "OUT OF MEMORY" if blk["kind"] == "oom" else "error"
    out = [f"{title} ({kind}, log line {blk['line']}): {blk['summary']}"]
    lines = blk["lines"]
    out += ["  | " + ln for ln in lines[:max_lines]]
    if len(lines) > max_lines:
        out.append(f"  | ... {len(lines) - max_lines} more line(s): h3kit logs --errors")
    return out


@click.command()
@comfy_home_option()
@click.option("--devices", required=True, metavar="LIST",
              help="Device ids of this host, comma-separated, ascending, no spaces: 1, 2, 4 or 8 of them (e.g. 0,1,2,3).")
@click.option("--device-type", type=click.Choice(("auto",) + h3devices.DEVICE_TYPES), default="auto",
              show_default=True, help="auto picks npu, then cuda, then cpu.")
@click.option("--port", type=click.IntRange(1, 65535), default=service.DEFAULT_PORT, show_default=True,
              help="Port to listen on.")
@click.option("--listen", default=service.DEFAULT_LISTEN, show_default=True, metavar="IP",
              help="Address to listen on. 0.0.0.0 exposes ComfyUI, which has no authentication.")
@runtime_root_option
@click.option("--python", metavar="PY", type=click.Path(dir_okay=False),
              help="Interpreter for ComfyUI (default: the one install recorded).")
@click.option("--transport", type=click.Choice(("auto",) + group.TRANSPORTS), default="auto", show_default=True,
              help="process: one process per device in a torch.distributed group (hccl, nccl, gloo on cpu); "
                   "threads: one process, a thread per device. auto: process on npu and cuda, threads on cpu.")
@click.option("--nnodes", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Hosts in the group (process transport); every host runs h3kit start with the same settings.")
@click.option("--node-rank", type=click.IntRange(0, 63), default=0, show_default=True,
              help="This host's number, 0 .. nnodes-1; node 0 runs ComfyUI, the others run the group's agent.")
@click.option("--master-addr", default="127.0.0.1", show_default=True, metavar="IP",
              help="Node 0's address for the group's rendezvous (the loopback on one host).")
@click.option("--master-port", type=click.IntRange(0, 65535), default=0, show_default=True, metavar="PORT",
              help="The rendezvous port on node 0 (0: a free one, one host only).")
@click.option("--join-timeout", type=click.FloatRange(min=1), default=group.DEFAULT_JOIN_TIMEOUT,
              show_default=True, metavar="S", help="Seconds for every rank of the group to join before start fails.")
@click.option("--group-timeout", type=float, default=None, metavar="S",
              help=f"The process group's collective timeout, behind h3kit's own detectors (default "
                   f"{group.NPU_GROUP_TIMEOUT:g} s on npu, where HCCL_CONNECT_TIMEOUT 600 s stays in order below it; "
                   f"{group.DEFAULT_GROUP_TIMEOUT:g} s elsewhere).")
@timeout_option
@json_option
@click.argument("extra", nargs=-1, type=click.UNPROCESSED, metavar="[-- EXTRA_COMFY_ARGS]")
@handle_errors
def start(comfy_home, devices, device_type, port, listen, runtime_root, python, transport, nnodes, node_rank,
          master_addr, master_port, join_timeout, group_timeout, timeout, as_json, extra):
    """Start the ComfyUI server on the given devices and wait until healthy.

    Sets ASCEND_RT_VISIBLE_DEVICES (npu), CUDA_VISIBLE_DEVICES (cuda) or, on cpu, runs with --cpu and
    H3KIT_SIM_DEVICES=<count>. Returns once GET /system_stats answers (listing every device on npu/cuda)
    and, with the process transport, every rank of the group is alive and joined. On node 1.. of a
    multi-host group it starts that host's agent (its workers) instead of ComfyUI and returns once they
    joined. Exits 0 without a second server when h3kit's own server already runs on that port.
    """
    ids = h3devices.parse_device_list(devices)
    kind = h3devices.resolve_device_type(device_type)
    settings = group.resolve(kind, transport, nnodes, node_rank, master_addr, master_port, join_timeout,
                             group_timeout)
    listen = service.validate_listen(listen)
    if service.is_public(listen):
        err(f"h3kit: warning: listening on {listen}: ComfyUI has no authentication, anyone who reaches "
            f"port {port} can run prompts and read outputs")
    root = service.runtime_root(comfy_home, runtime_root)
    spec = service.StartSpec(comfy_home=comfy_home, devices=ids, device_type=kind, port=port, listen=listen,
                             python=python, extra_args=list(extra), group=settings)
    what = (f"the agent of node {settings.node_rank} of {settings.nnodes}" if settings.is_agent else
            f"ComfyUI on {kind} devices {h3devices.format_device_list(ids)}, port {port}")
    how = f", {settings.transport} transport" + (f", node 0 of {settings.nnodes}" if settings.nnodes > 1 else "")
    try:  # "starting ..." is said once every check has passed: a refusal is never preceded by it
        res = service.start(root, spec, timeout=timeout, progress=_progress, announce=f"starting {what}{how}")
    except service.StartFailed as e:
        tail = (e.details or {}).get("log_tail") or []
        if tail and not as_json:
            err(f"h3kit: last lines of {e.details.get('log')}:")
            for line in tail:
                err(f"  | {line}")
        raise
    rec = res.record
    ranks = group.ranks_view(res.root, rec.pid, rec.node_rank, rec.comfy_home)["ranks"] if rec.group.is_process else []
    if as_json:
        emit_json({"ok": True, "already_running": res.already_running, "pid": rec.pid, "url": rec.url,
                   "port": rec.port, "device_type": rec.device_type, "devices": res.devices, "health": res.health,
                   "seconds": round(res.seconds, 2), "log": rec.log, "stale_record": res.stale,
                   "group": rec.group.as_dict(), "ranks": ranks, "runtime_root": str(res.root),
                   "restored": res.restored.to_dict() if res.restored else None})
        return
    where = f"node {rec.node_rank} agent" if rec.group.is_agent else rec.url
    if res.already_running:
        click.echo(f"already running: pid {rec.pid} on {where} (started {rec.started_at}, {res.health}); "
                   "nothing started")
    else:
        click.echo(f"started: pid {rec.pid} on {where}, healthy after {res.seconds:.1f} s")
    click.echo(f"log: {rec.log}")
    for line in _device_lines(res.devices) + _rank_lines(ranks) + (res.restored.lines() if res.restored else []):
        click.echo(line)


@click.command()
@comfy_home_option(required=False)
@runtime_root_option
@port_option
@click.option("--keep-queue", is_flag=True,
              help="Keep the pending prompts, and the running one, for the next h3kit start of this server, which "
                   "queues them again (a planned stop: systemctl restart, an upgrade, a reboot).")
@grace_option
@json_option
@handle_errors
def stop(comfy_home, runtime_root, port, keep_queue, grace, as_json):
    """Stop a server h3kit started.

    Only the recorded process is signalled, after checking its start time and command line: SIGTERM to
    its process group, SIGKILL after --grace seconds. Returns when the port is free. A stale record is
    removed without signalling anything. Without --keep-queue its queue is discarded, and counted.
    """
    root = service.pick(service.runtime_root(comfy_home, runtime_root), port, comfy_home)
    res = service.stop(root, grace=grace, progress=_progress, comfy_home=comfy_home, keep_queue=keep_queue)
    queue = dict(zip(("running", "pending"), res.queue)) if res.queue else None
    if as_json:
        emit_json({"ok": True, "stopped": res.stopped, "pid": res.pid, "signals": res.signals,
                   "seconds": round(res.seconds, 2), "note": res.note, "queue": queue, "kept": res.kept,
                   "discarded": 0 if res.kept or not queue else queue["running"] + queue["pending"]})
    elif res.stopped:
        click.echo(f"stopped: pid {res.pid} ({', then '.join(res.signals)}) in {res.seconds:.1f} s; port free")
        click.echo(_queue_line(queue, res.kept, keep_queue))
    else:
        click.echo(f"not running: {res.note}")
        if res.kept:  # a server that died: what watch last saved of it is kept
            click.echo(_queue_line(queue, res.kept, keep_queue) + " (as watch last saved it)")


def _queue_line(queue: dict | None, kept: bool, keep_queue: bool) -> str:
    if queue is None:
        return ("queue: unknown (the server did not answer GET /queue" +
                (", and watch saved none of it): nothing kept" if keep_queue else ")"))
    what = f"{queue['pending']} pending and {queue['running']} running prompt(s)"
    if kept:
        return f"queue: kept {what}; the next h3kit start of this server queues them again, the running one first"
    if not queue["pending"] and not queue["running"]:
        return "queue: empty, nothing discarded"
    return f"queue: discarded {what} (h3kit stop --keep-queue keeps them for the next start)"


requeue_running_option = click.option(
    "--requeue-running", is_flag=True,
    help="Queue the prompt that was running again, first (it may be the one that made the server fail).")


@click.command()
@comfy_home_option(required=False)
@runtime_root_option
@port_option
@click.option("--force", is_flag=True, help="Restart even while a prompt runs (it is dropped; pending ones are kept).")
@requeue_running_option
@grace_option
@timeout_option
@json_option
@handle_errors
def restart(comfy_home, runtime_root, port, force, requeue_running, grace, timeout, as_json):
    """Restart the server (after an OOM, say) with the same settings, keeping its queue.

    Saves the pending prompts (GET /queue), shows the first error of the previous run's log, stops the
    server (if it still runs), starts it again, waits until healthy and queues the saved prompts again, in
    order, with their client ids. Refuses while a prompt runs unless --requeue-running or --force. After a
    crash, the last save of that server (watch refreshes it every tick) is restored.
    """
    root = service.pick(service.runtime_root(comfy_home, runtime_root), port, comfy_home)
    res = service.restart(root, force=force, requeue_running=requeue_running, grace=grace, timeout=timeout,
                          progress=_progress, comfy_home=comfy_home)
    phases = {k: round(v, 2) for k, v in res.phases.items()}
    if as_json:
        emit_json({"ok": True, "previous_pid": res.previous_pid, "was_running": res.was_running,
                   "pid": res.start.record.pid, "url": res.start.record.url,
                   "queue": dict(zip(("running", "pending"), res.queue)) if res.queue else None,
                   "restored": res.restored.to_dict() if res.restored else None,
                   "previous_error": res.previous_error, "phases": phases, "log": res.start.record.log})
        return
    if res.previous_error:
        for line in _error_lines(res.previous_error, "previous run's first error"):
            click.echo(line)
    else:
        click.echo("previous run's log shows no error")
    was = "was running" if res.was_running else "was not running"
    click.echo(f"restarted: pid {res.previous_pid} ({was}) -> {res.start.record.pid} on {res.start.record.url}")
    for line in res.restored.lines() if res.restored else ["queue: empty or unknown, nothing to restore"]:
        click.echo(line)
    click.echo("phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))


@click.command()
@comfy_home_option(required=False)
@runtime_root_option
@port_option
@json_option
@handle_errors
def status(comfy_home, runtime_root, port, as_json):
    """Show whether the tree's servers run, their devices and their queues.

    With one server (or --port), exits 0 when the recorded process runs, 1 when it does not, 4 when it runs
    with the process transport but its group cannot run prompts now (failed, re-forming, a rank down). With
    several, lists each (--json: {"servers": [...]}) and exits with the worst of their codes.
    """
    if comfy_home and not (Path(comfy_home) / "main.py").is_file():
        raise NotAComfyTree(Path(comfy_home).expanduser().absolute())  # as every other command says it
    tree = service.runtime_root(comfy_home, runtime_root)
    entries = service.list_servers(tree, comfy_home) if port is None else []
    roots = [e.root for e in entries] if len(entries) > 1 else [service.pick(tree, port, comfy_home)]
    states = [service.status(root, comfy_home=comfy_home) for root in roots]
    codes = [service.status_code(st) for st in states]
    code = 0 if all(c == 0 for c in codes) else max(codes)
    if as_json:
        emit_json(states[0] if len(states) == 1 else {"runtime_root": str(tree), "servers": states}, ok=code == 0)
    else:
        for st in states:
            if len(states) > 1:
                click.echo(f"== server on port {st.get('port', '?')} ({st['runtime_root']}) ==")
            for line in _status_lines(st):
                click.echo(line)
    raise SystemExit(code)


def _status_lines(st: dict) -> list[str]:
    if not st["record"]:
        out = [f"running: no (no server record under {st['runtime_root']})"]
    elif not st["running"]:
        out = [f"running: no ({st['stale']}); `h3kit restart` starts it again with the same settings",
               f"port: {st['port']}, {st['device_type']} devices {st['requested_devices']}"]
    else:
        up = st["uptime_s"]
        out = [f"running: yes, pid {st['pid']}, up {int(up // 3600)}h{int(up % 3600 // 60):02d}m{int(up % 60):02d}s",
               f"url: {st['url']} ({st['health']})",
               f"devices ({st['device_type']} {','.join(map(str, st['requested_devices']))} requested; "
               f"the server reports {len(st.get('devices') or [])}):"]
        out += _device_lines(st.get("devices") or [])
        g = st.get("group")
        if g:
            out.append(f"process group: {g.get('state')}, generation {g.get('generation')}, {g.get('world_size')} "
                       f"ranks ({g.get('backend')}), node {g.get('node_rank')} of {g.get('nnodes')}, master "
                       f"{g.get('master')}" + (f": {g.get('error')}" if g.get("error") else ""))
            out += _rank_lines(g.get("ranks") or [])
        q = st.get("queue")
        out.append(f"queue: {q['running']} running, {q['pending']} pending" if q
                   else f"queue: unknown ({st.get('queue_error')})")
    out.append(f"log: {st['log'] or 'none'}")
    out += _error_lines(st["first_error"], "first error") if st["first_error"] else ["first error: none"]
    return out


@click.command()
@comfy_home_option(required=False)
@runtime_root_option
@port_option
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines, across restarts, until Ctrl-C.")
@click.option("--errors", is_flag=True, help="Only error blocks: tracebacks, failed prompts, OOMs.")
@click.option("-n", "--lines", type=click.IntRange(min=0), default=0, help="Only the last N lines (0: all).")
@handle_errors
def logs(comfy_home, runtime_root, port, follow, errors, lines):
    """Print or follow the server log.

    ComfyUI's colours are kept on a terminal, unless NO_COLOR is set (https://no-color.org), and dropped
    when the output is not a terminal.
    """
    root = service.pick(service.runtime_root(comfy_home, runtime_root), port, comfy_home)
    rec = service.read_record(root, comfy_home)
    path = Path(rec.log) if rec else service.latest_log(root)
    if not path.exists():
        raise service.ServiceError(f"no server log under {root}", code="no_log",
                                   hint="start the server with h3kit start")
    path = path.resolve()
    try:
        logscan.open_log(path).close()
    except OSError as e:
        raise service.ServiceError(f"cannot read the server log {path}: {e.strerror or e}", code="bad_log",
                                   hint="h3kit's logs are regular files under <runtime-root>/logs") from None
    if not follow:
        if errors:
            blocks = logscan.error_blocks(path)
            for blk in blocks[-lines:] if lines else blocks:
                for line in _error_lines(blk.to_dict(), "error", max_lines=logscan.ErrorScanner.MAX_BLOCK_LINES):
                    echo(line)
            return
        with logscan.open_log(path) as f:
            text = f.read().splitlines()
        for line in text[-lines:] if lines else text:
            echo(line)
        return
    try:
        _follow(root, path, errors, lines)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: following ends, as asked
        pass


def echo(line: str) -> None:
    """click.echo for log lines: NO_COLOR (set and not empty) drops the ANSI colours on a terminal too."""
    click.echo(line, color=False if os.environ.get("NO_COLOR") else None)


def _follow(root: Path, path: Path, errors: bool, lines: int) -> None:
    scanner = logscan.ErrorScanner(merge_oom=False)

    def show(text: str) -> None:
        for raw in text.splitlines():
            if not errors:
                echo(raw)
                continue
            for blk in scanner.feed(raw):
                for line in _error_lines(blk.to_dict(), "error"):
                    echo(line)

    with logscan.open_log(path) as f:
        existing = f.read()
    start = existing.splitlines()
    show("\n".join(start[-lines:] if lines else start))
    f = logscan.open_log(path)
    f.seek(0, 2)
    partial = ""
    try:
        while True:
            chunk = f.read()
            if chunk:
                partial += chunk
                done, sep, partial = partial.rpartition("\n")
                if sep:
                    show(done)
            else:
                newest = service.latest_log(root)
                if newest.exists() and newest.resolve() != path:
                    try:
                        nf = logscan.open_log(newest.resolve())
                    except OSError:  # not a regular file: not a log h3kit wrote, keep following this one
                        time.sleep(0.2)
                        continue
                    path = newest.resolve()
                    f.close()
                    f = nf
                    partial = ""
                    echo(f"==> {path} (new server log) <==")
                    scanner = logscan.ErrorScanner(merge_oom=False)
                    continue
                time.sleep(0.2)
    finally:
        f.close()


@click.command()
@comfy_home_option(required=False)
@runtime_root_option
@port_option
@click.option("--interval", type=click.FloatRange(min=0.05), default=5.0, show_default=True, metavar="S",
              help="Seconds between checks.")
@click.option("--failures", type=click.IntRange(min=1), default=3, show_default=True, metavar="N",
              help="Failed health checks in a row that count as a failure.")
@click.option("--backoff", type=click.FloatRange(min=0), default=2.0, show_default=True, metavar="S",
              help="First delay before a restart; doubles with each restart until the server is stable.")
@click.option("--backoff-max", type=click.FloatRange(min=0), default=60.0, show_default=True, metavar="S",
              help="Longest delay before a restart.")
@click.option("--crash-limit", type=click.IntRange(min=1), default=5, show_default=True, metavar="N",
              help="Restarts allowed within --crash-window; one more failure stops watching.")
@click.option("--crash-window", type=click.FloatRange(min=1), default=600.0, show_default=True, metavar="S",
              help="Seconds over which restarts are counted for --crash-limit.")
@click.option("--stable-after", type=click.FloatRange(min=0), default=120.0, show_default=True, metavar="S",
              help="Healthy seconds after which the backoff starts again from --backoff.")
@grace_option
@timeout_option
@click.option("--max-seconds", type=click.FloatRange(min=0), default=None, metavar="S",
              help="Stop watching after S seconds (scripts, tests). Default: until Ctrl-C or h3kit stop.")
@requeue_running_option
@json_option
@handle_errors
def watch(comfy_home, runtime_root, port, interval, failures, backoff, backoff_max, crash_limit, crash_window,
          stable_after, grace, timeout, max_seconds, requeue_running, as_json):
    """Keep the server up: restart it when it dies or stops answering.

    After an out-of-memory error the server survived, asks it to free memory (POST /free) first. Ends
    when `h3kit stop` removes the record, on Ctrl-C (the server keeps running), or, exit 1, after a crash
    loop (the server is stopped and the reason printed). Saves the queue on every healthy check and
    queues the pending prompts again after a restart (the running one only with --requeue-running).
    """
    root = service.pick(service.runtime_root(comfy_home, runtime_root), port, comfy_home)
    policy = supervise.WatchPolicy(interval=interval, failures=failures, backoff=backoff,
                                   backoff_max=backoff_max, crash_limit=crash_limit, crash_window=crash_window,
                                   stable_after=stable_after, grace=grace, start_timeout=timeout,
                                   max_seconds=max_seconds, requeue_running=requeue_running)
    outcome = supervise.watch(root, policy, comfy_home=comfy_home,
                              on_event=lambda e: err(f"h3kit watch: {e['time']} {e['event']}: {e['message']}"))
    if as_json:
        emit_json({"ok": True, "reason": outcome.reason, "message": outcome.message,
                   "restarts": outcome.restarts, "frees": outcome.frees, "restored": outcome.restored,
                   "events": outcome.events})
    else:
        click.echo(f"watch ended ({outcome.reason}): {outcome.message}; "
                   f"{outcome.restarts} restart(s), {outcome.frees} POST /free, "
                   f"{outcome.restored} prompt(s) queued again")
