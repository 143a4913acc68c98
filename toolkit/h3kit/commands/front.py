"""`h3kit front`: the click layer over h3kit.front (imported only when the command runs)."""

from __future__ import annotations

import os

import click

from h3kit.cliutil import handle_errors


def _video_workflow(values) -> dict:
    from h3kit.front import FrontUsageError

    out = {}
    for v in values:
        kind, sep, path = v.partition("=")
        if not sep or kind not in ("t2v", "ref2v") or not path:
            raise FrontUsageError(f"--video-workflow {v!r}: expected t2v=FILE or ref2v=FILE",
                                  hint="e.g. --video-workflow t2v=my_t2va.json")
        out[kind] = path
    return out


@click.command("front")
@click.option("--port", type=click.IntRange(0, 65535), default=8188, show_default=True,
              help="Port the front listens on (0: any free port, printed at start).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Another than loopback needs --tokens.")
@click.option("--comfy-home", "comfy_home", envvar="H3KIT_COMFY_HOME", type=click.Path(), metavar="DIR",
              help="A ComfyUI tree whose server(s) h3kit started: the front reads its service record (read-only).")
@click.option("--runtime-root", metavar="DIR", type=click.Path(),
              help="Where that tree's service record is (default <comfy-home>/.h3kit/run).")
@click.option("--server", "servers", multiple=True, metavar="URL",
              help="A ComfyUI server by URL (http://HOST:PORT), e.g. on another host. Repeatable.")
@click.option("--data-dir", type=click.Path(), metavar="DIR",
              help="Where the queue database (SQLite) and the published outputs live "
                   "(default <comfy-home>/.h3kit/front, else ./h3kit-front).")
@click.option("--db", "db_url", envvar="H3KIT_FRONT_DB", metavar="URL",
              help="The queue database: sqlite:///PATH (default, in --data-dir) or postgresql://USER:PASS@HOST/DB "
                   "for several fronts (env H3KIT_FRONT_DB).")
@click.option("--tokens", "tokens_file", type=click.Path(), metavar="FILE",
              help="Bearer tokens, one `USER TOKEN` line each (chmod 600). Without it: loopback only, one user.")
@click.option("--lease", type=click.FloatRange(2, 3600), default=30.0, show_default=True,
              help="Seconds a running job's lease lasts; another front takes a job over once it ran out.")
@click.option("--dead-after", type=click.FloatRange(0, 3600), default=5.0, show_default=True,
              help="Seconds a server may refuse connections before its running job is dispatched again.")
@click.option("--hang-after", type=click.FloatRange(1, 86400), default=60.0, show_default=True,
              help="Seconds a server may not answer before its running job is dispatched again.")
@click.option("--max-attempts", type=click.IntRange(1, 100), default=3, show_default=True,
              help="Dispatches of one job before it fails.")
@click.option("--video-workflow", "video_workflows", multiple=True, metavar="KIND=FILE",
              help="The workflow /v1/videos runs: t2v=FILE (text) or ref2v=FILE (reference image); UI or API "
                   "format. Default: the shipped t2va/ref2va 8-step workflows.")
@handle_errors
def front(port, host, comfy_home, runtime_root, servers, data_dir, db_url, tokens_file, lease, dead_after,
          hang_after, max_attempts, video_workflows):
    """One entry point for a team: a durable queue over several ComfyUI servers.

    Serves ComfyUI's own API and page (POST /prompt, /queue, /history, /view, /interrupt, /ws) and an
    OpenAI-style job API (/v1/videos) on --port, and hands each job to an idle server whose device count fits
    its npu_count, users in turn; a job whose server dies, hangs or restarts runs again elsewhere. Needs the
    `front` extra: pip install 'h3kit[front]'. Setup, auth, TLS and metrics: docs/service.md, "h3kit front".
    """
    from h3kit.front import FrontUsageError, require_extra

    require_extra()
    from h3kit.front import app, auth, dispatch

    if not servers and not comfy_home and not runtime_root:
        raise FrontUsageError("no server to dispatch to", hint="pass --comfy-home DIR (its h3kit servers) and/or "
                                                               "--server http://HOST:PORT")
    if comfy_home and not os.path.isdir(comfy_home):
        raise FrontUsageError(f"--comfy-home {comfy_home} is not a folder", hint="give the ComfyUI tree h3kit "
                                                                                  "installed, or only --server URLs")
    tokens = auth.load_tokens(tokens_file) if tokens_file else None
    auth.check_bind(host, tokens)
    if data_dir is None:
        data_dir = os.path.join(comfy_home, ".h3kit", "front") if comfy_home else "h3kit-front"
    os.makedirs(data_dir, exist_ok=True)
    timing = dispatch.Timing(lease=lease, dead_after=dead_after, hang_after=hang_after, max_attempts=max_attempts)
    settings = app.Settings(host=host, port=port, data_dir=data_dir, db_url=db_url, servers=list(servers),
                            comfy_home=comfy_home, runtime_root=runtime_root, tokens=tokens, timing=timing,
                            video_workflows=_video_workflow(video_workflows))
    app.run(settings)
