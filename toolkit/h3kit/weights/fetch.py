"""Download the model files a workflow needs into a ComfyUI tree, or onto shared storage (`h3kit models fetch`).

In this order, so that a refusal changes nothing and downloads nothing:
1. The files the loaders name (listing.collect) that ComfyUI at the tree does not find; each has a target
   <root>/<kind>/<name>, where root is the tree's models/ or, for the four H3 folders (diffusion_models,
   text_encoders, vae, loras), --models-dir. A file already at its target is not fetched again.
2. Every target folder must take a file (probed with an unnamed temporary file: root ignores permission bits,
   a read-only mount does not), and with --models-dir the tree's extra_model_paths.yaml must name the folder
   or h3kit must be able to add it (the tree is an h3kit install and its file can be merged, h3kit.modelpaths).
3. Each file's size and ETag from the server (a HEAD through huggingface_hub: HF_ENDPOINT and HF_TOKEN
   honoured, so a mirror serves it), checked against the size and sha256 the workflow or the manifest
   publish; then the free space of every file system against what is left to download.
4. With --models-dir, `h3kit install` with the recorded folders plus this one (journaled, as install writes
   it) when the file does not name it yet.
5. The downloads, one after the other. A file is written to <root>/<kind>/.h3kit-fetch/<name>.<key>.part (a
   name no loader lists: ComfyUI lists only its model extensions), resumed from the last byte an earlier run
   wrote (HTTP Range; the GET loop is h3kit's, through huggingface_hub's HTTP session, because
   huggingface_hub's http_get writes and reports in 10 MB chunks: an interruption before 10 MB kept nothing
   and the bar sat still for seconds; here every piece is written and counted as it arrives), then checked
   (size; sha256: the published one, else the server's ETag when that is a sha256, as the Hub names LFS
   files) and only then renamed to its name. A file that fails the check is deleted: nothing half-written
   ever sits under a name ComfyUI loads, and no empty .h3kit-fetch/ is left behind.
   A Hub file already in the Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub, the layout huggingface_hub
   and the hf CLI write) is not downloaded: it is hard-linked from the cache's blob when both are on one file
   system (no extra space; the link survives a cache cleanup, and huggingface_hub never rewrites a blob in
   place), else copied; then checked like a download. A symbolic link is never made: it would dangle after
   `hf cache delete`.
   A file the Hub serves through Xet (huggingface_hub with hf_xet installed, HF_HUB_DISABLE_XET unset) goes
   through hf_hub_download into <root>/.h3kit-fetch/xet/ instead, then the same check and rename; its
   resumption is hf_xet's (no Xet server runs offline: unmeasured here).

A file from a plain URL (not the Hub) must be a .safetensors or .sft file: a pickle checkpoint from an
arbitrary server runs code when it is loaded. Fetch holds no tree lock: a download takes hours, and
start, stop and restart must work meanwhile; each .part file is locked while it is written, so two fetches
never write the same file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import urllib.parse
from pathlib import Path

from h3kit import modelpaths
from h3kit.errors import H3kitError
from h3kit.weights import listing, sources as sources_mod

STAGING = ".h3kit-fetch"
PART_SUFFIX = ".part"
# left free on a file system after the downloads: ComfyUI, logs and the next download need room too
RESERVE_BYTES = 512 * 2**20
SAFE_SUFFIXES = (".safetensors", ".sft")


class FetchRefused(H3kitError):
    """Refused before any download: nothing was written or fetched."""
    code = "fetch_refused"


def _nolog(msg: str) -> None:
    pass


class Job:
    """One file to fetch: where it goes, where it may come from, and what the server said about it."""

    def __init__(self, wanted: listing.Wanted, root: str):
        self.wanted = wanted
        self.root = root
        rel = wanted.name.replace("\\", "/").split("/")
        self.target = os.path.join(root, wanted.kind, *rel)
        self.staging = os.path.join(root, wanted.kind, STAGING)
        self.sources = [s for s in wanted.sources if not s.refused]
        self.source = None      # the source the metadata came from
        self.meta = None        # huggingface_hub.HfFileMetadata
        self.size: int | None = None
        self.sha256: str | None = None
        self.part: str | None = None
        self.status = "pending"
        self.reason: str | None = None
        self.downloaded = 0
        self.url: str | None = None     # the URL actually asked (HF_ENDPOINT's for a Hub file)
        self.cached: str | None = None  # the file in the Hugging Face cache it is taken from
        self.retry_helps = False        # whether running fetch again can fix a failure (resume, a transient error)
        self.left = 0                   # bytes still to download (its size less a partial download's)

    def part_path(self) -> str:
        etag = (self.meta.etag if self.meta is not None else None) or self.source.url
        key = hashlib.sha256(f"{self.wanted.name}\n{etag}".encode()).hexdigest()[:16]
        return os.path.join(self.staging, f"{_safe(os.path.basename(self.target))}.{key}{PART_SUFFIX}")

    def to_dict(self) -> dict:
        return {"kind": self.wanted.kind, "name": self.wanted.name, "status": self.status, "path": self.target,
                "size": self.size, "sha256": self.sha256, "downloaded": self.downloaded, "reason": self.reason,
                "source": self.source.to_dict() if self.source else None, "url": self.url,
                "hf_cache": self.cached, "retry_helps": self.retry_helps, "workflows": self.wanted.workflows}


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:120]


def _existing_ancestor(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _probe_writable(folder: str) -> str | None:
    """None when a file can be created in `folder` (or in the nearest folder above it that exists, where
    the missing ones would be made), else why not. Leaves nothing behind."""
    where = _existing_ancestor(folder)
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        return f"{where}: {e.strerror or e}"
    return None


# ------------------------------------------------------------------------------------------------- fetch

def fetch(paths: list[str], comfy_home: str, models_dir: str | None = None, *, log=_nolog,
          progress: bool = False, dry_run: bool = False) -> dict:
    """What `h3kit models fetch` does (the module docstring); returns its --json data. Raises FetchRefused
    (nothing written, nothing downloaded) for a target that cannot take the files, a full disk, or a
    --models-dir that cannot be named in extra_model_paths.yaml. With `dry_run`, steps 1 and 3 only (the
    server is asked for sizes; nothing is written): each file's size, source and target, the total to
    download and the free space of each file system."""
    from h3kit.workflow import models

    install = models.open_install(comfy_home, object_info={})
    home = install.home
    shared = modelpaths.check_dirs([models_dir])[0] if models_dir else None
    wanted = listing.collect(paths)
    listing.locate(wanted, install)

    rows: list[Job] = []
    jobs: list[Job] = []
    for w in wanted:
        job = _job(w, shared, home)
        if job.status == "pending":
            jobs.append(job)
        else:
            rows.append(job)

    for job in jobs:
        _from_hf_cache(job)
    if dry_run:
        return _dry_run(paths, home, shared, rows, jobs, wanted, log)
    register = _plan_models_dir(home, shared, install) if shared else None
    _refuse_unless_room(jobs, log)
    if register is not None:
        log(f"adding {shared} to {modelpaths.CONFIG} (h3kit install --models-dir) ...")
        _register(home, register)
    for job in jobs:
        if job.status == "pending":
            if job.cached is not None:
                _place_from_cache(job, log)
            else:
                _download(job, log, progress)
    rows += jobs
    files = _ordered(rows, wanted)
    ok = all(f["status"] in DONE for f in files)
    return {"ok": ok, "comfy_home": home, "models_dir": shared, "workflows": list(paths), "files": files,
            "downloaded_bytes": sum(j.downloaded for j in rows), "dry_run": False,
            "extra_model_paths": {"added": register is not None, "named": True} if shared else None}


def _job(w, shared: str | None, home: str) -> Job:
    """The job for one wanted file: "pending" (to fetch), or what it is instead (present, wrong_size, no_source,
    refused) with the reason."""
    root = shared if shared and w.kind in modelpaths.KINDS else os.path.join(home, "models")
    job = Job(w, root)
    if w.bad_name:
        job.status, job.reason = "refused", w.bad_name
    elif w.found or os.path.isfile(job.target):
        job.target = w.found or job.target
        job.size = os.path.getsize(job.target)
        job.status = "present"
        problem = sources_mod.disk_problem(job.target, w.sources)
        if problem:
            job.status, job.reason = "wrong_size", problem
    elif not w.sources:
        job.status, job.reason = "no_source", w.note or sources_mod.describe([])
    elif not job.sources:
        job.status, job.reason = "refused", w.sources[0].refused
        job.source = w.sources[0]
    elif not job.sources[0].is_hf and not w.name.lower().endswith(SAFE_SUFFIXES):
        job.status, job.source = "refused", job.sources[0]
        job.reason = (f"from {job.source.url}: only {' and '.join(SAFE_SUFFIXES)} files are fetched from outside "
                      "the Hugging Face Hub (a pickle checkpoint runs code when it loads); download it by hand "
                      "if you trust the server")
    return job


def _refuse_unless_room(jobs: list[Job], log) -> None:
    """FetchRefused (nothing downloaded) when a target folder cannot be written or its disk cannot take the files
    (their sizes asked of the hub first)."""
    problems = [f"{d}: cannot write there ({why})" for d, why in
                {d: _probe_writable(d) for d in sorted({j.staging for j in jobs})}.items() if why]
    if problems:
        raise FetchRefused("the target folders cannot take the files: " + "; ".join(problems), code="not_writable",
                           hint="make the folder writable (or mount it read-write), or give --models-dir a folder "
                                "that is; nothing was downloaded")
    if jobs:
        _metadata([j for j in jobs if j.cached is None], log)
        short = _space([j for j in jobs if j.status == "pending"])
        if short:
            raise FetchRefused("not enough free disk space: " + "; ".join(short), code="disk_full",
                               hint="free space there, or give --models-dir a larger disk; nothing was downloaded")


DONE = ("present", "downloaded", "linked", "copied")


def _ordered(rows: list[Job], wanted) -> list[dict]:
    order = {(w.kind, w.name): i for i, w in enumerate(wanted)}
    rows.sort(key=lambda j: order[(j.wanted.kind, j.wanted.name)])
    return [j.to_dict() for j in rows]


def _dry_run(paths, home, shared, rows, jobs, wanted, log) -> dict:
    """What a fetch would do, asking the server for sizes only: nothing is written, no folder made. A file the
    server does not answer for (offline, a mirror down) is counted with the size h3kit's manifest publishes,
    said so, and the dry run is not ok (the fetch would fail now)."""
    _metadata([j for j in jobs if j.cached is None], log)
    unreached = [j for j in jobs if j.status == "failed" and _published_size(j) is not None]
    for job in unreached:
        job.size, job.status = _published_size(job), "pending"
        job.reason = f"the size published in h3kit's manifest ({job.size} bytes); {job.reason}"
    pending = [j for j in jobs if j.status == "pending"]
    disks = _space(pending, report=True)
    for job in pending:
        job.status = "would_" + ("download" if job.cached is None else _cache_mode(job))
    files = _ordered(rows + jobs, wanted)
    to_download = sum(j.left for j in pending if j.cached is None)
    ok = all(f["status"] in DONE or f["status"].startswith("would_") for f in files) and all(d["enough"] for d in disks) \
        and not unreached
    return {"ok": ok, "comfy_home": home, "models_dir": shared, "workflows": list(paths), "files": files,
            "downloaded_bytes": 0, "dry_run": True, "to_download_bytes": to_download, "disks": disks,
            "extra_model_paths": None}


def _published_size(job: Job) -> int | None:
    return next((s.size for s in job.sources if s.size is not None), None)


# ----------------------------------------------------------------------------------- --models-dir, yaml

def _plan_models_dir(home: str, shared: str, install) -> list[str] | None:
    """The models folders install must record for extra_model_paths.yaml to name `shared` (None when it
    already does). Refused when the tree is not an h3kit install or its file cannot take h3kit's section."""
    from h3kit import install as install_mod
    from h3kit.paths import repo_root

    if modelpaths.names(install.model_dirs, shared):
        return None
    state = install_mod.load_state(Path(home))
    fix = (f"h3kit install --comfy-home {home} --models-dir {shared}, or add a section naming {shared} "
           f"(diffusion_models/, text_encoders/, vae/, loras/) to {os.path.join(home, modelpaths.CONFIG)}")
    if state is None:
        raise FetchRefused(f"{modelpaths.CONFIG} of {home} does not name {shared}, and the tree was not installed "
                           "by h3kit, so fetch does not write it", code="models_dir_not_named", hint=fix)
    dirs = list(state.get("models_dirs") or []) + [shared]
    config = Path(home) / modelpaths.CONFIG
    current = config.read_bytes() if config.is_file() else None
    modelpaths.merge(current, modelpaths.read_template(repo_root()), dirs)  # raises when it cannot be merged
    return dirs


def _register(home: str, dirs: list[str]) -> None:
    from h3kit import install as install_mod

    state = install_mod.load_state(Path(home)) or {}
    opts = install_mod.InstallOptions(comfy_home=Path(home), source=state.get("source"), python=state.get("python"),
                                      models_dirs=dirs)
    install_mod.install(opts)


# ------------------------------------------------------------------------------------------ metadata

def _endpoint_hint() -> str:
    return ("check the network, or set HF_ENDPOINT to a Hugging Face mirror you can reach (now "
            f"{sources_mod.endpoint()}); a gated or private repository needs HF_TOKEN")


def _source_url(source) -> str:
    """The URL fetch asks: a Hub file's on HF_ENDPOINT (a mirror when it is set), a plain URL as given."""
    import huggingface_hub

    if source.is_hf:
        return huggingface_hub.hf_hub_url(source.repo, source.path, repo_type=source.repo_type,
                                          revision=source.revision, endpoint=sources_mod.endpoint())
    return source.url


def _token_set() -> bool:
    try:
        import huggingface_hub
        return bool(huggingface_hub.get_token())
    except Exception:  # noqa: BLE001 - an unreadable token file is no token
        return bool(os.environ.get("HF_TOKEN"))


def classify(e: BaseException, source) -> tuple[str, bool]:
    """(why, whether running fetch again can help) for a failed request: a refused connection, a missing file,
    an access refusal or a checksum are not fixed by a re-run; a timeout, a dropped connection or a 5xx are."""
    from huggingface_hub.utils import httpx as hx

    why = _why(e)
    status = getattr(getattr(e, "response", None), "status_code", None)
    if status in (401, 403) or type(e).__name__ == "GatedRepoError":
        if not source.is_hf:
            return f"the server refused access ({status}): {why}", False
        if _token_set():
            return (f"HF_TOKEN is set, but this token has no access to {source.repo} ({status}): accept the "
                    "repository's terms on the Hub with the account the token belongs to, or use a token with read "
                    "access to it"), False
        return (f"{source.repo} is gated or private ({status}) and no token is set: accept its terms on the Hub, then "
                "set HF_TOKEN to a token of that account (or run `hf auth login`)"), False
    if status == 404 or type(e).__name__ in ("EntryNotFoundError", "RemoteEntryNotFoundError",
                                              "RepositoryNotFoundError", "RevisionNotFoundError"):
        return f"not found on the server: {why}", False
    chain = [e, e.__cause__, e.__context__]
    if any(isinstance(x, (hx.ConnectError, ConnectionRefusedError)) for x in chain if x is not None):
        return f"cannot connect: {why}", False
    if isinstance(status, int) and status < 500 and status not in (408, 429):
        return why, False
    return why, True


def _metadata(jobs: list[Job], log) -> None:
    """Size, ETag and download URL of each job from its first source that answers; a job none answers is
    failed, one whose published size or sha256 disagrees with the server is refused."""
    import huggingface_hub

    for job in jobs:
        errors, helps = [], []
        for source in job.sources:
            url = _source_url(source)
            try:
                if source.is_hf:
                    meta = huggingface_hub.get_hf_file_metadata(url, endpoint=sources_mod.endpoint())
                else:
                    meta = huggingface_hub.get_hf_file_metadata(url, token=False)
            except Exception as e:  # noqa: BLE001 - any failure of one source: the next source, else a failed file
                why, retry = classify(e, source)
                errors.append(f"{url}: {why}")
                helps.append(retry)
                continue
            job.source, job.meta, job.url = source, meta, url
            break
        if job.meta is None:
            job.status = "failed"
            job.source = job.sources[0]
            job.url = _source_url(job.source)
            job.retry_helps = any(helps)
            job.reason = "no source answered: " + "; ".join(errors) + f" ({_endpoint_hint()})"
            log(f"{job.wanted.kind}/{job.wanted.name}: FAILED: {job.reason}")
            continue
        job.size = job.meta.size
        etag = (job.meta.etag or "").lower()
        served_sha = etag if re.fullmatch(r"[0-9a-f]{64}", etag) else None
        job.sha256 = job.source.sha256 or served_sha
        if job.source.size is not None and job.size is not None and job.source.size != job.size:
            job.status = "mismatch"
            job.reason = f"the server has {job.size} bytes, {job.source.size} are published: not downloaded"
        elif job.source.sha256 and served_sha and job.source.sha256 != served_sha:
            job.status = "mismatch"
            job.reason = f"the server's file has sha256 {served_sha}, {job.source.sha256} is published: not downloaded"
        elif job.size is None:
            job.size = job.source.size
        log(f"{job.wanted.kind}/{job.wanted.name}: {_gb(job.size)} from {job.url}")


def _why(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _gb(n: int | None) -> str:
    if n is None:
        return "size unknown"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


def _space(jobs: list[Job], report: bool = False) -> list:
    """Per file system, what is left to download against its free space. Returns the shortfalls as text, or
    with `report` one {"path", "free", "needed", "enough", "files"} per file system (the dry run)."""
    need: dict[int, list] = {}
    for job in jobs:
        if job.cached is None:
            job.part = job.part_path()
            have = os.path.getsize(job.part) if os.path.isfile(job.part) else 0
            left = job.left = max((job.size or 0) - have, 0)
        else:
            left = 0 if _cache_mode(job) == "link" else job.size or 0
        where = _existing_ancestor(job.staging)
        dev = os.stat(where).st_dev
        entry = need.setdefault(dev, [where, 0, []])
        entry[1] += left
        entry[2].append(job.wanted.name)
    out = []
    for where, left, names in need.values():
        free = shutil.disk_usage(where).free
        enough = free >= left + RESERVE_BYTES
        if report:
            out.append({"path": where, "free": free, "needed": left, "enough": enough, "files": names})
        elif not enough:
            out.append(f"{where}: {_gb(free)} free, {_gb(left)} to download (+{RESERVE_BYTES // 2**20} MiB kept "
                       f"free) for {', '.join(names)}")
    return out


# ----------------------------------------------------------------------------------- the Hugging Face cache

def hub_cache() -> str:
    """Where huggingface_hub keeps its cache, read afresh as it reads it: HF_HUB_CACHE, else HF_HOME/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def _from_hf_cache(job: Job) -> None:
    """Point the job at a copy of its Hub file in the Hugging Face cache, when one is there and agrees with what
    is published (size; sha256 against the blob's name, which is the file's sha256 for LFS files)."""
    import huggingface_hub

    for source in job.sources:
        if not source.is_hf:
            continue
        try:
            found = huggingface_hub.try_to_load_from_cache(source.repo, source.path, cache_dir=hub_cache(),
                                                           revision=source.revision, repo_type=source.repo_type)
        except Exception:  # noqa: BLE001 - an unreadable cache is no cache
            continue
        if not isinstance(found, str) or not os.path.isfile(found):
            continue
        blob = os.path.realpath(found)
        name = os.path.basename(blob)
        blob_sha = name if re.fullmatch(r"[0-9a-f]{64}", name) else None
        size = os.path.getsize(blob)
        if (source.size is not None and size != source.size) or (source.sha256 and blob_sha and
                                                                  blob_sha != source.sha256):
            continue
        job.source, job.cached, job.size = source, blob, size
        job.sha256 = source.sha256 or blob_sha
        job.url = _source_url(source)
        return


def _cache_mode(job: Job) -> str:
    """"link" when the cache's blob and the target folder share a file system, else "copy"."""
    try:
        return "link" if os.stat(job.cached).st_dev == os.stat(_existing_ancestor(job.staging)).st_dev else "copy"
    except OSError:
        return "copy"


def _place_from_cache(job: Job, log) -> None:
    """Hard-link (same file system) or copy the cached blob into the staging folder, then check and rename it
    as a download is."""
    mode = _cache_mode(job)
    try:
        os.makedirs(job.staging, exist_ok=True)
        tmp = os.path.join(job.staging, f"{_safe(os.path.basename(job.target))}.hf-cache{PART_SUFFIX}")
        Path(tmp).unlink(missing_ok=True)
        if mode == "link":
            try:
                os.link(job.cached, tmp)
            except OSError:  # a file system without hard links
                mode = "copy"
        if mode == "copy":
            shutil.copyfile(job.cached, tmp)
        log(f"{job.wanted.name}: {'hard-linked' if mode == 'link' else 'copied'} from the Hugging Face cache "
            f"({job.cached})")
        _verify_and_place(job, tmp, log)
    except OSError as e:
        job.status, job.reason = "failed", f"from the Hugging Face cache {job.cached}: {_why(e)}"
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(job.staging)
    if job.status == "downloaded":
        job.status = "linked" if mode == "link" else "copied"


# ----------------------------------------------------------------------------------------- download

def _download(job: Job, log, progress: bool) -> None:
    try:
        os.makedirs(job.staging, exist_ok=True)
        if job.meta.xet_file_data is not None and _xet_usable():
            path = _download_xet(job, progress)
        else:
            path = _download_http(job, log, progress)
        if path is None:
            return
        _verify_and_place(job, path, log)
    except KeyboardInterrupt:
        if job.part and os.path.isfile(job.part):
            log(f"{job.wanted.name}: interrupted; {_gb(os.path.getsize(job.part))} kept in {job.part}, the next "
                "fetch resumes there")
        raise
    except Exception as e:  # noqa: BLE001 - huggingface_hub's and the HTTP client's errors: one failed file
        why, job.retry_helps = classify(e, job.source)
        kept = job.part and os.path.isfile(job.part) and os.path.getsize(job.part) > 0
        if job.part and not kept:
            Path(job.part).unlink(missing_ok=True)  # nothing arrived: nothing to resume, no empty file left
        job.status = "failed"
        job.reason = why + ("; run fetch again to resume" + (f" ({_gb(os.path.getsize(job.part))} kept)" if kept
                                                             else "") if job.retry_helps else f" ({_endpoint_hint()})")
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(job.staging)  # only when empty: a partial download to resume stays


def _xet_usable() -> bool:
    flag = os.environ.get("HF_HUB_DISABLE_XET", "").strip().upper()
    return flag not in ("1", "ON", "YES", "TRUE") and importlib.util.find_spec("hf_xet") is not None


def _bar(progress: bool):
    from tqdm import tqdm

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = not progress
            kwargs.setdefault("file", sys.stderr)
            super().__init__(*args, **kwargs)

    return Bar


READ_TIMEOUT_S = 60.0
RETRIES = 5


def _download_http(job: Job, log, progress: bool) -> str | None:
    """Into the job's .part file, resumed from its last byte (HTTP Range); the path when complete, None when
    another process holds it. Every piece is written and counted as it arrives."""
    from huggingface_hub import utils

    for stale in Path(job.staging).glob(f"{_safe(os.path.basename(job.target))}.*{PART_SUFFIX}"):
        if str(stale) != job.part:  # an earlier version of the file on the server: never resumed into this one
            stale.unlink(missing_ok=True)
    headers = utils.build_hf_headers(token=None if job.source.is_hf else False)
    url = job.meta.location
    if job.source.is_hf and urllib.parse.urlsplit(url).netloc != urllib.parse.urlsplit(sources_mod.endpoint()).netloc:
        headers.pop("authorization", None)  # a CDN's signed URL: the token stays with the Hub
    with open(job.part, "ab", buffering=0) as f:  # unbuffered: what arrived is on disk, to resume from
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            job.status = "failed"
            job.reason = f"another h3kit models fetch is downloading it ({job.part})"
            return None
        have = f.tell()
        if job.size is not None and have > job.size:
            f.truncate(0)
            f.seek(0)
            have = 0
        log(f"{job.wanted.name}: resuming at {_gb(have)} of {_gb(job.size)}" if have else
            f"{job.wanted.name}: downloading {_gb(job.size)}")
        start = have
        with _bar(progress)(total=job.size, initial=have, unit="B", unit_scale=True, unit_divisor=1024,
                            desc=job.wanted.name[-40:]) as bar:
            have = get_range(url, f, have, headers, job.size, bar.update)
        f.flush()
        os.fsync(f.fileno())
        job.downloaded = have - start
    return job.part


def get_range(url: str, f, have: int, headers: dict, size: int | None, step) -> int:
    """GET `url` from byte `have` into `f` (Range), calling step(n) for every piece written; a dropped or timed
    out connection is resumed from the last byte written, up to RETRIES times without progress. Returns the
    length of the file."""
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import hf_raise_for_status, http_stream_backoff, httpx as hx

    tries = 0
    while size is None or have < size:
        asked = dict(headers)
        if have:
            asked["Range"] = f"bytes={have}-"
        before = have
        try:
            with http_stream_backoff("GET", url, headers=asked, timeout=READ_TIMEOUT_S, retry_on_exceptions=(),
                                     retry_on_status_codes=(408, 429)) as r:
                hf_raise_for_status(r)
                if have and r.status_code == 200:  # the server ignored the Range: start over
                    f.seek(0)
                    f.truncate()
                    step(-have)
                    have = 0
                for piece in r.iter_bytes():  # as it arrives, not in fixed chunks
                    if piece:
                        f.write(piece)
                        have += len(piece)
                        step(len(piece))
            if size is None:
                break
            if have < size:
                raise OSError(f"the server ended the transfer at {have} of {size} bytes")
        except HfHubHTTPError:
            raise  # an answer, not a broken transfer: the caller says whether a re-run helps
        except (hx.TimeoutException, hx.RemoteProtocolError, hx.NetworkError, OSError) as e:
            if isinstance(e, hx.ConnectError):
                raise
            tries = 0 if have > before else tries + 1
            if tries >= RETRIES:
                raise
            import time
            time.sleep(min(2 ** tries, 8) * 0.5)
    return have


def _download_xet(job: Job, progress: bool) -> str:
    import huggingface_hub

    local = os.path.join(job.root, STAGING, "xet")
    got = huggingface_hub.hf_hub_download(job.source.repo, job.source.path, repo_type=job.source.repo_type,
                                          revision=job.meta.commit_hash or job.source.revision, local_dir=local,
                                          endpoint=sources_mod.endpoint(), tqdm_class=_bar(progress))
    job.downloaded = os.path.getsize(got)
    return got


def _verify_and_place(job: Job, path: str, log) -> None:
    """Size and sha256 checked, then renamed to the name ComfyUI loads; a file that fails is deleted."""
    size = os.path.getsize(path)
    problem = None
    if job.size is not None and size != job.size:
        problem = f"{size} bytes downloaded, {job.size} expected"
    elif job.sha256:
        log(f"{job.wanted.name}: checking sha256 ...")
        got = sources_mod.sha256_file(path)
        if got != job.sha256:
            problem = f"sha256 {got}, expected {job.sha256}"
    if problem:
        Path(path).unlink(missing_ok=True)
        job.status = "mismatch"
        job.reason = f"{problem}: the download was deleted; check the source (or HF_ENDPOINT's mirror)"
        return
    os.makedirs(os.path.dirname(job.target), exist_ok=True)
    if os.path.exists(job.target):  # written meanwhile by someone else: theirs stays
        Path(path).unlink(missing_ok=True)
        job.status = "present"
        return
    try:
        os.replace(path, job.target)
    except OSError as e:
        if e.errno != 18:  # EXDEV: the Xet staging folder is on another file system than the target
            raise
        tmp = os.path.join(job.staging, os.path.basename(job.part_path()))
        shutil.copyfile(path, tmp)
        os.replace(tmp, job.target)
        Path(path).unlink(missing_ok=True)
    job.size = size
    job.status = "downloaded"
    with contextlib.suppress(OSError):
        os.rmdir(job.staging)  # only when empty: other files' partial downloads stay
    log(f"{job.wanted.name}: {_gb(size)} at {job.target}")


LABELS = {"present": "ok     ", "downloaded": "fetched", "linked": "linked ", "copied": "copied ",
          "failed": "FAILED ", "mismatch": "BAD    ", "refused": "REFUSED", "no_source": "NO SRC ", "wrong_size": "BAD    ",
          "would_download": "fetch  ", "would_link": "link   ", "would_copy": "copy   "}


def render_text(data: dict) -> str:
    lines = []
    for f in data["files"]:
        size = f"  {_gb(f['size'])}" if f["status"] not in ("present",) else ""
        lines.append(f"{LABELS.get(f['status'], f['status'])} {f['kind']}/{f['name']}{size}  -> {f['path']}")
        if f["status"].startswith("would_"):
            origin = f"the Hugging Face cache ({f['hf_cache']})" if f["hf_cache"] else f["url"]
            lines.append(f"        from {origin}")
        if f["reason"]:
            lines.append(f"        {f['reason']}")
    n = len(data["files"])
    lines.append("")
    if data.get("dry_run"):
        lines.append(f"dry run: {_gb(data['to_download_bytes'])} ({data['to_download_bytes']} bytes) to download for "
                     f"{sum(f['status'] == 'would_download' for f in data['files'])} file(s), "
                     f"{sum(f['status'] in ('would_link', 'would_copy') for f in data['files'])} from the Hugging "
                     f"Face cache, {sum(f['status'] == 'present' for f in data['files'])} already in place; "
                     "nothing was written")
        for d in data["disks"]:
            lines.append(f"  {d['path']}: {_gb(d['free'])} free, {_gb(d['needed'])} needed"
                         + ("" if d["enough"] else f" (+{RESERVE_BYTES // 2**20} MiB kept free): NOT ENOUGH"))
        return "\n".join(lines)
    done = sum(f["status"] in DONE for f in data["files"])
    lines.append(f"{done} of {n} model file(s) in place; downloaded {_gb(data['downloaded_bytes'])}")
    if data.get("extra_model_paths") and data["extra_model_paths"]["added"]:
        lines.append(f"{modelpaths.CONFIG} now names {data['models_dir']} (h3kit install recorded it)")
    if any(f["status"] == "failed" and f["retry_helps"] for f in data["files"]):
        lines.append("run the same command again to resume the downloads marked 'run fetch again'")
    return "\n".join(lines)

