"""Move the patch series onto another upstream commit three-way, patch by patch, the way `gbp pq` does.

`replay` builds a throwaway git repository holding the upstream files the series touches at the new
commit, writes into its object store every base blob the series' index lines name (the pin's files and the
files as each earlier patch leaves them, recomputed from the pin), then applies the patches in order,
committing each one: `git apply --check` first (the patch takes as it is: "clean"), else `git apply --3way`
(a merge against the recorded base: "merged", or conflict markers: "conflict"). Every hunk is classified
the same way on its own (does it apply as it is; else does a merge of this hunk alone succeed; else the
conflicting lines). From the commits the refreshed series is read back with `git diff --full-index`: new
context, new base blobs, the same DEP-3 headers with an `Upstream-Commit` field naming the new commit.

A conflicting patch keeps the hunks that merge (its conflicting ones are left out, upstream's text stays) so
the patches after it are still tried; the file with git's conflict markers is kept for the report. No
refreshed series comes out of a replay with a conflict.

Nothing here writes outside its own temporary folder: `h3kit patches rebase` (commands/patches.py) writes the
report and the series where it is told, and install (h3kit.install) uses the refreshed series in memory.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from h3kit import gitutil, locks
from h3kit.errors import H3kitError, UsageError
from h3kit.patchfile import DEFAULT_MODE, Section, render_patch, with_index
from h3kit.patches import Series, Step, walk

GIT_TIMEOUT = 60
HEADER_FIELD = "Upstream-Commit"
_CONFLICT_START = "<<<<<<< "
_CONFLICT_END = ">>>>>>> "


class RebaseError(H3kitError):
    code = "rebase"


@dataclass
class HunkResult:
    header: str
    state: str  # "clean" (applies as it is), "merged" (three-way), "conflict"
    conflict: list[str] = field(default_factory=list)  # the conflicting region, markers included

    def to_dict(self) -> dict:
        return {"hunk": self.header, "state": self.state, "conflict": self.conflict}


@dataclass
class FileResult:
    path: str
    state: str
    hunks: list[HunkResult] = field(default_factory=list)
    message: str = ""
    marked: bytes | None = None  # the file with git's conflict markers (a conflict only)

    def to_dict(self) -> dict:
        return {"file": self.path, "state": self.state, "message": self.message,
                "hunks": [h.to_dict() for h in self.hunks]}


@dataclass
class PatchResult:
    name: str
    state: str  # "clean", "merged" or "conflict" (a file can also be "resolved": a maintainer's resolution)
    files: list[FileResult] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"patch": self.name, "state": self.state, "files": [f.to_dict() for f in self.files]}

    @property
    def how(self) -> str:
        """How install records it: "plain" or "3-way"."""
        return "plain" if self.state == "clean" else "3-way"


@dataclass
class Replay:
    commit: str
    patches: list[PatchResult]
    after: dict[str, bytes | None]  # the touched files once the series is on the new commit
    texts: dict[str, str]  # the refreshed patch texts (empty when a patch conflicts)

    @property
    def ok(self) -> bool:
        return not self.conflicts

    @property
    def conflicts(self) -> list[PatchResult]:
        return [p for p in self.patches if p.state == "conflict"]

    def counts(self) -> dict[str, int]:
        return {s: sum(p.state == s for p in self.patches) for s in ("clean", "merged", "conflict")}

    def conflicting_hunks(self) -> list[dict]:
        """One entry per conflicting hunk (or file, where no hunk could be tried): patch, file, hunk header."""
        out = []
        for p in self.conflicts:
            for f in p.files:
                if f.state != "conflict":
                    continue
                bad = [h for h in f.hunks if h.state == "conflict"]
                for h in bad or [None]:
                    out.append({"patch": p.name, "file": f.path, "hunk": h.header if h else None,
                                "message": f.message or "upstream changed the lines this hunk changes",
                                "conflict": h.conflict if h else []})
        return out

    def to_dict(self) -> dict:
        return {"ok": self.ok, "onto": self.commit, "counts": self.counts(),
                "patches": [p.to_dict() for p in self.patches], "conflicts": self.conflicting_hunks()}


# --- git outside any repository, and in the replay's own -------------------------------------------------

def _env(ceiling: Path | None = None) -> dict:
    env = dict(os.environ, LC_ALL="C", GIT_TERMINAL_PROMPT="0", GIT_AUTHOR_NAME="h3kit", GIT_AUTHOR_EMAIL="h3kit@localhost",
               GIT_COMMITTER_NAME="h3kit", GIT_COMMITTER_EMAIL="h3kit@localhost",
               GIT_AUTHOR_DATE="2000-01-01T00:00:00Z", GIT_COMMITTER_DATE="2000-01-01T00:00:00Z")
    for k in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY"):
        env.pop(k, None)
    if ceiling is not None:
        env["GIT_CEILING_DIRECTORIES"] = str(ceiling)
    return env


def _git(cwd: Path, *args: str, check=True, input: bytes | None = None, ceiling: Path | None = None) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(["git", "-c", "core.autocrlf=false", "-c", "commit.gpgsign=false", "-c", "core.hooksPath=/dev/null",
                               "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false", "-c", "merge.conflictStyle=merge",
                               *args], cwd=cwd,
                              capture_output=True, timeout=GIT_TIMEOUT, env=_env(ceiling), input=input,
                              **gitutil.dies_with_us())
    except FileNotFoundError:
        raise RebaseError("git is not installed", hint="install git (2.30 or newer)") from None
    except subprocess.TimeoutExpired:
        raise RebaseError(f"git {' '.join(args[:2])} did not finish within {GIT_TIMEOUT} s") from None
    if check and proc.returncode != 0:
        raise RebaseError(f"git {' '.join(args[:2])} failed: {proc.stderr.decode(errors='replace').strip()[-600:]}")
    return proc


def _write(root: Path, rel: str, data: bytes | None) -> None:
    dest = root / rel
    if data is None:
        dest.unlink(missing_ok=True)
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)


def _read(root: Path, rel: str) -> bytes | None:
    p = root / rel
    return p.read_bytes() if p.is_file() else None


def _apply_alone(scratch: Path, rel: str, content: bytes | None, patch_text: str) -> bytes | None:
    """`patch_text` applied to `content` (as file `rel`) outside any repository; None if it does not apply."""
    for p in scratch.iterdir():
        if p.name != "patch":
            _rmtree(p)
    if content is not None:
        _write(scratch / "t", rel, content)
    else:
        (scratch / "t").mkdir(exist_ok=True)
    (scratch / "patch").write_text(patch_text)
    proc = _git(scratch / "t", "apply", "--whitespace=nowarn", str(scratch / "patch"), check=False, ceiling=scratch)
    return _read(scratch / "t", rel) if proc.returncode == 0 else None


def _rmtree(p: Path) -> None:
    import shutil

    if p.is_dir():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)


def _merge(scratch: Path, ours: bytes, base: bytes, theirs: bytes, labels: tuple[str, str, str]) -> tuple[bool, bytes]:
    """git merge-file: (clean, result with conflict markers where it is not)."""
    for name, data in (("ours", ours), ("base", base), ("theirs", theirs)):
        (scratch / name).write_bytes(data)
    proc = _git(scratch, "merge-file", "-p", "-L", labels[0], "-L", labels[1], "-L", labels[2],
                "ours", "base", "theirs", check=False, ceiling=scratch)
    if proc.returncode < 0 or proc.returncode > 127:
        raise RebaseError(f"git merge-file failed: {proc.stderr.decode(errors='replace').strip()}")
    return proc.returncode == 0, proc.stdout


def _conflict_regions(text: bytes) -> list[list[str]]:
    regions, cur = [], None
    for line in text.decode("utf-8", errors="replace").split("\n"):
        if line.startswith(_CONFLICT_START):
            cur = [line]
        elif cur is not None:
            cur.append(line)
            if line.startswith(_CONFLICT_END):
                regions.append(cur)
                cur = None
    return regions


def _one_hunk(sec: Section, hunks) -> str:
    body = [f"diff --git a/{sec.path} b/{sec.path}", f"--- a/{sec.path}", f"+++ b/{sec.path}"]
    for h in hunks:
        body += [h.header, *h.lines]
    return "\n".join(body) + "\n"


def classify(sec: Section, base: bytes, ours: bytes, scratch: Path, label: str, patch: str) -> tuple[list[HunkResult], bytes]:
    """Each hunk of `sec` against upstream's `ours` (the patch was made on `base`), and the file with the
    hunks that merge applied and the conflicting ones left out."""
    results = []
    good = []
    for h in sec.hunks:
        if _apply_alone(scratch, sec.path, ours, _one_hunk(sec, [h])) is not None:
            results.append(HunkResult(h.header, "clean"))
            good.append(h)
            continue
        theirs = _apply_alone(scratch, sec.path, base, _one_hunk(sec, [h]))
        if theirs is None:
            raise RebaseError(f"{patch}: {sec.path}: hunk {h.header} does not apply to its own base",
                              hint="run h3kit patches check --source ...: the series and its index lines disagree")
        clean, merged = _merge(scratch, ours, base, theirs, (label, "base", patch))
        if clean:
            results.append(HunkResult(h.header, "merged"))
            good.append(h)
        else:
            regions = _conflict_regions(merged)
            results.append(HunkResult(h.header, "conflict", [ln for r in regions for ln in r]))
    partial = ours
    if good:
        theirs = _apply_alone(scratch, sec.path, base, _one_hunk(sec, good))
        clean, merged = _merge(scratch, ours, base, theirs, (label, "base", patch)) if theirs is not None else (False, b"")
        partial = merged if clean else ours
    return results, partial


# --- the replay -----------------------------------------------------------------------------------------

def _patch_text(step: Step) -> str:
    """The patch as applied in the replay: its sections with the index lines the pin's walk gives, so a
    series whose files lack them (an older h3kit) merges all the same."""
    sections = []
    for sec in step.patch.sections:
        old, new = step.blobs(sec.path)
        if sec.new_file or sec.deleted_file:
            sections.append(sec.text)
        else:
            sections.append(with_index(sec.text, old, new, sec.mode or DEFAULT_MODE))
    return render_patch(step.patch.header_text, sections)


def header_with_commit(header_text: str, commit: str) -> str:
    """The DEP-3 header with its Upstream-Commit field set to `commit` (added after the last field)."""
    lines = header_text.rstrip("\n").split("\n")
    out, skipping = [], False
    for ln in lines:
        if ln.startswith(HEADER_FIELD + ":"):
            skipping = True
            continue
        if skipping and ln[:1] in (" ", "\t"):
            continue
        skipping = False
        out.append(ln)
    out.append(f"{HEADER_FIELD}: {commit}")
    return "\n".join(out) + "\n"


def _diff_sections(repo: Path, a: str, b: str, paths: list[str]) -> dict[str, str]:
    proc = _git(repo, "diff", "--no-color", "--full-index", "-U3", "--no-renames", "--no-ext-diff", "--no-textconv",
                "--src-prefix=a/", "--dst-prefix=b/", a, b, "--", *paths)
    text = proc.stdout.decode("utf-8")
    out = {}
    for chunk in re.split(r"(?m)^(?=diff --git )", text):
        m = re.match(r"diff --git a/(\S+) b/", chunk)
        if m:
            out[m.group(1)] = chunk  # git ends every line with a newline, the last one too
    return out


def replay(series: Series, pin_files: dict[str, bytes | None], rev_files: dict[str, bytes | None], commit: str,
           *, modes: dict[str, str] | None = None, resolved: dict[str, dict[str, bytes]] | None = None,
           log=lambda m: None) -> Replay:
    """Apply `series` (made on the pin's `pin_files`) three-way to `rev_files` (the same paths at `commit`).
    `resolved` ({patch: {path: content}}, a maintainer's resolution of an earlier run's conflict files) is
    taken as that patch's result for a file that conflicts: the file is "resolved" and the replay goes on."""
    resolved = resolved or {}
    steps = walk(series, pin_files)  # the base of every index line; raises when the series is broken on the pin
    touched = sorted(set(pin_files) | set(rev_files))
    label = f"upstream {commit[:12]}"
    with locks.owned_tempdir(locks.scratch_parent(), "h3kit-rebase-") as tmp:
        repo, scratch = tmp / "queue", tmp / "scratch"
        repo.mkdir()
        scratch.mkdir()
        commits = [_queue_repo(repo, touched, rev_files, commit, steps)]
        results: list[PatchResult] = []
        for st in steps:
            pfile = tmp / "current.patch"
            pfile.write_text(_patch_text(st))
            state, files = _apply_step(repo, scratch, pfile, st, label, resolved)
            _git(repo, "commit", "-q", "--allow-empty", "-m", st.patch.name)
            commits.append(_git(repo, "rev-parse", "HEAD").stdout.decode().strip())
            results.append(PatchResult(st.patch.name, state, files))
            log(f"{st.patch.name}: {state}")
        after = {rel: _read(repo, rel) for rel in touched}
        texts: dict[str, str] = {}
        if not any(r.state == "conflict" for r in results):
            texts = _refreshed_texts(repo, steps, commits, modes or {}, commit)
    return Replay(commit, results, after, texts)


def _queue_repo(repo: Path, touched: list[str], rev_files: dict[str, bytes | None], commit: str, steps) -> str:
    """A scratch repository holding `rev_files` as its first commit (returned) and every base blob an index line
    of the series names, so that --3way finds it."""
    _git(repo, "init", "-q")
    for rel in touched:
        _write(repo, rel, rev_files.get(rel))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "--allow-empty", "-m", f"upstream {commit}")
    blobs = {st.before[s.path] for st in steps for s in st.patch.sections if st.before.get(s.path) is not None}
    for data in blobs:
        _git(repo, "hash-object", "-w", "--stdin", input=data)
    return _git(repo, "rev-parse", "HEAD").stdout.decode().strip()


def _apply_step(repo: Path, scratch: Path, pfile: Path, st, label: str, resolved: dict) -> tuple[str, list]:
    """Apply one patch of the series to the queue's index: plainly, else three-way; (its state, its files)."""
    patch = st.patch
    before = {s.path: _read(repo, s.path) for s in patch.sections}
    if _git(repo, "apply", "--check", "--whitespace=nowarn", str(pfile), check=False).returncode == 0:
        _git(repo, "apply", "--index", "--whitespace=nowarn", str(pfile))
        return "clean", [FileResult(s.path, "clean", [HunkResult(h.header, "clean") for h in s.hunks])
                         for s in patch.sections]
    proc = _git(repo, "apply", "--3way", "--whitespace=nowarn", str(pfile), check=False)
    unmerged = set(_git(repo, "diff", "--name-only", "--diff-filter=U").stdout.decode().split())
    err = proc.stderr.decode(errors="replace")
    if proc.returncode != 0 and not unmerged:
        # nothing merged and nothing marked: a file the patch needs is missing, or one it adds exists
        _git(repo, "reset", "-q", "--hard")
        files = [FileResult(s.path, "conflict", message=_file_message(s, before.get(s.path), err))
                 for s in patch.sections if _file_message(s, before.get(s.path), err)]
        if not files:
            raise RebaseError(f"{patch.name}: git apply --3way failed: {err.strip()[-600:]}")
        return "conflict", files
    files = []
    for s in patch.sections:
        if s.new_file or s.deleted_file:
            files.append(_whole_file(repo, s, before, unmerged, label, patch.name, err))
            continue
        files.append(_merged_file(repo, scratch, st, s, before, unmerged, label, resolved))
    return ("conflict" if any(f.state == "conflict" for f in files) else "merged"), files


def _whole_file(repo: Path, s: Section, before: dict, unmerged: set, label: str, patch_name: str,
                err: str) -> FileResult:
    """A file the patch adds or deletes, in a three-way apply. Unmerged (upstream added the same file: git merges
    the two as add/add; a deletion never merges three-way and fails the apply before), it is a conflict with git's
    markers, and upstream's file stays in the queue for the patches after it."""
    if s.path not in unmerged:
        return FileResult(s.path, "clean")
    marked = _relabel(_read(repo, s.path), label, patch_name)
    _write(repo, s.path, before[s.path])
    _git(repo, "add", "--", s.path)
    return FileResult(s.path, "conflict", message=_file_message(s, before[s.path], err), marked=marked)


def _merged_file(repo: Path, scratch: Path, st, s: Section, before: dict, unmerged: set, label: str,
                 resolved: dict) -> FileResult:
    """One file of a three-way apply, hunk by hunk; an unmerged one gets its markers, or the maintainer's
    resolution when `resolved` has one."""
    patch = st.patch
    hunks, partial = classify(s, st.before[s.path], before[s.path], scratch, label, patch.name)
    fstate = ("conflict" if s.path in unmerged or any(h.state == "conflict" for h in hunks)
              else "merged" if any(h.state == "merged" for h in hunks) else "clean")
    fr = FileResult(s.path, fstate, hunks)
    if s.path in unmerged:
        fr.marked = _relabel(_read(repo, s.path), label, patch.name)
        mine = resolved.get(patch.name, {}).get(s.path)
        if mine is not None:
            if _conflict_regions(mine) or b"\n=======\n" in mine:
                raise UsageError(f"the resolution of {patch.name}: {s.path} still holds conflict "
                                 "markers", code="unresolved",
                                 hint="edit the file until no <<<<<<< / ======= / >>>>>>> is left")
            fr.state, fr.marked, partial = "resolved", None, mine
            for h in fr.hunks:
                h.state = "resolved" if h.state == "conflict" else h.state
        _write(repo, s.path, partial)
        _git(repo, "add", "--", s.path)
    return fr


def _refreshed_texts(repo: Path, steps, commits: list[str], modes: dict[str, str], commit: str) -> dict[str, str]:
    """{patch name: its text made again from the queue's commits, its header naming `commit`}."""
    texts: dict[str, str] = {}
    for i, st in enumerate(steps):
        diffs = _diff_sections(repo, commits[i], commits[i + 1], st.patch.files)
        sections = []
        for s in st.patch.sections:
            if s.new_file:
                sections.append(s.text)
            elif s.path in diffs:
                text = diffs[s.path]
                if s.path in modes and modes[s.path] != DEFAULT_MODE:
                    text = text.replace(f" {DEFAULT_MODE}\n", f" {modes[s.path]}\n", 1)
                sections.append(text)
            else:  # upstream already holds this change: the section would be empty
                raise RebaseError(f"{st.patch.name}: {s.path}: upstream {commit[:12]} already has this change",
                                  code="rebase_empty", hint="drop the section (or the patch) from the series")
        texts[st.patch.name] = render_patch(header_with_commit(st.patch.header_text, commit), sections)
    return texts


def _relabel(marked: bytes | None, ours: str, theirs: str) -> bytes | None:
    """git apply --3way's markers name "ours" and "theirs": name upstream's commit and the patch instead."""
    if marked is None:
        return None
    return re.sub(rb"(?m)^>>>>>>> theirs$", b">>>>>>> " + theirs.encode(),
                  re.sub(rb"(?m)^<<<<<<< ours$", b"<<<<<<< " + ours.encode(), marked))


def _file_message(sec: Section, current: bytes | None, stderr: str) -> str:
    if sec.new_file and current is not None:
        return f"upstream already has {sec.path}, which this patch adds"
    if not sec.new_file and current is None:
        return f"upstream has no {sec.path}, which this patch changes"
    if sec.path in stderr:
        return f"git apply --3way: {stderr.strip().splitlines()[-1][:300]}"
    return ""


__all__ = ["replay", "Replay", "PatchResult", "FileResult", "HunkResult", "RebaseError", "classify",
           "header_with_commit", "HEADER_FIELD"]


# --- h3kit patches rebase: clone, replay, write the refreshed series and the report -----------------------

REPORT_JSON = "report.json"
REPORT_TEXT = "report.txt"
CONFLICTS_DIR = "conflicts"
VERSION_FILE = "comfyui_version.py"  # upstream writes __version__ there at each release


def _resolve(tree: Path, source: str, rev: str) -> str:
    """`rev` as install --commit resolves it (gitutil.resolve_revision), a prefix completed in the clone."""
    commit = gitutil.resolve_revision(source, rev, "--onto")
    proc = gitutil.run(["rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"], tree, check=False)
    if proc.returncode != 0:
        raise UsageError(f"--onto {rev!r}: the source holds no commit {commit}", code="no_such_revision",
                         hint="give a commit id, tag or branch the source holds (git ls-remote SOURCE)")
    return proc.stdout.strip()


def _upstream_data(tree: Path, commit: str, data: dict) -> dict:
    up = dict(data["upstream"])
    up["commit"] = commit
    describe = gitutil.run(["describe", "--tags", "--always", commit], tree, check=False).stdout.strip()
    version_file = (gitutil.read_blobs(tree, commit, [VERSION_FILE])[VERSION_FILE] or b"").decode(errors="replace")
    # git describe needs tags, which a mirror may lack; upstream writes __version__ at each release
    m = re.match(r"^v?(\d+\.\d+\.\d+)", describe) or re.search(r"__version__\s*=\s*[\"'](\d+\.\d+\.\d+)",
                                                                  version_file)
    if m:
        up["version"] = m.group(1)
    tagged = describe and not commit.startswith(describe)
    up["describe"] = describe if tagged else f"{up.get('version', '?')}+{commit[:8]}"
    up["date"] = gitutil.run(["show", "-s", "--format=%cs", commit], tree).stdout.strip()
    return up


def render_report(rep: Replay, pin: str) -> str:
    c = rep.counts()
    lines = [f"h3kit patches rebase: the series from {pin[:12]} onto {rep.commit}",
             f"{c['clean']} clean, {c['merged']} merged three-way, {c['conflict']} conflicting", ""]
    for p in rep.patches:
        lines.append(f"{p.state:8} {p.name}")
        for f in p.files:
            if f.state == "clean":
                continue
            lines.append(f"         {f.state:8} {f.path}" + (f": {f.message}" if f.message else ""))
            for h in f.hunks:
                lines.append(f"           {h.state:8} {h.header}")
                lines += [f"             | {ln}" for ln in h.conflict]
    if rep.conflicts:
        lines += ["", f"The files with conflict markers are under {CONFLICTS_DIR}/<patch>/<path>: resolve them in "
                  "trees of your own (docs/upstream.md), then paste the sections with h3kit patches diff."]
    return "\n".join(lines) + "\n"


def read_resolutions(folder: Path, series: Series) -> dict[str, dict[str, bytes]]:
    """{patch: {path: content}} from `folder`/<patch>/<path> (an earlier run's conflicts/ folder, resolved)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"--resolved {folder} is not a folder",
                         hint="give the conflicts/ folder of an earlier rebase, its files resolved")
    out: dict[str, dict[str, bytes]] = {}
    for name in series.names:
        pdir = folder / name
        if pdir.is_dir():
            for f in sorted(pdir.rglob("*")):
                if f.is_file():
                    out.setdefault(name, {})[f.relative_to(pdir).as_posix()] = f.read_bytes()
    if not out:
        raise UsageError(f"--resolved {folder} holds no <patch>/<path> file of this series",
                         hint="give the conflicts/ folder of an earlier rebase, its files resolved")
    return out


def rebase_onto(root: Path, data: dict, series: Series, onto: str, source: str, out: Path, *, progress=False,
                resolved: dict[str, dict[str, bytes]] | None = None, log=lambda m: None) -> tuple[Replay, dict]:
    """Clone `source`, replay the series onto `onto`, and write into `out` (which must be new or empty) the
    report and either the refreshed series (patches/, source_deps_info.json) or the conflicting files.
    Returns the replay and the report's document."""
    import json

    from h3kit import manifest

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} exists and is not an empty folder",
                          hint="give --out a new or empty folder (the report and the refreshed series go there)")
    pin = manifest.pin(data)
    rep, rev_files, upstream = _clone_and_replay(data, series, onto, source, pin, progress=progress,
                                                 resolved=resolved, log=log)
    doc = {**rep.to_dict(), "pin": pin, "source": source, "out": str(out)}
    out.mkdir(parents=True, exist_ok=True)
    if rep.ok:
        written = _write_series(out, data, series, rep, rev_files, upstream)
    else:
        written = _write_conflicts(out, rep)
    doc["written"] = written + [REPORT_JSON, REPORT_TEXT]
    doc["upstream"] = upstream
    (out / REPORT_JSON).write_text(json.dumps(doc, indent=2) + "\n")
    (out / REPORT_TEXT).write_text(render_report(rep, pin))
    return rep, doc


def _clone_and_replay(data: dict, series: Series, onto: str, source: str, pin: str, *, progress, resolved, log):
    """Clone `source` into a scratch folder and replay the series onto `onto` there; (the replay, the touched
    files at the new commit, the manifest's upstream section for it)."""
    touched = series.touched_files()
    with locks.owned_tempdir(locks.scratch_parent(), "h3kit-rebase-clone-") as tmp:
        tree = tmp / "upstream"
        log(f"cloning {source} (no checkout) ...")
        gitutil.clone_no_checkout(source, tree, progress=progress)
        commit = _resolve(tree, source, onto)
        if not gitutil.has_commit(tree, pin):
            raise RebaseError(f"{source} does not hold the pin {pin[:12]} the series was made on", code="pin_missing",
                              hint="use a mirror that holds both the pin and the new commit")
        log(f"checking out {commit[:12]} ...")
        missing = gitutil.checkout_detached(tree, commit)
        known = set(data["upstream"].get("absent_from_mirrors", []))
        if [m for m in missing if m in touched]:
            raise RebaseError("the source lacks files the series changes: " + ", ".join(m for m in missing if m in touched),
                              code="incomplete_source", hint="use a complete mirror of ComfyUI")
        for m in missing:
            log(f"warning: the source lacks {m}" + (" (known, H3 does not use it)" if m in known else ""))
        pin_files = gitutil.read_blobs(tree, pin, touched)
        rev_files = gitutil.read_blobs(tree, commit, touched)
        modes = gitutil.read_modes(tree, commit, touched)
        log(f"applying {len(series.patches)} patches three-way onto {commit[:12]} ...")
        rep = replay(series, pin_files, rev_files, commit, modes=modes, resolved=resolved, log=lambda m: log("  " + m))
        return rep, rev_files, _upstream_data(tree, commit, data)


def _write_series(out: Path, data: dict, series: Series, rep: Replay, rev_files: dict, upstream: dict) -> list[str]:
    """A clean replay's refreshed series (patches/, with src/) and manifest under `out`; what was written."""
    import json

    from h3kit import manifest
    from h3kit.patches import manifest_entries

    pdir = out / "patches"
    pdir.mkdir()
    (pdir / "series").write_bytes((series.patches_dir / "series").read_bytes())
    for name, text in rep.texts.items():
        (pdir / name).write_text(text)
    if series.src_dir.is_dir():
        import shutil

        shutil.copytree(series.src_dir, pdir / "src", ignore=shutil.ignore_patterns("__pycache__"))
    new_series = Series.load_dir(pdir, out)
    new_data = dict(data)
    new_data["upstream"] = upstream
    new_data["patches"] = manifest_entries(new_series, rev_files)
    (out / manifest.MANIFEST_NAME).write_text(json.dumps(new_data, indent=2) + "\n")
    return ["patches/", "source_deps_info.json"]


def _write_conflicts(out: Path, rep: Replay) -> list[str]:
    """Each conflicting file, with its markers, under `out`/conflicts/<patch>/<path>; what was written."""
    written = []
    for p in rep.conflicts:
        for f in p.files:
            if f.marked is not None:
                dest = out / CONFLICTS_DIR / p.name / f.path
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(f.marked)
                written.append(dest.relative_to(out).as_posix())
    return written


def write_into_checkout(root: Path, out: Path) -> list[str]:
    """Copy a clean rebase's series and manifest from `out` over the checkout's (all or nothing)."""
    from h3kit.patches import read_tree_files, write_tree_files

    names = [f.name for f in sorted((out / "patches").glob("*.patch"))] + ["series"]
    rels = [f"patches/{n}" for n in names] + ["source_deps_info.json"]
    after = {rel: (out / rel).read_bytes() for rel in rels}
    return write_tree_files(root, read_tree_files(root, rels), after)
