"""The `h3kit` command: a thin click layer over the library modules.

Each command lives in h3kit/commands/<module>.py and is imported only when it runs, and `--help` lists the
commands from the table below without importing any of them, so `h3kit --help` and `check-workflow` start
without torch or GitPython.
"""

from __future__ import annotations

import importlib

import click

from h3kit import __version__

# name: (module under h3kit.commands, attribute, one-line summary shown by --help)
COMMANDS = {
    "install": ("install", "install", "Install ComfyUI at the pin and apply the h3kit patch series."),
    "verify": ("install", "verify", "Check an installed tree: pin, patches, installed files, bytecode."),
    "revert": ("install", "revert", "Reverse the patch series and remove the files install added."),
    "patches": ("patches", "patches", "Inspect and maintain the patch series (check, refresh)."),
    "start": ("service", "start", "Start the ComfyUI server on the given devices and wait until healthy."),
    "stop": ("service", "stop", "Stop the server h3kit started."),
    "restart": ("service", "restart", "Restart the server (after an OOM, say) with the same settings."),
    "status": ("service", "status", "Show whether the server runs, its devices and its queue."),
    "logs": ("service", "logs", "Print or follow the server log."),
    "watch": ("service", "watch", "Keep the server up: restart it when it dies or stops answering."),
    "check-workflow": ("workflow", "check_workflow", "Validate H3 workflows before they reach the devices."),
    "parity": ("runtime", "parity", "Compare a multi-device forward with one device (tiny random weights)."),
    "plan": ("runtime", "plan", "Print the sequence-parallel cost model for a resolution and device count."),
    "doctor": ("doctor", "doctor", "Check that this machine is ready to run H3 (read-only), with a fix for each problem."),
    "calibrate": ("calibrate", "calibrate", "Measure links, collectives and a real-width DiT block; project each tier."),
    "demo": ("demo", "demo", "Run a real H3 prompt with tiny weights through the patched server."),
    "bench": ("demo", "bench", "Time a workflow on the running server, cold then warm."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        spec = COMMANDS.get(name)
        if spec is None:
            return None
        module = importlib.import_module(f"h3kit.commands.{spec[0]}")
        return getattr(module, spec[1])

    def format_commands(self, ctx, formatter):
        rows = [(name, spec[2]) for name, spec in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="h3kit")
def main():
    """Deploy MiniMax H3 in a pinned, patched ComfyUI on 1, 2, 4 or 8 Ascend NPUs.

    Start with `h3kit install --comfy-home DIR`, then `h3kit start`. Every command takes --help.
    """
