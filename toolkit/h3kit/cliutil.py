"""Helpers the command modules share: error mapping, JSON output, common options.

Library code raises h3kit.errors.H3kitError; `handle_errors` turns it into a one-line message (or a JSON
error object with --json) and the error's exit code, never a traceback.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import sys
import traceback

import click

from h3kit.errors import H3kitError

COMFY_HOME_ENV = "H3KIT_COMFY_HOME"


def comfy_home_option(required: bool = True):
    return click.option("--comfy-home", "comfy_home", envvar=COMFY_HOME_ENV, required=required,
                        type=click.Path(file_okay=False), metavar="DIR",
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


def emit_json(data) -> None:
    click.echo(json.dumps(_finite(data), indent=2, sort_keys=False, default=str, allow_nan=False))


def sigterm_as_interrupt() -> None:
    """Turn SIGTERM into KeyboardInterrupt, so a command that owns child processes (a server being started,
    a parity worker holding the devices) runs its cleanup when it is terminated, as on Ctrl-C."""
    def handler(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, handler)


def err(message: str) -> None:
    click.echo(message, err=True)


def handle_errors(fn):
    """Map H3kitError to its exit code and a readable message; unexpected errors to exit 3."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = kwargs.get("as_json", False)
        try:
            return fn(*args, **kwargs)
        except H3kitError as e:
            if as_json:
                emit_json({"ok": False, "error": e.to_dict()})
            err(f"h3kit: error [{e.code}]: {e.message}")
            if e.hint:
                err(f"  fix: {e.hint}")
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            err("h3kit: interrupted")
            sys.exit(130)
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
                emit_json({"ok": False, "error": {"code": "internal", "message": f"{type(e).__name__}: {e}"}})
            err(f"h3kit: internal error: {type(e).__name__}: {e}")
            err("  rerun with H3KIT_DEBUG=1 for the traceback, and report it")
            sys.exit(3)

    return wrapper
