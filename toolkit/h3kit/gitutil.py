"""Guarded git operations on the ComfyUI checkout and its source (a URL, a checkout or a bare mirror).

Every call uses `git -C`, a timeout, and refuses refs that could be read as options. The clone goes through
GitPython so that a terminal shows its progress; GitPython is imported only here, inside the functions.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from h3kit.errors import H3kitError, UsageError

GIT_TIMEOUT = 120        # one local git command
CLONE_TIMEOUT = 3600     # a clone over a slow link; the local mirror takes seconds
_SHA_RE = re.compile(r"^[0-9a-f]{7,40}$")
_MISSING_BLOB_RE = re.compile(r"unable to read sha1 file of (.+?) \(([0-9a-f]{40})\)")


class GitError(H3kitError):
    code = "git"


def check_commit_arg(commit: str) -> str:
    if not commit or commit.startswith("-") or not _SHA_RE.match(commit.lower()):
        raise UsageError(f"--commit {commit!r} is not a commit id", hint="give 7 to 40 hexadecimal digits")
    return commit.lower()


def run(args: list[str], cwd: Path | str | None = None, *, check=True, timeout=GIT_TIMEOUT,
        input: bytes | None = None, text=True) -> subprocess.CompletedProcess:
    cmd = ["git"] + (["-C", str(cwd)] if cwd is not None else []) + args
    env = dict(os.environ, LC_ALL="C", GIT_TERMINAL_PROMPT="0")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=text, timeout=timeout, env=env, input=input)
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


def blob_ids(repo: Path | str, commit: str, paths: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for rel in paths:
        proc = run(["rev-parse", "--verify", "--quiet", f"{commit}:{rel}"], repo, check=False)
        out[rel] = proc.stdout.strip() if proc.returncode == 0 else None
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


class _Progress:
    """GitPython progress printer: one updating line on a terminal."""

    def __new__(cls):
        import git

        names = {git.RemoteProgress.COUNTING: "counting objects", git.RemoteProgress.COMPRESSING: "compressing",
                 git.RemoteProgress.RECEIVING: "receiving objects", git.RemoteProgress.RESOLVING: "resolving deltas",
                 git.RemoteProgress.WRITING: "writing", git.RemoteProgress.FINDING_SOURCES: "finding sources",
                 git.RemoteProgress.CHECKING_OUT: "checking out"}

        class P(git.RemoteProgress):
            def update(self, op_code, cur_count, max_count=None, message=""):
                stage = names.get(op_code & self.OP_MASK, "cloning")
                pct = f"{100 * cur_count / max_count:5.1f}%" if max_count else f"{int(cur_count)}"
                sys.stderr.write(f"\r  {stage}: {pct} {message}".ljust(78)[:78])
                if op_code & self.END:
                    sys.stderr.write("\n")
                sys.stderr.flush()

        return P()


def clone_no_checkout(source: str, dest: Path, *, progress: bool) -> None:
    """Clone without checking anything out (the offline mirror lacks blobs that master's checkout needs)."""
    import git

    if source.startswith("-"):
        raise UsageError(f"source {source!r} would read as a git option", hint="give a URL or a path")
    if is_local_source(source) and not Path(source).exists():
        raise GitError(f"source {source} does not exist", code="no_source",
                       hint="give --source (or H3KIT_COMFY_SOURCE) a git URL or a local mirror holding the pin")
    try:
        git.Repo.clone_from(source, str(dest), multi_options=["--no-checkout"],
                            progress=_Progress() if progress else None,
                            env={"GIT_TERMINAL_PROMPT": "0"}, kill_after_timeout=CLONE_TIMEOUT)
    except git.GitCommandError as e:
        stderr = (e.stderr or "").strip().replace("stderr: ", "")
        raise GitError(f"cloning {source} failed: {stderr[-600:]}", code="clone_failed",
                       hint="check the URL or mirror path; behind a firewall use --source with a local mirror") from None


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
