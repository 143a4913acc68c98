"""The `h3kit` command: a thin click layer over the library modules.

Each command lives in h3kit/commands/<module>.py and is imported only when it runs, and `--help` lists the
commands from the table below without importing any of them, so `h3kit --help` and `check-workflow` start
without torch, numpy or websocket-client.
"""

from __future__ import annotations

import contextlib
import importlib
import sys

import click

from h3kit import __version__

# name: (module under h3kit.commands, attribute, one-line summary shown by --help)
COMMANDS = {
    "install": ("install", "install", "Install ComfyUI at the pin and apply the h3kit patch series."),
    "verify": ("install", "verify", "Check an installed tree: pin, patches, installed files, bytecode."),
    "revert": ("install", "revert", "Reverse the patch series and remove the files install added."),
    "patches": ("patches", "patches", "Inspect and maintain the patch series (check, refresh, rebase)."),
    "start": ("service", "start", "Start the ComfyUI server on the given devices and wait until healthy."),
    "stop": ("service", "stop", "Stop the server h3kit started."),
    "restart": ("service", "restart", "Restart the server (after an OOM, say) with the same settings."),
    "status": ("service", "status", "Show whether the server runs, its devices and its queue."),
    "logs": ("service", "logs", "Print or follow the server log."),
    "watch": ("service", "watch", "Keep the server up: restart it when it dies or stops answering."),
    "check-workflow": ("workflow", "check_workflow", "Validate H3 workflows before they reach the devices."),
    "models": ("models", "models", "List and fetch the model files workflows need (Hugging Face, resumable, verified)."),
    "parity": ("runtime", "parity", "Compare a multi-device forward with one device (tiny random weights)."),
    "plan": ("runtime", "plan", "Print the sequence-parallel cost model for a resolution and device count."),
    "doctor": ("doctor", "doctor", "Check that this machine is ready to run H3 (read-only), with a fix for each problem."),
    "calibrate": ("calibrate", "calibrate", "Measure links, collectives and a real-width DiT block; project each tier."),
    "demo": ("demo", "demo", "Run a real H3 prompt with tiny weights through the patched server."),
    "bench": ("demo", "bench", "Time a workflow on the running server, cold then warm."),
    "front": ("front", "front", "Serve a team: one queue and entry point (ComfyUI API, /v1/videos) over several servers."),
}


def _json_requested(args: list[str]) -> bool:
    """--json on the command line, before any `--` (what follows it belongs to ComfyUI)."""
    return "--json" in (args[:args.index("--")] if "--" in args else args)


def did_you_mean(name: str) -> str:
    """" Did you mean 'status'?" for a mistyped command (close spellings, then commands it begins), or "".
    click suggests close option names itself, but not command names."""
    import difflib

    close = difflib.get_close_matches(name, list(COMMANDS), n=2, cutoff=0.7)
    close += [c for c in COMMANDS if len(name) >= 2 and c.startswith(name) and c not in close]
    return f" Did you mean {' or '.join(repr(c) for c in close[:3])}?" if close else ""


class LazyGroup(click.Group):
    """Commands imported only when they run; usage errors that click finds (a missing option, a bad choice,
    an unknown command) printed as h3kit's JSON error document too when --json was given."""

    _json = False

    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        spec = COMMANDS.get(name)
        if spec is None:
            return None
        module = importlib.import_module(f"h3kit.commands.{spec[0]}")
        return getattr(module, spec[1])

    def resolve_command(self, ctx, args):
        name = args[0] if args else None
        if isinstance(name, str) and name not in COMMANDS and not name.startswith("-"):
            ctx.fail(f"No such command {name!r}.{did_you_mean(name)}")
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx, formatter):
        rows = [(name, spec[2]) for name, spec in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def format_epilog(self, ctx, formatter):
        # the docs that help texts and error fixes cite (docs/...): in a checkout, or inside an installed wheel
        from h3kit import paths

        with contextlib.suppress(Exception):
            docs = paths.repo_root() / "docs"
            if docs.is_dir():
                formatter.write_paragraph()  # one line, never wrapped: the path must stay whole to be copied
                formatter.write(f"Documentation (the docs/ that help and fixes cite):\n  {docs}\n")

    def main(self, args=None, *rest, **kwargs):
        args = list(sys.argv[1:] if args is None else args)
        self._json = _json_requested(args)
        return super().main(args, *rest, **kwargs)

    def make_context(self, info_name, args, parent=None, **extra):
        with self._usage_errors_as_json():
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx):
        with self._usage_errors_as_json():
            return super().invoke(ctx)

    @contextlib.contextmanager
    def _usage_errors_as_json(self):
        try:
            yield
        except click.ClickException as e:
            if self._json:
                from h3kit.cliutil import command_name, emit_json_error

                where = command_name(e.ctx) if getattr(e, "ctx", None) is not None else None
                fix = f"h3kit {where} --help" if where else "h3kit --help"
                code = "usage" if isinstance(e, click.UsageError) else "bad_input"
                emit_json_error(code, e.format_message(), f"see {fix}", command=where)
            raise  # click prints the message on stderr and exits 2 (1 for other ClickExceptions)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="h3kit")
def main():
    """Deploy MiniMax H3 in a pinned, patched ComfyUI on 1, 2, 4 or 8 Ascend NPUs.

    New here? `h3kit demo --comfy-home DIR` does everything once, on tiny weights: installs ComfyUI at the
    pin with the patch series into DIR, starts the server (devices simulated on a CPU host), runs a real H3
    prompt and shows the time of each stage. Then `h3kit install`, `h3kit start` and `h3kit check-workflow`
    for your own models. Every command takes --help; commands that scripts read take --json.
    """
