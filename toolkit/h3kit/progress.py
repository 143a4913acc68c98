"""A prompt's progress as the server reports it, for `demo` and `bench`.

ComfyUI sends `executing {node}` as each node starts and `progress {value, max, node}` as a node advances
(the sampler's steps; the VAE's tiles). On a terminal this shows one bar that redraws in place
("  SamplerCustomAdvanced [#########-----------]  3/8"); elsewhere (a log, CI, a pipe) plain lines through
the command's log: one when a node starts, and a step line each time a tenth of the node's work is done and
at its end, so a long H3 prompt never looks frozen and a log stays short.
"""

from __future__ import annotations

import sys

BAR_WIDTH = 30


class PromptProgress:
    """Feed it the prompt's websocket events (`__call__(kind, data)`, as comfyws.follow's on_event); call
    `close()` when the prompt ends. `classes` maps node ids to class names; `log` writes one plain line;
    `stream` is where the bar goes when `tty` (default: whether the stream is a terminal)."""

    def __init__(self, classes: dict[str, str], log, stream=None, tty: bool | None = None):
        self.classes = classes
        self.log = log
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.node: str | None = None
        self.last_tenth = -1
        self.bar_open = False

    def _name(self, node) -> str:
        return self.classes.get(str(node), str(node))

    def __call__(self, kind: str, data: dict) -> None:
        if kind == "executing":
            self._end_bar()
            node = data.get("node")
            self.node, self.last_tenth = (str(node) if node is not None else None), -1
            if node is not None and not self.tty:
                self.log(f"  running {self._name(node)}")
        elif kind == "progress":
            self._step(data)
        elif kind in ("execution_success", "execution_error", "execution_interrupted"):
            self._end_bar()

    def _step(self, data: dict) -> None:
        try:
            value, top = int(data.get("value")), int(data.get("max"))
        except (TypeError, ValueError):
            return
        if top <= 0:
            return
        value = max(0, min(value, top))
        name = self._name(data.get("node") or self.node)
        if self.tty:
            done = BAR_WIDTH * value // top
            width = len(str(top))
            self.stream.write(f"\r  {name} [{'#' * done}{'-' * (BAR_WIDTH - done)}] {value:>{width}}/{top}")
            self.stream.flush()
            self.bar_open = True
            return
        tenth = 10 * value // top
        if tenth > self.last_tenth:
            self.last_tenth = tenth
            self.log(f"  {name}: step {value}/{top}")

    def _end_bar(self) -> None:
        if self.bar_open:
            self.stream.write("\n")
            self.stream.flush()
            self.bar_open = False

    def close(self) -> None:
        self._end_bar()
