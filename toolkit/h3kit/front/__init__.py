"""h3kit front: one entry point for a team over several ComfyUI servers (issue 46, item 4).

The front speaks to servers only through their HTTP API and /ws (it never reads a server's files, never signals
a server): it is independent of how the servers were started. Modules:

- store.py:     the durable queue (SQLAlchemy Core; SQLite by default, PostgreSQL by URL): jobs, claims with a
                lease, publication of a job's outputs exactly once.
- servers.py:   the servers it dispatches to (the tree's service records, read-only, and --server URLs), their
                health, device count and idleness, polled over HTTP.
- dispatch.py:  the loop: recover expired leases, hand queued jobs to idle servers whose device count fits
                (users take turns), follow running jobs, re-dispatch on a dead, hung or restarted server.
- comfyapi.py:  ComfyUI's own HTTP API for the prompts it takes (/prompt, /queue, /history, /view,
                /interrupt, /ws relayed with prompt ids mapped) and the page, proxied.
- videos.py:    the OpenAI-style job API (/v1/videos) mapped onto the shipped H3 workflows.
- auth.py:      bearer tokens from a file, each naming a user.
- metrics.py:   /metrics (prometheus_client).
- app.py:       the settings and the aiohttp application that ties them together.

Its dependencies (aiohttp, SQLAlchemy, prometheus_client, pg8000) are the `front` extra (pip install
'h3kit[front]'); nothing here is imported by `h3kit --help` or by any other command.
"""

from __future__ import annotations

from h3kit.errors import H3kitError, UsageError


class FrontError(H3kitError):
    code = "front_error"


class FrontUsageError(UsageError):
    code = "front_bad_input"


MISSING_EXTRA_HINT = "pip install 'h3kit[front]' (aiohttp, SQLAlchemy, prometheus_client, pg8000)"


def require_extra() -> None:
    """Raise a clear FrontUsageError when the `front` extra is not installed."""
    import importlib.util

    missing = [m for m in ("aiohttp", "sqlalchemy", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise FrontUsageError(f"h3kit front needs {', '.join(missing)}, which are not installed",
                              hint=MISSING_EXTRA_HINT)
