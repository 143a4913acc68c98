"""Find the errors in a ComfyUI log: tracebacks, failed prompts and out-of-memory events.

What ComfyUI writes when a node fails (execution.py at the pin), each a separate logging call:

    [ERROR] !!! Exception during processing !!! <message>
    [ERROR] Traceback (most recent call last):
      File ...
    torch.OutOfMemoryError: CUDA out of memory. ...
    [INFO] Memory summary: ...                       (OOM only)
    [ERROR] Got an OOM, unloading all loaded models. (OOM only)

A server that dies while parsing its arguments prints argparse's usage and then one line,
`main.py: error: <why>` (exit 2): that line is an error block too, so `status` shows why the server did not
start. The level tags come with ANSI colours even in a file. The scanner strips the colours, groups such lines
into blocks, and marks a block as an OOM when its exception names one or when the "Got an OOM" line
follows it before the next error: the first error of a run is what the OOM runbook starts from.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
LEVEL_TAG = re.compile(r"^\[(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\]\s?")

OOM_MARKER = "Got an OOM, unloading all loaded models"
# torch on an accelerator says "out of memory" (torch.OutOfMemoryError, "NPU out of memory"); on the host
# the CPU allocator says "can't allocate memory", which ComfyUI itself does not treat as an OOM.
OOM_PATTERN = re.compile(r"OutOfMemoryError|out of memory|Got an OOM|can't allocate memory", re.IGNORECASE)
TRACEBACK = "Traceback (most recent call last):"
ARGPARSE_ERROR = re.compile(r"^[\w.-]+\.py: error: ")
NODE_EXCEPTION = "!!! Exception during processing !!!"


def clean(line: str) -> str:
    return ANSI.sub("", line.rstrip("\r\n"))


@dataclass
class ErrorBlock:
    line: int                      # 1-based line number where the block starts
    lines: list[str] = field(default_factory=list)
    oom: bool = False

    @property
    def kind(self) -> str:
        return "oom" if self.oom else "error"

    @property
    def summary(self) -> str:
        """The exception line of the block's traceback, else its first line (level tags removed)."""
        body = [LEVEL_TAG.sub("", ln) for ln in self.lines]
        for i, ln in enumerate(body):
            if ln.startswith(TRACEBACK):
                for exc in body[i + 1:]:
                    if exc and not exc[0].isspace():
                        return exc
        return body[0] if body else ""

    def to_dict(self) -> dict:
        return {"kind": self.kind, "line": self.line, "summary": self.summary, "lines": self.lines}


class ErrorScanner:
    """Feed log lines one at a time; complete error blocks come back from feed() and finish().

    With `merge_oom=True` (reading a whole file) the "Got an OOM" line marks the error block before it as an
    OOM; with False (following a live log, where that block was already shown) it is a block of its own.
    """

    MAX_BLOCK_LINES = 200

    def __init__(self, merge_oom: bool = True):
        self.merge_oom = merge_oom
        self.lineno = 0
        self.current: ErrorBlock | None = None
        self.in_traceback = False
        self.last: ErrorBlock | None = None   # the latest finished block of the current prompt

    def feed(self, raw: str) -> list[ErrorBlock]:
        self.lineno += 1
        line = clean(raw)
        body = LEVEL_TAG.sub("", line)
        done: list[ErrorBlock] = []
        if self.current is not None:
            if self._continues(body):
                self._add(line, body)
                return done
            done.append(self._close())
        if self.merge_oom and body.startswith(OOM_MARKER) and self.last is not None:
            # the marker belongs to the error just reported (ComfyUI logs it after the traceback)
            self.last.oom = True
            self.last.lines.append(line)
        elif self._starts(line, body):
            self.current = ErrorBlock(self.lineno)
            self._add(line, body)
        elif body.startswith(("got prompt", "Prompt executed")):
            self.last = None  # a new prompt: a later OOM line is a new event
        return done

    def finish(self) -> list[ErrorBlock]:
        return [self._close()] if self.current is not None else []

    @staticmethod
    def _starts(line: str, body: str) -> bool:
        return (body.startswith((TRACEBACK, NODE_EXCEPTION, OOM_MARKER)) or line.startswith(("[ERROR]", "[CRITICAL]"))
                or ARGPARSE_ERROR.match(body) is not None)

    def _continues(self, body: str) -> bool:
        blk = self.current
        if len(blk.lines) >= self.MAX_BLOCK_LINES:
            return False
        if self.in_traceback:
            return True
        # the traceback ComfyUI logs right after "!!! Exception ..." belongs to that line
        return body.startswith(TRACEBACK) and len(blk.lines) == 1 and NODE_EXCEPTION in blk.lines[0]

    def _add(self, line: str, body: str) -> None:
        blk = self.current
        blk.lines.append(line)
        if OOM_PATTERN.search(body):
            blk.oom = True
        if body.startswith(TRACEBACK):
            self.in_traceback = True
        elif self.in_traceback and body and not body[0].isspace():
            self.in_traceback = False  # the exception line ends the traceback

    def _close(self) -> ErrorBlock:
        blk, self.current, self.in_traceback = self.current, None, False
        self.last = blk
        return blk


def _iter_lines(path: Path):
    with open_log(path) as f:
        yield from f


def open_log(path: str | os.PathLike):
    """A log opened for reading text; OSError (ENOENT, or EINVAL for a FIFO, a device or a link to one)
    unless it is a regular file: a FIFO would block and /dev/zero never end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
        return open(fd, "r", encoding="utf-8", errors="replace")
    except BaseException:
        os.close(fd)
        raise


def error_blocks(path: str | os.PathLike, limit: int | None = None) -> list[ErrorBlock]:
    """Every error block of a log file (at most `limit`); [] when the file does not exist."""
    path = Path(path)
    if not path.is_file():
        return []
    scanner = ErrorScanner()
    out: list[ErrorBlock] = []
    for raw in _iter_lines(path):
        out.extend(scanner.feed(raw))
        # one more line is read after the limit is reached so a trailing OOM marker still lands
        if limit is not None and len(out) > limit:
            break
    out.extend(scanner.finish())
    return out[:limit] if limit is not None else out


def first_error(path: str | os.PathLike | None) -> ErrorBlock | None:
    if not path:
        return None
    blocks = error_blocks(path, limit=1)
    return blocks[0] if blocks else None


def tail(path: str | os.PathLike, lines: int = 20) -> list[str]:
    """The last `lines` lines of a file, colours stripped; [] when it does not exist."""
    path = Path(path)
    if not path.is_file():
        return []
    return [clean(ln) for ln in deque(_iter_lines(path), maxlen=lines)]


def read_since(path: str | os.PathLike, offset: int) -> tuple[bytes, int]:
    """The bytes appended to `path` since `offset`, and the new offset; (b"", offset) when unreadable."""
    try:
        with open_log(path) as f:
            f.buffer.seek(offset)
            data = f.buffer.read()
    except OSError:
        return b"", offset
    return data, offset + len(data)
