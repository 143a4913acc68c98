"""Guarded git operations on the ComfyUI checkout and its source (a URL, a checkout or a bare mirror).

Every call runs the git command line (no library in between), with `git -C`, a timeout, and refuses refs that
could be read as options. A clone on a terminal shows git's own progress on one updating line.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from h3kit.errors import H3kitError, UsageError

GIT_TIMEOUT = 120        # one local git command
CLONE_TIMEOUT = 3600     # a clone over a slow link; the local mirror takes seconds
_SHA_RE = re.compile(r"^[0-9a-f]{7,40}$")
_REF_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/+-]*$")  # what a tag or branch name needs here, no more
_MISSING_BLOB_RE = re.compile(r"unable to read sha1 file of (.+?) \(([0-9a-f]{40})\)")


class GitError(H3kitError):
    code = "git"


def check_revision_arg(rev: str, flag: str) -> str:
    """`rev` as a person types it (a commit id or prefix, a tag, a branch), refused before it reaches git when it
    could be read as an option or is no ref name git accepts."""
    if not rev or rev.startswith("-") or not _REF_RE.match(rev) or ".." in rev or rev.endswith((".lock", "/", ".")):
        raise UsageError(f"{flag} {rev!r} is not a revision", code="bad_revision",
                         hint="give a commit id (7 to 40 hexadecimal digits), a tag or a branch name of the source")
    return rev


def resolve_revision(source: str, rev: str, flag: str) -> str:
    """The commit `rev` names in `source` (a URL, a checkout or a bare mirror), resolved once. Hexadecimal digits
    are a commit id or prefix, returned lowercased for the caller to complete in its clone (no network); any
    other word is a tag, else a branch, of the source (`git ls-remote`, so a URL needs no clone). UsageError
    `no_such_revision` when the source holds neither."""
    check_revision_arg(rev, flag)
    if _SHA_RE.match(rev.lower()):
        return rev.lower()
    if source.startswith("-"):
        raise UsageError(f"source {source!r} would read as a git option", hint="give a URL or a path")
    proc = run(["ls-remote", "--", source, f"refs/tags/{rev}", f"refs/tags/{rev}^{{}}", f"refs/heads/{rev}"],
               check=False, timeout=CLONE_TIMEOUT)
    if proc.returncode != 0:
        raise GitError(f"cannot list the tags and branches of {source}: {proc.stderr.strip()[-400:]}",
                       code="no_source", hint="give --source (or H3KIT_COMFY_SOURCE) a git URL or a local mirror")
    refs = dict(reversed(line.split("\t", 1)) for line in proc.stdout.splitlines() if "\t" in line)
    for ref in (f"refs/tags/{rev}^{{}}", f"refs/tags/{rev}", f"refs/heads/{rev}"):  # an annotated tag: its commit
        if ref in refs:
            return refs[ref]
    raise UsageError(f"{flag} {rev!r}: {source} holds no tag or branch of that name", code="no_such_revision",
                     hint=f"give a commit id, tag or branch the source holds (git ls-remote {source})")


def _env() -> dict:
    return dict(os.environ, LC_ALL="C", GIT_TERMINAL_PROMPT="0")


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()
_PR_SET_PDEATHSIG = 1


def dies_with_us() -> dict:
    """Popen arguments that end a git child when h3kit itself dies, SIGKILL included (Linux: the parent-death
    signal). Without it, a killed `install` leaves `git clone` writing into the clone folder that the next
    run sweeps, and the folder comes back under it. Elsewhere: no arguments (Ctrl-C and SIGTERM still end
    the child through the callers' handlers)."""
    if _PRCTL is None:
        return {}
    parent = os.getpid()

    def _arm() -> None:  # runs in the child between fork and exec: no allocation beyond the call itself
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return {"preexec_fn": _arm}


def run(args: list[str], cwd: Path | str | None = None, *, check=True, timeout=GIT_TIMEOUT,
        input: bytes | None = None, text=True) -> subprocess.CompletedProcess:
    cmd = ["git"] + (["-C", str(cwd)] if cwd is not None else []) + args
    env = _env()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=text, timeout=timeout, env=env, input=input,
                              **dies_with_us())
    except FileNotFoundError:
        raise GitError("git is not installed", hint="install git (2.30 or newer)") from None
    except subprocess.TimeoutExpired:
        raise GitError(f"git {' '.join(args[:2])} did not finish within {timeout} s") from None
    if check and proc.returncode != 0:
        err = proc.stderr if text else proc.stderr.decode(errors="replace")
        raise GitError(f"git {' '.join(args[:3])} failed: {err.strip()[-800:]}")
    return proc


def is_checkout(path: Path) -> bool:
    if not (path / ".git").exists():
        return False
    proc = run(["rev-parse", "--show-toplevel"], path, check=False)
    return proc.returncode == 0 and Path(proc.stdout.strip()).resolve() == path.resolve()


def head(tree: Path) -> str:
    return run(["rev-parse", "HEAD"], tree).stdout.strip()


def has_commit(repo: Path | str, commit: str) -> bool:
    return run(["cat-file", "-e", f"{commit}^{{commit}}"], repo, check=False).returncode == 0


def resolve_commit(repo: Path | str, commit: str) -> str:
    return run(["rev-parse", "--verify", f"{commit}^{{commit}}"], repo).stdout.strip()


def read_blobs(repo: Path | str, commit: str, paths: list[str]) -> dict[str, bytes | None]:
    """The content of each path at `commit` (None where the commit has no such file)."""
    out: dict[str, bytes | None] = {}
    for rel in paths:
        proc = run(["cat-file", "blob", f"{commit}:{rel}"], repo, check=False, text=False)
        out[rel] = proc.stdout if proc.returncode == 0 else None
    return out


def read_modes(repo: Path | str, commit: str, paths: list[str]) -> dict[str, str]:
    """The git mode ("100644", "100755") of each path at `commit` that has one."""
    if not paths:
        return {}
    proc = run(["ls-tree", "-z", commit, "--", *paths], repo, check=False)
    out = {}
    for entry in proc.stdout.split("\0"):
        if entry and "\t" in entry:
            meta, path = entry.split("\t", 1)
            out[path] = meta.split()[0]
    return out


def status(tree: Path) -> list[tuple[str, str]]:
    """`git status --porcelain` as (code, path) pairs; untracked files included, ignored ones not."""
    proc = run(["status", "--porcelain", "-z", "--untracked-files=all"], tree)
    items = []
    for entry in proc.stdout.split("\0"):
        if entry:
            items.append((entry[:2], entry[3:]))
    return items


def is_local_source(source: str) -> bool:
    return "://" not in source and not re.match(r"^[\w.-]+@[\w.-]+:", source)


def _show_progress(stream) -> str:
    """Copy git's progress (lines ended by CR or LF) onto one updating stderr line; return all it wrote."""
    seen = []
    line = b""
    while True:
        chunk = stream.read1(4096) if hasattr(stream, "read1") else stream.read(4096)
        if not chunk:
            break
        seen.append(chunk)
        for piece in re.split(rb"([\r\n])", line + chunk):
            if piece in (b"\r", b"\n"):
                if line.strip():
                    sys.stderr.write("\r  " + line.decode(errors="replace").strip()[:76].ljust(76))
                    sys.stderr.flush()
                line = b""
            else:
                line = piece
    sys.stderr.write("\n")
    return b"".join(seen).decode(errors="replace")


def clone_no_checkout(source: str, dest: Path, *, progress: bool) -> None:
    """Clone without checking anything out (the offline mirror lacks blobs that master's checkout needs).
    With `progress`, git's progress is shown on stderr as it goes. Interrupted (Ctrl-C, SIGTERM), the git
    process is ended before the interruption goes on; the caller removes `dest`."""
    if source.startswith("-"):
        raise UsageError(f"source {source!r} would read as a git option", hint="give a URL or a path")
    if is_local_source(source) and not Path(source).exists():
        raise GitError(f"source {source} does not exist", code="no_source",
                       hint="give --source (or H3KIT_COMFY_SOURCE) a git URL or a local mirror holding the pin")
    cmd = ["git", "clone", "--no-checkout", "--progress" if progress else "--quiet", "--", source, str(dest)]
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env=_env(), **dies_with_us())
    except FileNotFoundError:
        raise GitError("git is not installed", hint="install git (2.30 or newer)") from None
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(_show_progress(proc.stderr) if progress
                                                          else proc.stderr.read().decode(errors="replace")),
                              daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=CLONE_TIMEOUT)
    except BaseException as e:  # a timeout, Ctrl-C or SIGTERM: no git left cloning behind us
        proc.kill()
        proc.wait()
        if isinstance(e, subprocess.TimeoutExpired):
            raise GitError(f"cloning {source} did not finish within {CLONE_TIMEOUT} s", code="clone_failed",
                           hint="use --source with a local mirror") from None
        raise
    finally:
        reader.join(10)
        proc.stderr.close()
    if rc != 0:
        stderr = (out[0] if out else "").strip()
        raise GitError(f"cloning {source} failed: {stderr[-600:]}", code="clone_failed",
                       hint="check the URL or mirror path; behind a firewall use --source with a local mirror")


def fetch_commit(tree: Path, source: str, commit: str) -> None:
    if source.startswith("-") or commit.startswith("-"):
        raise UsageError(f"refusing to pass {source!r} {commit!r} to git fetch: it would read as an option")
    run(["fetch", "--quiet", "--no-tags", "--", source, commit], tree, timeout=CLONE_TIMEOUT)


def checkout_detached(tree: Path, commit: str, *, force=False) -> list[str]:
    """Check out `commit` detached; returns the paths whose blobs the source lacks (left absent)."""
    args = ["checkout", "-q", "--detach"] + (["-f"] if force else []) + [commit]
    proc = run(args, tree, check=False)
    missing = sorted({m.group(1) for m in _MISSING_BLOB_RE.finditer(proc.stderr)})
    if proc.returncode != 0 and not missing:
        raise GitError(f"git checkout {commit[:12]} failed: {proc.stderr.strip()[-600:]}", code="checkout_failed",
                       hint="commit or stash local changes first, or pass --force to discard them")
    if head(tree) != resolve_commit(tree, commit):
        raise GitError(f"HEAD is not {commit[:12]} after checkout: {proc.stderr.strip()[-400:]}",
                       code="checkout_failed")
    return missing
