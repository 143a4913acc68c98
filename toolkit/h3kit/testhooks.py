"""Kill points: named places in install, revert, a worker's and a server's start where the tests make h3kit die.

Used only by tests. `H3KIT_TEST_KILL_AT=NAME[:N][:SIGNAL]` makes the N-th arrival (default the first) at
kill point NAME send SIGNAL (default KILL; TERM to test the Ctrl-C path; STOP to freeze the command while
it holds the tree lock) to this process. Without the variable `point()` does nothing. The names are
listed in KILL_POINTS, so a test that names a point which no longer exists fails instead of silently
never killing.
"""

from __future__ import annotations

import os
import signal

KILL_ENV = "H3KIT_TEST_KILL_AT"
KILL_POINTS = (
    "clone-made",        # the clone is complete in its temporary folder, nothing moved into the home yet
    "clone-moving",      # after each entry of the clone is moved into the home
    "clone-moved",       # every entry moved and the journal closed, the emptied temporary folder not yet removed
    "journal-blobs",     # the journal's copies of the files are written, journal.json is not
    "journal-written",   # journal.json is written, no file has changed yet
    "tmp-written",       # after each `.NAME.h3kit-tmp` is written, before it replaces the file
    "file-written",      # after each file of the tree is replaced
    "files-written",     # every file written, the journal not yet removed
    "recovering",        # after each file a recovery puts back
    "worker-started",    # a parity or calibration worker is started, its cleanup not yet in place
    "server-started",    # `start` has started the server, not yet recorded it, its cleanup not yet in place
)
_arrivals: dict[str, int] = {}


def point(name: str) -> None:
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    parts = spec.split(":")
    if parts[0] not in KILL_POINTS:
        raise ValueError(f"{KILL_ENV}={spec}: unknown kill point {parts[0]!r}")
    if parts[0] != name:
        return
    _arrivals[name] = _arrivals.get(name, 0) + 1
    nth = int(parts[1]) if len(parts) > 1 and parts[1] else 1
    if _arrivals[name] != nth:
        return
    os.kill(os.getpid(), getattr(signal, "SIG" + (parts[2] if len(parts) > 2 else "KILL")))
