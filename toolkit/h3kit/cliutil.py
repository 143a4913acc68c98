"""Helpers the command modules share: error mapping, JSON output, common options.

Library code raises h3kit.errors.H3kitError; `handle_errors` turns it into a one-line message (and, with
--json, the JSON document below) and the error's exit code, never a traceback.

With --json every command prints exactly one document on stdout, the same shape for all of them:

    {"schema": "h3kit/1", "command": "install", "ok": true, "data": {...}}
    {"schema": "h3kit/1", "command": "install", "ok": false, "error": {"code", "message", "fix", ["details"]}}

"ok" is true exactly when the exit code is 0. "data" is there when the command did its work (also when its
verdict is negative: verify finding problems, status of a stopped server, a failed parity row); "error" when
it could not (bad input, a refused or failed operation, Ctrl-C, a bug). A usage error that click itself finds
(a missing option, a bad choice) takes the "error" form too when --json was on the command line
(h3kit.cli.LazyGroup). Progress and warnings always go to stderr.

`handle_errors` also makes SIGTERM behave like Ctrl-C for the command it wraps: both raise KeyboardInterrupt where the command runs, so the same cleanup
runs (a temporary clone removed, a write rolled back, a server the command started stopped), and the exit
code is 130 (SIGINT) or 143 (SIGTERM).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import click

from h3kit.errors import H3kitError, UsageError

COMFY_HOME_ENV = "H3KIT_COMFY_HOME"
JSON_SCHEMA = "h3kit/1"


def comfy_home_option(required: bool = True):
    return click.option("--comfy-home", "comfy_home", envvar=COMFY_HOME_ENV, required=required,
                        type=click.Path(), metavar="DIR",
                        help=f"The ComfyUI checkout h3kit manages (env {COMFY_HOME_ENV}).")


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")


def _finite(value):
    """JSON has no NaN or Infinity: such floats are written as the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def command_name(ctx: click.Context | None = None) -> str | None:
    """The command as typed after `h3kit` ("install", "patches check"); None for the top level."""
    ctx = ctx if ctx is not None else click.get_current_context(silent=True)
    names = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return " ".join(reversed(names)) or None


def _print_document(doc: dict) -> None:
    click.echo(json.dumps(_finite(doc), indent=2, sort_keys=False, default=str, allow_nan=False))


def emit_json(data, ok: bool | None = None) -> None:
    """Print the document of a command that did its work. `ok` (true when the command exits 0) defaults to
    data["ok"] when data is a dict holding one, which then appears only at the top level, else to True."""
    if isinstance(data, dict) and "ok" in data:
        data = dict(data)
        found = bool(data.pop("ok"))
        ok = found if ok is None else ok
    _print_document({"schema": JSON_SCHEMA, "command": command_name(), "ok": True if ok is None else bool(ok),
                     "data": data})


def emit_json_error(code: str, message: str, fix: str | None = None, details=None, command: str | None = None) -> None:
    """Print the document of a command that could not do its work (see the module docstring)."""
    error = {"code": code, "message": message, "fix": fix}
    if details is not None:
        error["details"] = details
    _print_document({"schema": JSON_SCHEMA, "command": command if command is not None else command_name(),
                     "ok": False, "error": error})


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt, so that both run the same cleanup."""

    signum = signal.SIGTERM


def _interrupt_handler(signum, frame):
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _cleanup_handler(signum, frame):
    err(f"h3kit: {signal.Signals(signum).name} again: still cleaning up after the first one (SIGKILL stops at "
        "once; the next h3kit run then finishes the cleanup)")


@contextlib.contextmanager
def signals_as_interrupt():
    """While the block runs, SIGINT and SIGTERM raise KeyboardInterrupt (Terminated for SIGTERM) once; a second
    signal during the cleanup that follows is reported and does not cut the cleanup short. The handlers
    that were there before are restored afterwards (the tests run commands in-process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def first(signum, frame):
        for s in previous:
            signal.signal(s, _cleanup_handler)
        _interrupt_handler(signum, frame)

    for s in previous:
        signal.signal(s, first)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


_HELD = {signal.SIGINT, signal.SIGTERM}


def hold_signals():
    """Block SIGINT and SIGTERM in this (main) thread while a child is being started; returns the mask for
    release_signals, None off the main thread. Without it a signal that lands after the child exists and before
    Popen returns raises out of Popen, and nobody kills the child."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)


def release_signals(previous) -> None:
    """Restore the mask hold_signals returned: a signal that came meanwhile is raised here."""
    if previous is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def run_captured(cmd: list, timeout: float, **popen) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **popen) (popen: cwd, env), except that
    Ctrl-C or SIGTERM at any moment, also while the child is being started, kills the child before it is raised."""
    held = hold_signals()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                text=True, preexec_fn=None if held is None else lambda: release_signals(held), **popen)
    except BaseException:
        release_signals(held)
        raise
    with proc:
        try:
            release_signals(held)
            out, errs = proc.communicate(timeout=timeout)
        except BaseException:
            proc.kill()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, errs)


def sigterm_as_interrupt() -> None:
    """Turn SIGTERM into KeyboardInterrupt for the rest of the process (handle_errors already does this for
    the command it wraps; kept for code that runs outside it)."""
    signal.signal(signal.SIGTERM, _interrupt_handler)


def check_args(kwargs: dict) -> None:
    """What click's types let through but no command can use, refused as bad input with h3kit's error shape:
    a float option given as nan or inf (click's FloatRange compares, and nan compares false: `--timeout nan`
    would wait forever), and --comfy-home / --runtime-root naming a file or a path through one."""
    for key, value in kwargs.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"--{key.replace('_', '-')} {value}: give a finite number", code="bad_number")
    for key, flag in (("comfy_home", "--comfy-home"), ("runtime_root", "--runtime-root")):
        value = kwargs.get(key)
        if not value:
            continue
        path = Path(value).expanduser()
        probe = path
        while not os.path.lexists(probe) and probe != probe.parent:
            probe = probe.parent
        if os.path.lexists(probe) and not probe.is_dir():
            where = "is a file" if probe == path else f"goes through {probe}, which is a file"
            raise UsageError(f"{flag} {value} {where}, not a folder", code="not_a_folder",
                             hint=f"give {flag} a folder (it is created when missing)")


def err(message: str) -> None:
    click.echo(message, err=True)


def handle_errors(fn):
    """Map H3kitError to its exit code and a readable message; unexpected errors to exit 3."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = kwargs.get("as_json", False)
        try:
            with signals_as_interrupt():
                check_args(kwargs)
                return fn(*args, **kwargs)
        except H3kitError as e:
            if as_json:
                emit_json_error(**e.to_dict())
            err(f"h3kit: error [{e.code}]: {e.message}")
            if e.hint:
                err(f"  fix: {e.hint}")
            sys.exit(e.exit_code)
        except KeyboardInterrupt as e:
            signum = getattr(e, "signum", signal.SIGINT)
            what = "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted (Ctrl-C)"
            if as_json:
                emit_json_error("terminated" if signum == signal.SIGTERM else "interrupted", what,
                                "what the command had started was undone: run it again")
            err(f"h3kit: {what}; what this command had started was undone")
            sys.exit(128 + signum)
        except BrokenPipeError:  # `h3kit ... | head`: the reader left; nothing more to say
            try:
                sys.stdout = open(os.devnull, "w")
            except OSError:
                pass
            sys.exit(1)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException, SystemExit):
            raise
        except Exception as e:  # a bug in h3kit, not bad input: say so plainly
            if os.environ.get("H3KIT_DEBUG"):
                traceback.print_exc()
            if as_json:
                emit_json_error("internal", f"{type(e).__name__}: {e}",
                                "rerun with H3KIT_DEBUG=1 for the traceback, and report it")
            err(f"h3kit: internal error: {type(e).__name__}: {e}")
            err("  rerun with H3KIT_DEBUG=1 for the traceback, and report it")
            sys.exit(3)

    return wrapper
