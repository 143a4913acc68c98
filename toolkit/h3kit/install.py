"""Install, verify and revert: the pinned ComfyUI checkout, the patch series and the shipped files.

install  clone (or reuse) the checkout at the pin, check the interpreter, check every patch, then write the
         patched files and the shipped files in one all-or-nothing step and record what was written.
verify   recompute what the series produces from the pin's blobs and compare it with the tree.
revert   reverse the series and remove the shipped files the user did not edit.

State lives in <comfy-home>/.h3kit/: state.json (pin, interpreter, patches with sha256, installed files with
sha256) and applied-patches/ (the patch files as applied, so a newer h3kit can reverse an older series).

Install and revert hold the tree lock (h3kit.locks) and write through a journal (h3kit.journal): state.json
and applied-patches/ are written in the same journaled step as the tree's files, so a run killed at any
point is finished or rolled back by the next install, revert or verify, and a command that would change
nothing writes nothing at all.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from h3kit import gitutil, journal, locks, manifest, modelpaths, pyenv, testhooks
from h3kit.errors import H3kitError, NotAComfyTree, UsageError
from h3kit.patches import PatchConflict, Series, plan_forward, plan_reverse, read_tree_files, series_result, write_tree_files
from h3kit.paths import repo_root

STATE_DIR = ".h3kit"
STATE_FILE = "state.json"
APPLIED_DIR = "applied-patches"
RUNTIME_DIR = "run"
WORKFLOW_DEST = "user/default/workflows/h3kit"
SOURCE_ENV = "H3KIT_COMFY_SOURCE"


class InstallError(H3kitError):
    code = "install"


class InstallRefused(H3kitError):
    code = "install_refused"


Log = "callable[[str], None]"


def _nolog(msg: str) -> None:
    pass


# --- state --------------------------------------------------------------------------------------------

def state_path(home: Path) -> Path:
    return home / STATE_DIR / STATE_FILE


def load_state(home: Path) -> dict | None:
    path = state_path(home)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise InstallError(f"{path} is not valid JSON ({e})", hint="remove it and run h3kit install --force") from None


def _state_files(home: Path, state: dict | None, series: Series | None) -> tuple[dict, dict]:
    """(before, after) of the files under .h3kit/ that record the install: state.json and applied-patches/.
    `state` None: they are removed (revert)."""
    sdir = home / STATE_DIR
    rel_state = f"{STATE_DIR}/{STATE_FILE}"
    before: dict[str, bytes | None] = {rel_state: _read_file(sdir / STATE_FILE)}
    applied = sdir / APPLIED_DIR
    if applied.is_dir():
        for f in sorted(applied.iterdir()):
            if f.is_file():
                before[f"{STATE_DIR}/{APPLIED_DIR}/{f.name}"] = _read_file(f)
    after: dict[str, bytes | None] = {rel: None for rel in before}
    if state is not None:
        after[rel_state] = (json.dumps(state, indent=2) + "\n").encode()
        for p in series.patches:
            after[f"{STATE_DIR}/{APPLIED_DIR}/{p.name}"] = p.raw
        after[f"{STATE_DIR}/{APPLIED_DIR}/series"] = "".join(n + "\n" for n in series.names).encode()
    for rel in after:
        before.setdefault(rel, _read_file(home / rel))
    return before, after


def _read_file(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def _journaled_write(home: Path, op: str, before: dict, after: dict, modes: dict | None = None) -> list[str]:
    """Write `after` over `before` through the journal (see h3kit.journal); the changed paths."""
    changed = [p for p in after if after[p] != before.get(p)]
    if not changed:
        return []
    try:
        journal.begin(home, op, before, after, modes)
        write_tree_files(home, before, after, modes)
    except OSError as e:  # write_tree_files has restored what it could, and says what it could not
        lost = getattr(e, "h3kit_not_restored", [])
        if not lost:
            journal.finish(home)
        outcome = ("every file was restored" if not lost else
                   "these files could not be restored and differ from before: " + ", ".join(lost)
                   + " (the next h3kit install or revert puts them back from the journal)")
        raise InstallError(f"could not write {e.filename or 'the tree'}: {e.strerror or e}; {outcome}",
                           code="write_failed", hint="check the folder's permissions and free space",
                           details={"not_restored": lost}) from None
    except BaseException as e:
        if not getattr(e, "h3kit_not_restored", None):
            journal.finish(home)  # interrupted (Ctrl-C, SIGTERM): every file is back as it was
        raise
    testhooks.point("files-written")
    journal.finish(home)
    return sorted(changed)


def _exclude_state_dir(home: Path) -> None:
    exclude = home / ".git" / "info" / "exclude"
    try:
        text = exclude.read_text() if exclude.exists() else ""
        if "/.h3kit/" not in text.splitlines():
            exclude.parent.mkdir(parents=True, exist_ok=True)
            with exclude.open("a") as f:
                f.write(("" if text.endswith("\n") or not text else "\n")
                        + "# h3kit install state and runtime files\n/.h3kit/\n")
    except OSError:
        return  # only keeps `git status` quiet about .h3kit/: not worth failing an install for


def _applied_series(home: Path) -> Series | None:
    """The series as it was applied by the last install (None when no copy was kept)."""
    applied = home / STATE_DIR / APPLIED_DIR
    if not (applied / "series").is_file():
        return None
    try:
        return Series.load_dir(applied)
    except H3kitError:
        return None


def _recover(home: Path) -> dict | None:
    """Finish or roll back a write an earlier h3kit run did not complete (the caller holds the tree lock)."""
    rec = journal.recover(home) if home.is_dir() else None
    return rec.to_dict() if rec is not None else None


def _fs_error(e: OSError, what: str) -> InstallError:
    reason = {errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
              errno.EPERM: "permission denied", errno.ENOSPC: "no space left on the device",
              errno.ENOTDIR: "a part of the path is a file, not a folder"}.get(e.errno, e.strerror or str(e))
    return InstallError(f"cannot {what}: {reason} ({e.filename or ''})".replace(" ()", ""), code="write_failed",
                        hint="choose a folder you can write to, or fix its permissions")


# --- what install ships -----------------------------------------------------------------------------

def shipped_files(root: Path) -> dict[str, Path]:
    """{destination relative to the comfy home: source file} for everything install copies."""
    out: dict[str, Path] = {}
    extra = root / "additional_files"
    if extra.is_dir():
        for src in sorted(extra.rglob("*")):
            if src.is_file() and "__pycache__" not in src.parts and src.name != ".gitkeep":
                out[src.relative_to(extra).as_posix()] = src
    for src in sorted((root / "workflows").glob("*.json")):
        out[f"{WORKFLOW_DEST}/{src.name}"] = src
    launch = root / "launch"
    if launch.is_dir():
        for src in sorted(launch.iterdir()):
            if src.is_file():
                out[f"{STATE_DIR}/{RUNTIME_DIR}/{src.name}"] = src
    return out


def resolve_source(source: str | None, data: dict) -> str:
    return source or os.environ.get(SOURCE_ENV) or data["upstream"]["url"]


# --- bytecode -----------------------------------------------------------------------------------------

def _bytecode_dirs(home: Path, rel_paths: list[str]) -> set[Path]:
    return {(home / rel).parent / "__pycache__" for rel in rel_paths if rel.endswith(".py")}


def purge_bytecode(home: Path, rel_paths: list[str]) -> list[str]:
    removed = []
    for d in sorted(_bytecode_dirs(home, rel_paths)):
        if d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.relative_to(home).as_posix())
    return removed


def stale_bytecode(home: Path, rel_paths: list[str]) -> list[str]:
    """.pyc files under the touched folders that do not match their source (or whose source is gone)."""
    stale = []
    for d in sorted(_bytecode_dirs(home, rel_paths)):
        if not d.is_dir():
            continue
        for pyc in sorted(d.glob("*.pyc")):
            src = d.parent / (pyc.name.split(".", 1)[0] + ".py")
            rel = pyc.relative_to(home).as_posix()
            if not src.is_file():
                stale.append(f"{rel} (its source is gone)")
                continue
            head = pyc.read_bytes()[:16]
            if len(head) < 16:
                stale.append(f"{rel} (truncated)")
                continue
            flags = struct.unpack("<I", head[4:8])[0]
            if flags & 1:  # hash-based pyc: checked against the source hash by the interpreter itself
                continue
            mtime, size = struct.unpack("<II", head[8:16])
            st = src.stat()
            if mtime != (int(st.st_mtime) & 0xFFFFFFFF) or size != (st.st_size & 0xFFFFFFFF):
                stale.append(f"{rel} (compiled from another version of {src.name})")
    return stale


# --- install --------------------------------------------------------------------------------------------

@dataclass
class InstallOptions:
    comfy_home: Path
    source: str | None = None
    commit: str | None = None
    python: str | None = None
    force: bool = False
    dry_run: bool = False
    progress: bool = False
    models_dirs: list[str] | None = None  # None: keep the folders the last install recorded


@dataclass
class InstallReport:
    comfy_home: str
    source: str
    pin: str
    dry_run: bool
    cloned: bool = False
    patches: list[dict] = field(default_factory=list)
    files: dict[str, list[str]] = field(default_factory=lambda: {"installed": [], "updated": [], "unchanged": [],
                                                                 "kept": [], "overwritten": [], "removed": []})
    changed: list[str] = field(default_factory=list)
    drift: list[dict] = field(default_factory=list)
    discarded_edits: list[str] = field(default_factory=list)
    purged_bytecode: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    python: dict = field(default_factory=dict)
    pin_verified: bool = True
    recovered: dict | None = None
    models_dirs: list[str] = field(default_factory=list)
    python_packages: int = 0
    merge: dict | None = None  # off the pin: {"onto", "base", "patches": [{"patch", "how": "plain"|"3-way"}]}
    requested: str | None = None  # --commit as given (a tag, branch or prefix); pin is the commit it resolved to

    def to_dict(self) -> dict:
        return {"ok": True, **self.__dict__}


CLONE_PREFIX = "h3kit-clone-"


def _clone_prefix(home: Path) -> str:
    """The temporary clone folders of `home` sit beside it: `.NAME.h3kit-clone-*`."""
    return f".{home.name}.{CLONE_PREFIX}"


def _is_fresh(home: Path) -> bool:
    """Nothing installed here yet: the folder is missing, empty, or holds only h3kit's own .h3kit/ (its lock,
    a journal) without an install state."""
    if not home.exists():
        return True
    if not home.is_dir():
        return False
    names = {p.name for p in home.iterdir()}
    return names <= {STATE_DIR} and not state_path(home).exists()


def _clone_into(home: Path, source: str, pin: str, data: dict, report: InstallReport, opts: InstallOptions,
                log, moved: list[str]) -> None:
    """Clone into a temporary sibling owned by this run (a killed run's is swept by the next), check out the
    pin there, then move the entries into the home under a "clone" journal, `.git` last: the home holds a
    checkout only once every file is in place."""
    with locks.owned_tempdir(home.parent, _clone_prefix(home)) as tmp:
        tree = tmp / "tree"
        log(f"cloning {source} (no checkout) ...")
        gitutil.clone_no_checkout(source, tree, progress=opts.progress)
        if not gitutil.has_commit(tree, pin):
            raise InstallError(f"{source} does not hold the commit {pin}", code="pin_missing",
                               hint="use a mirror that holds the pin (--source or H3KIT_COMFY_SOURCE)")
        log(f"checking out {pin[:12]} ...")
        missing = gitutil.checkout_detached(tree, pin)
        _judge_missing(missing, data, report)
        testhooks.point("clone-made")
        entries = sorted((p.name for p in tree.iterdir()), key=lambda n: n == ".git")
        if STATE_DIR in entries:
            raise InstallError(f"{source} holds a {STATE_DIR} folder, which h3kit keeps its state in",
                               code="incomplete_source", hint="use a plain mirror of ComfyUI")
        journal.begin_clone(home, entries)
        for name in entries:
            os.rename(tree / name, home / name)
            moved.append(name)  # what install() removes again if this run fails
            testhooks.point("clone-moving")
        journal.finish(home)
        testhooks.point("clone-moved")


def _prepare_checkout(opts: InstallOptions, source: str, pin: str, data: dict, report: InstallReport, log,
                      moved: list[str], precheck=None) -> Path | None:
    """Return the checkout to patch (None in a dry run that would clone). A fresh home is cloned into (see
    _clone_into); a failed clone leaves the home as it was."""
    home = opts.comfy_home
    if _is_fresh(home):
        if opts.dry_run:
            log(f"would clone {source} into {home} and check out {pin[:12]}")
            report.cloned = True
            return None
        _clone_into(home, source, pin, data, report, opts, log, moved)
        report.cloned = True
        return home
    if not home.is_dir() or not gitutil.is_checkout(home):
        raise InstallRefused(f"{home} exists, is not empty and is not a git checkout of ComfyUI",
                             hint="choose an empty or new folder for --comfy-home")
    head = gitutil.head(home)
    if head != pin:
        if not opts.force:
            state = load_state(home) or {}
            how = (" (installed with --commit)" if state.get("pin") == head and state.get("pin_verified") is False
                   else "")
            raise InstallRefused(f"{home} is at commit {head[:12]}{how}, not the pin {pin[:12]}",
                                 hint="use a new folder, or --force to check out the pin here (local changes to "
                                      "tracked files are discarded)")
        if opts.dry_run:
            log(f"would check out {pin[:12]} (now at {head[:12]})")
            return home
        if not gitutil.has_commit(home, pin):
            log(f"fetching {pin[:12]} from {source} ...")
            gitutil.fetch_commit(home, source, pin)
        if precheck is not None:  # a series that conflicts with the commit refuses before the checkout moves
            precheck(home)
        log(f"checking out {pin[:12]} (was {head[:12]}) ...")
        _judge_missing(gitutil.checkout_detached(home, pin, force=True), data, report)
    else:
        absent = [p for code, p in gitutil.status(home) if code.strip() == "D"]
        _judge_missing(absent, data, report, only_known=True)
    return home


def _judge_missing(missing: list[str], data: dict, report: InstallReport, only_known=False) -> None:
    known = set(data["upstream"].get("absent_from_mirrors", []))
    expected = [p for p in missing if p in known]
    if expected:
        report.warnings.append("the source lacks these upstream files, which H3 does not use; they stay absent: "
                               + ", ".join(expected))
    other = [p for p in missing if p not in known]
    if other and not only_known:
        raise InstallError("the source lacks files the checkout needs: " + ", ".join(other[:10]),
                           code="incomplete_source", hint="use a complete mirror of ComfyUI")


def _shipped_plan(home: Path, root: Path, state: dict | None, force: bool, report: InstallReport):
    """before/after/modes for the shipped files, filling report.files."""
    recorded = (state or {}).get("files", {})
    shipped = shipped_files(root)
    before: dict[str, bytes | None] = {}
    after: dict[str, bytes | None] = {}
    modes: dict[str, int] = {}
    for rel, src in shipped.items():
        new = src.read_bytes()
        dest = home / rel
        cur = dest.read_bytes() if dest.is_file() else None
        before[rel] = cur
        modes[rel] = 0o755 if os.access(src, os.X_OK) else 0o644
        if cur is None:
            after[rel] = new
            report.files["installed"].append(rel)
        elif cur == new:
            after[rel] = cur
            report.files["unchanged"].append(rel)
        elif recorded.get(rel) == manifest.sha256_bytes(cur):
            after[rel] = new
            report.files["updated"].append(rel)
        elif force:
            after[rel] = new
            report.files["overwritten"].append(rel)
        else:
            after[rel] = cur
            report.files["kept"].append(rel)
    for rel, sha in recorded.items():
        if rel in shipped:
            continue
        dest = home / rel
        cur = dest.read_bytes() if dest.is_file() else None
        before[rel] = cur
        if cur is not None and manifest.sha256_bytes(cur) == sha:
            after[rel] = None
            report.files["removed"].append(rel)
        else:
            after[rel] = cur
            if cur is not None:
                report.files["kept"].append(rel)
    if report.files["kept"]:
        report.warnings.append("kept files you edited (install --force overwrites them): " + ", ".join(report.files["kept"]))
    return before, after, modes


def _models_plan(home: Path, root: Path, state: dict | None, models_dirs: list[str] | None, report: InstallReport):
    """before/after of extra_model_paths.yaml with h3kit's section for the models folders (the recorded ones
    when `models_dirs` is None); untouched (empty dicts) when there is no section to write or remove."""
    dirs = list((state or {}).get("models_dirs") or []) if models_dirs is None else models_dirs
    report.models_dirs = dirs
    path = home / modelpaths.CONFIG
    if not dirs and not modelpaths.block_in(home):
        return {}, {}
    current = _read_file(path)
    for d in dirs:
        if not os.path.isdir(d):
            report.warnings.append(f"models folder {d} does not exist (yet): ComfyUI finds no model there until "
                                   "it does (a shared disk not mounted?)")
        elif not any(os.path.isdir(os.path.join(d, kind)) for kind in modelpaths.KINDS):
            report.warnings.append(f"models folder {d} has none of {', '.join(k + '/' for k in modelpaths.KINDS)}")
    merged = modelpaths.merge(current, modelpaths.read_template(root), dirs)
    return {modelpaths.CONFIG: current}, {modelpaths.CONFIG: merged}


def check_home_path(home: Path, flag: str = "--comfy-home") -> None:
    """A home that is a file, or lies under one, is bad input (not an internal error later)."""
    probe = home
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        where = "is a file" if probe == home else f"goes through {probe}, which is a file"
        raise UsageError(f"{flag} {home} {where}, not a folder", code="not_a_folder",
                         hint=f"give {flag} a folder (it is created when missing)")


def install(opts: InstallOptions, log=_nolog) -> InstallReport:
    """Install as described in the module docstring; raises on any refusal or conflict, changing nothing."""
    home = opts.comfy_home = Path(opts.comfy_home).expanduser().absolute()
    check_home_path(home)
    if opts.models_dirs is not None:
        opts.models_dirs = modelpaths.check_dirs(opts.models_dirs)
    data = manifest.load()
    target = _target(opts, data)  # refused before anything is written or cloned
    created: list[Path] = []  # folders this run made for a fresh home: removed again if it fails
    if not opts.dry_run:
        probe = home
        while not probe.exists():
            created.append(probe)
            probe = probe.parent
        try:
            home.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _fs_error(e, f"create {home}") from None
    state_dir_existed = (home / STATE_DIR).exists()
    moved: list[str] = []  # the entries a clone of this run moved into the home
    try:
        with locks.tree_lock(home, create=not opts.dry_run, progress=log):
            recovered = None
            if opts.dry_run:
                if home.is_dir() and journal.pending(home) is not None:
                    raise InstallRefused("an interrupted h3kit write is pending in this tree",
                                         code="interrupted_write",
                                         hint="run h3kit install (without --dry-run) or h3kit revert: either "
                                              "finishes or rolls it back first")
            else:
                recovered = _recover(home)
                # a run killed after its clone was moved in leaves the emptied clone folder, and the home is
                # no longer fresh, so no clone of this run sweeps it: every install does
                locks.sweep(home.parent, _clone_prefix(home))
            fresh = _is_fresh(home)
            try:
                return _install(opts, log, recovered, data, target, moved)
            except BaseException:
                if fresh:  # a clone made by this run is part of what failed: leave the folder as it was
                    for name in moved:
                        p = home / name
                        if p.is_dir() and not p.is_symlink():
                            shutil.rmtree(p, ignore_errors=True)
                        else:
                            p.unlink(missing_ok=True)
                    journal.finish(home)
                # the lock file this run created goes too, unless a journal must stay for the next run
                if not state_dir_existed and not journal.journal_dir(home).exists():
                    shutil.rmtree(home / STATE_DIR, ignore_errors=True)
                raise
    except OSError as e:
        raise _fs_error(e, f"write {home}") from None
    finally:
        for d in created:  # deepest first; only while still empty (a failed run)
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()


def _starting_point(series: Series, old_series: Series | None, current: dict, pin_files: dict, expected: dict,
                    touched: list[str], force: bool, report: InstallReport) -> dict:
    """Where the tree stands, decided for the whole tree (patch state is per patch, not per file): the files to
    apply the series to. The series on top of what is there (fresh, partly or fully applied); else the pin,
    when the tree holds an older series (reversed wholesale); else local edits: refused without `force`, else
    restored from the pin (named in report.discarded_edits and report.drift)."""
    as_is = plan_forward(series, current)
    if not as_is.conflicts and as_is.after == expected_all(expected, pin_files, touched):
        return current
    try:
        old_expected = series_result(old_series, pin_files) if old_series is not None else None
    except PatchConflict:  # the applied series was made for another commit (a move off or back onto the pin)
        old_expected = None
    if old_expected is not None and all(current[f] == old_expected.get(f, pin_files[f]) for f in touched):
        return dict(pin_files)
    offending = [f for f in touched if current[f] not in (pin_files[f], expected.get(f, pin_files[f]))
                 and (old_expected is None or current[f] != old_expected.get(f, pin_files[f]))]
    for rel in offending:
        report.drift.append({"file": rel, "kind": "local",
                             "expected_base": manifest.git_blob_id(pin_files[rel]) if pin_files[rel] is not None else None,
                             "found": manifest.git_blob_id(current[rel]) if current[rel] is not None else None})
    if not force:
        raise InstallRefused("local edits to files the patches touch: " + ", ".join(offending or touched),
                             hint="commit or copy your edits elsewhere; install --force restores these files "
                                  "to the pin before patching",
                             details={"files": offending, "patches": [st.to_dict() for st in as_is.states],
                                      "drift": report.drift})
    report.discarded_edits = offending
    return dict(pin_files)


def _new_state(state: dict | None, report: InstallReport, target: _Target, source: str, python: str, root: Path,
               series: Series, f_after: dict, packages: list) -> dict:
    """The state.json this install leaves. A kept (user-edited) file stays recorded with the checksum of what
    h3kit installed, so that it keeps counting as edited on the next run instead of being taken for ours and
    overwritten; a file that was there before h3kit ever installed it is the user's alone: not recorded."""
    recorded = (state or {}).get("files", {})
    kept = set(report.files["kept"])
    files_sha = {rel: (recorded[rel] if rel in kept else manifest.sha256_bytes(data_))
                 for rel, data_ in f_after.items() if data_ is not None and (rel not in kept or rel in recorded)}
    new_state = {
        "schema": 1,
        "pin": report.pin,
        "pin_verified": report.pin_verified,
        "verified_pin": target.verified,
        "source": source,
        "python": python,
        "h3kit_root": str(root),
        "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "patches": [{"name": p.name, "sha256": manifest.sha256_bytes(p.raw)} for p in series.patches],
        "files": files_sha,
        "python_packages": packages,
    }
    if report.models_dirs:
        new_state["models_dirs"] = report.models_dirs
    if report.merge is not None:
        new_state["merge"] = report.merge
    if report.requested is not None:
        new_state["commit_requested"] = report.requested
    if state is not None and {k: v for k, v in state.items() if k != "installed_at"} == \
            {k: v for k, v in new_state.items() if k != "installed_at"}:
        new_state["installed_at"] = state.get("installed_at")  # nothing else changed: a no-op writes nothing
    return new_state


@dataclass(frozen=True)
class _Target:
    """The commit to install: the pin h3kit's series is verified on, or the one --commit --force named (`requested`:
    the word given, a tag, branch or commit prefix, resolved once against the source)."""
    verified: str
    commit: str
    requested: str | None = None

    @property
    def is_pin(self) -> bool:
        return self.commit == self.verified


def _target(opts: InstallOptions, data: dict) -> _Target:
    pin = manifest.pin(data)
    if not opts.commit:
        return _Target(pin, pin)
    commit = gitutil.resolve_revision(resolve_source(opts.source, data), opts.commit, "--commit")
    if pin.startswith(commit):
        return _Target(pin, pin, opts.commit)
    if not opts.force:
        named = commit[:12] if commit.startswith(opts.commit.lower()) else f"{opts.commit} ({commit[:12]})"
        raise InstallRefused(f"--commit {named} is not the pin {pin[:12]} that h3kit's patch series is "
                             "verified on", code="not_the_pin",
                             hint="leave --commit out; or add --force to install that commit anyway (it is "
                                  "recorded as not the verified pin, and verify checks the tree against it)")
    return _Target(pin, commit, opts.commit)


def _interpreter(opts: InstallOptions) -> str:
    """--python; else the interpreter the last install of this tree recorded (a re-run keeps it: h3kit's own
    interpreter may have no torch); else the one running h3kit."""
    if opts.python:
        return opts.python
    recorded = (load_state(opts.comfy_home) or {}).get("python") if opts.comfy_home.is_dir() else None
    return recorded if isinstance(recorded, str) and recorded else sys.executable


def merged_series(series: Series, home: Path, verified: str, commit: str, touched: list[str], folder: Path,
                  log=_nolog):
    """The series moved three-way onto `commit` (h3kit.rebase): (the refreshed series, written under `folder`,
    what it makes of the touched files, the merge record). Raises PatchConflict naming each conflicting hunk."""
    from h3kit import rebase

    if not gitutil.has_commit(home, verified):
        raise PatchConflict(f"the patch series does not apply to {commit[:12]} as it is, and the checkout lacks "
                            f"the pin {verified[:12]} a three-way merge needs",
                            hint="install from a source that holds the pin (--source or H3KIT_COMFY_SOURCE)")
    base = gitutil.read_blobs(home, verified, touched)
    at = gitutil.read_blobs(home, commit, touched)
    log(f"the series does not apply to {commit[:12]} as it is: merging it three-way ...")
    rep = rebase.replay(series, base, at, commit, modes=gitutil.read_modes(home, commit, touched))
    if not rep.ok:
        hunks = rep.conflicting_hunks()
        raise PatchConflict(f"the patch series conflicts with {commit[:12]} even three-way: "
                            + "; ".join(f"{h['patch']}: {h['file']}" + (f" hunk {h['hunk']}" if h["hunk"] else "")
                                        + f": {h['message']}" for h in hunks),
                            hint="the tree is as it was; h3kit patches rebase --onto COMMIT writes the conflicting "
                                 "files and the report (docs/upstream.md), or install the pin",
                            details={"conflicts": hunks, "patches": [p.to_dict() for p in rep.patches]})
    (folder / "series").write_text("".join(n + "\n" for n in series.names))
    for name, text in rep.texts.items():
        (folder / name).write_text(text)
    merge = {"onto": commit, "base": verified, "patches": [{"patch": p.name, "how": p.how} for p in rep.patches]}
    return Series.load_dir(folder, series.root), rep.after, merge


def _install(opts: InstallOptions, log, recovered: dict | None, data: dict, target: _Target,
             moved: list[str]) -> InstallReport:
    import contextlib

    with contextlib.ExitStack() as stack:
        return _install_in(opts, log, recovered, data, target, moved, stack)


def _install_in(opts: InstallOptions, log, recovered: dict | None, data: dict, target: _Target,
                moved: list[str], stack) -> InstallReport:
    root = repo_root()
    series = kit_series = Series.load(root)
    source = resolve_source(opts.source, data)
    pin = target.commit
    report = _new_report(opts, source, target, recovered)
    python, env = _checked_python(opts, data, report)

    home = _prepare_checkout(opts, source, pin, data, report, log, moved, _precheck(series, target, pin, log))
    if home is None:  # dry run before a clone: nothing to check patches against yet
        report.patches = [{"patch": n, "state": "apply", "failures": []} for n in series.names]
        report.files["installed"] = sorted(shipped_files(root))
        report.models_dirs = opts.models_dirs or []
        return report
    if len(pin) < 40:
        pin = report.pin = gitutil.resolve_commit(home, pin)

    touched = series.touched_files()
    old_series = _applied_series(home)
    if old_series is not None:
        touched = sorted(set(touched) | set(old_series.touched_files()))
    if not opts.dry_run:  # what a killed write left beside the files it was replacing
        recorded_files = list((load_state(home) or {}).get("files", {}))
        journal.remove_temporaries(home, touched + list(shipped_files(root)) + recorded_files + [modelpaths.CONFIG])
    pin_files = gitutil.read_blobs(home, pin, touched)
    current = read_tree_files(home, touched)
    _upstream_drift(series, data, pin_files, report)
    series, expected = _expected_files(kit_series, home, pin, pin_files, touched, target, report, stack, log)
    _plan_patches(series, old_series, current, pin_files, expected, touched, opts.force, report)

    state = load_state(home)
    f_before, f_after, modes = _shipped_plan(home, root, state, opts.force, report)
    m_before, m_after = _models_plan(home, root, state, opts.models_dirs, report)
    overlap = (set(f_after) | set(m_after)) & set(touched)
    if overlap:
        raise InstallError(f"shipped files collide with patched files: {sorted(overlap)}")

    new_state = _new_state(state, report, target, source, python, root, kit_series, f_after, env.packages or [])
    s_before, s_after = _state_files(home, new_state, series)
    before = {**current, **f_before, **m_before, **s_before}
    after = {**{k: expected.get(k, pin_files[k]) for k in touched}, **f_after, **m_after, **s_after}
    report.changed = sorted(p for p in after if after[p] != before.get(p))

    if opts.dry_run:
        return report

    if report.changed:
        log(f"applying {sum(s['state'] == 'apply' for s in report.patches)} of {len(series.patches)} patches, "
            f"writing {len(report.changed)} files ...")
    _journaled_write(home, "install", before, after, modes)
    if report.changed or stale_bytecode(home, touched + list(f_after)):
        report.purged_bytecode = purge_bytecode(home, touched + list(f_after))
    if report.changed:
        _exclude_state_dir(home)
    return report


def _new_report(opts: InstallOptions, source: str, target: _Target, recovered: dict | None) -> InstallReport:
    report = InstallReport(comfy_home=str(opts.comfy_home), source=source, pin=target.commit, dry_run=opts.dry_run,
                           pin_verified=target.is_pin, recovered=recovered, requested=target.requested)
    if recovered:
        report.warnings.append(journal.Recovery(**recovered).describe())
    if not report.pin_verified:
        report.warnings.append(f"installing commit {target.commit[:12]} (--commit --force): not the pin "
                               f"{target.verified[:12]} h3kit's patch series is verified on")
    return report


def _checked_python(opts: InstallOptions, data: dict, report: InstallReport):
    """(the interpreter ComfyUI will run with, pyenv's check of it), its findings in the report; raises for an
    interpreter that cannot run ComfyUI at the pin."""
    python = _interpreter(opts)
    env = pyenv.check(python, data, packages=True)
    report.python = env.to_dict()
    report.python_packages = len(env.packages or [])
    if env.errors:
        raise pyenv.PythonEnvError(f"{python} cannot run ComfyUI at the pin: " + "; ".join(env.errors),
                                   hint="give --python an interpreter with a supported Python and a matching "
                                        "torch / torch-npu pair (README, 'Environment')", details=env.to_dict())
    report.warnings += env.warnings
    return python, env


def _precheck(series: Series, target: _Target, pin: str, log):
    def precheck(tree: Path) -> None:
        """Off the pin in an existing tree: the series must take the commit (plainly or three-way) before the
        checkout moves anything, so that a conflict leaves the tree as it was."""
        if target.is_pin:
            return
        commit = gitutil.resolve_commit(tree, pin)
        touched = series.touched_files()
        try:
            series_result(series, gitutil.read_blobs(tree, commit, touched))
        except PatchConflict:
            with locks.owned_tempdir(locks.scratch_parent(), "h3kit-merged-series-") as folder:
                merged_series(series, tree, target.verified, commit, touched, folder, log)
    return precheck


def _upstream_drift(series: Series, data: dict, pin_files: dict, report: InstallReport) -> None:
    """Upstream drift into the report: the checkout's base blobs against the ones the series was made on."""
    for p in series.patches:
        entry = manifest.patch_entry(data, p.name) or {}
        for f in entry.get("files", []):
            found = manifest.git_blob_id(pin_files[f["path"]]) if pin_files.get(f["path"]) is not None else None
            if f.get("base_blob") != found:
                report.drift.append({"patch": p.name, "file": f["path"], "expected_base": f.get("base_blob"),
                                     "found": found, "kind": "upstream"})


def _expected_files(kit_series: Series, home: Path, pin: str, pin_files: dict, touched: list[str], target: _Target,
                    report: InstallReport, stack, log):
    """(the series install applies, what it makes of its touched files): h3kit's series applied plainly, or, off
    the pin (--commit --force) where that fails, merged three-way (the merge in the report)."""
    series = kit_series
    conflict = None
    try:
        expected = series_result(series, pin_files)
        if not target.is_pin:
            report.merge = {"onto": pin, "base": target.verified,
                            "patches": [{"patch": p.name, "how": "plain"} for p in series.patches]}
    except PatchConflict as e:
        conflict = e
    if conflict is not None and target.is_pin:
        raise PatchConflict(f"the patch series does not apply to {pin[:12]}: " + _describe(conflict.details),
                            hint="the upstream files differ from the ones the series was made for "
                                 "(see drift); install the pin from source_deps_info.json",
                            details={"patches": conflict.details, "drift": report.drift})
    if conflict is not None:  # off the pin (--commit --force): merge three-way where the plain apply fails
        folder = stack.enter_context(locks.owned_tempdir(locks.scratch_parent(), "h3kit-merged-series-"))
        try:
            series, merged, report.merge = merged_series(kit_series, home, target.verified, pin, touched, folder, log)
        except PatchConflict as e:
            e.details = {**(e.details or {}), "drift": report.drift}
            raise
        expected = {k: merged[k] for k in series.touched_files()}
    return series, expected


def _plan_patches(series: Series, old_series, current: dict, pin_files: dict, expected: dict, touched: list[str],
                  force: bool, report: InstallReport) -> None:
    """Each patch's state (apply, applied) into the report, checked against the series' result."""
    start = _starting_point(series, old_series, current, pin_files, expected, touched, force, report)
    plan = plan_forward(series, start)
    report.patches = [s.to_dict() for s in plan.states]
    if report.merge is not None:
        how = {m["patch"]: m["how"] for m in report.merge["patches"]}
        for entry in report.patches:
            entry["how"] = how.get(entry["patch"], "plain")
    if plan.conflicts or plan.after != expected_all(expected, pin_files, touched):
        raise InstallError("internal: the series' plan disagrees with its result", details=[st.to_dict() for st in plan.states])


def expected_all(expected: dict, pin_files: dict, touched: list[str]) -> dict:
    """What every touched file must hold after install (files only an older series touched: the pin)."""
    return {f: expected.get(f, pin_files[f]) for f in touched}


def _describe(details) -> str:
    parts = []
    for st in details or []:
        for f in st.get("failures", []):
            parts.append(f"{f['patch']}: {f['file']}" + (f" hunk {f['hunk']}" if f.get("hunk") else "")
                         + f": {f['message']}")
    return "; ".join(parts) or "conflict"


# --- verify ---------------------------------------------------------------------------------------------

def verify(comfy_home: Path) -> dict:
    import contextlib

    with contextlib.ExitStack() as stack:
        return _verify(comfy_home, stack)


def _verify(comfy_home: Path, stack) -> dict:
    home = Path(comfy_home).expanduser().absolute()
    data = manifest.load()
    root = repo_root()
    series = Series.load(root)
    problems: list[str] = []
    warnings: list[str] = []
    if not home.is_dir() or not gitutil.is_checkout(home):
        raise NotAComfyTree(home, "not a git checkout", hint=f"run h3kit install --comfy-home {home}")
    recovered = _verify_pending_write(home, problems, warnings)
    state = load_state(home)
    pin = manifest.pin(data)
    if state is None:
        problems.append("no install state (.h3kit/state.json): this tree was not installed by h3kit")
    elif state.get("pin_verified") is False and state.get("pin"):
        pin = state["pin"]  # installed with --commit --force: checked against what was installed
        asked = f"{state['commit_requested']} = " if state.get("commit_requested") else ""
        warnings.append(f"installed at commit {asked}{pin[:12]} (--commit --force), not the pin "
                        f"{manifest.pin(data)[:12]} h3kit's patch series is verified on")
    head = gitutil.head(home)
    if head != pin:
        problems.append(f"HEAD is {head[:12]}, not the pin {pin[:12]}")
    _verify_series(series, data, state, problems)

    touched = series.touched_files()
    if head == pin:
        series = _verify_patched(home, series, state, pin, touched, stack, problems, warnings)

    recorded_files = list(((state or {}).get("files") or {}).keys())
    _verify_installed_files(home, root, state, touched, recorded_files, problems)
    models = _verify_models(home, root, state, problems, warnings)
    python_drift = _verify_packages(state, warnings)

    known_absent = set(data["upstream"].get("absent_from_mirrors", []))
    for code, rel in gitutil.status(home):
        if rel in touched or rel.startswith(STATE_DIR + "/"):
            continue
        if code.strip() == "D" and rel in known_absent:
            continue
        if code != "??":
            warnings.append(f"local change outside the series: {code.strip()} {rel}")
    return {"ok": not problems, "comfy_home": str(home), "pin": pin, "head": head, "problems": problems,
            "warnings": warnings, "patches": [p.name for p in series.patches],
            "pin_verified": pin == manifest.pin(data), "requested": (state or {}).get("commit_requested"),
            "recovered": recovered, "models": models,
            "python_drift": python_drift}


def _verify_pending_write(home: Path, problems: list, warnings: list) -> dict | None:
    """Roll back an interrupted h3kit write (when no command holds the tree); what was recovered, or None."""
    recovered = None
    if journal.pending(home) is not None or journal.journal_dir(home).exists():
        holder = locks.is_locked(home)
        if holder is not None:
            problems.append(f"an h3kit command is writing this tree right now: {holder}")
        else:
            try:
                with locks.tree_lock(home, wait=0):
                    recovered = _recover(home)
            except OSError as e:  # a read-only tree: say what is pending instead of failing
                problems.append(f"an interrupted h3kit write is pending and could not be rolled back: "
                                f"{_fs_error(e, 'write the tree').message}")
            if recovered:
                warnings.append(journal.Recovery(**recovered).describe())
    return recovered


def _verify_series(series: Series, data: dict, state: dict | None, problems: list) -> None:
    """h3kit's patches against source_deps_info.json, and against the ones the tree was installed with."""
    for p in series.patches:
        entry = manifest.patch_entry(data, p.name)
        if entry is None or entry.get("sha256") != manifest.sha256_bytes(p.raw):
            problems.append(f"h3kit's {p.name} does not match source_deps_info.json (the h3kit checkout was edited)")
    if state is not None:
        installed = [(x["name"], x["sha256"]) for x in state.get("patches", [])]
        current = [(p.name, manifest.sha256_bytes(p.raw)) for p in series.patches]
        if installed != current:
            problems.append("the tree was installed with another version of the patch series: run h3kit install")


def _verify_patched(home: Path, series: Series, state: dict | None, pin: str, touched: list[str], stack,
                    problems: list, warnings: list) -> Series:
    """The touched files against what the series (or the three-way merge install recorded, made again) produces
    from the pin; returns the series it checked against."""
    merge = (state or {}).get("merge")
    if merge and any(m.get("how") == "3-way" for m in merge.get("patches", [])):
        # installed off the pin with a three-way merge: check the tree against that merge, made again here
        folder = stack.enter_context(locks.owned_tempdir(locks.scratch_parent(), "h3kit-merged-series-"))
        try:
            series, _, again = merged_series(series, home, str(merge.get("base")), pin, touched, folder)
            if again != merge:
                problems.append(f"install recorded the merge {merge['patches']}, the series merges as "
                                f"{again['patches']} now")
            else:
                warnings.append("merged three-way onto " + pin[:12] + ": " + ", ".join(
                    m["patch"] for m in merge["patches"] if m["how"] == "3-way"))
        except H3kitError as e:
            problems.append(f"the series no longer merges onto {pin[:12]} as install recorded: {e.message}")
    pin_files = gitutil.read_blobs(home, pin, touched)
    try:
        expected = series_result(series, pin_files)
    except PatchConflict as e:
        problems.append("the series does not apply to the pin: " + _describe(e.details))
        expected = {}
    tree_files = read_tree_files(home, touched)
    plan_states = {s.name: s.state for s in plan_forward(series, tree_files).states}
    for name, st in plan_states.items():
        if st != "applied":
            problems.append(f"patch {name} is not applied ({'applies cleanly' if st == 'apply' else 'conflicts'})")
    for rel in touched:
        if rel in expected and tree_files[rel] != expected[rel]:
            if tree_files[rel] is None:
                how = "adds" if pin_files[rel] is None else "changes"
                problems.append(f"{rel} is missing (the series {how} it)")
            else:
                problems.append(f"{rel} differs from what the series produces")
    return series


def _verify_installed_files(home: Path, root: Path, state: dict | None, touched: list[str], recorded_files: list,
                            problems: list) -> None:
    """The files install copied (by checksum), stale bytecode, and temporaries an interrupted write left."""
    for rel, sha in ((state or {}).get("files") or {}).items():
        dest = home / rel
        if not dest.is_file():
            problems.append(f"installed file {rel} is missing")
        elif manifest.sha256_file(dest) != sha:
            problems.append(f"installed file {rel} was modified")
    for st in stale_bytecode(home, touched + recorded_files):
        problems.append(f"stale bytecode: {st}")
    state_rel = [f"{STATE_DIR}/{STATE_FILE}"]
    for tmp in journal.find_temporaries(home, touched + recorded_files + list(shipped_files(root)) + state_rel):
        problems.append(f"leftover temporary file {tmp} from an interrupted h3kit write (h3kit install removes it)")


def _verify_models(home: Path, root: Path, state: dict | None, problems: list, warnings: list) -> dict:
    """The models folders install recorded: h3kit's section of extra_model_paths.yaml as install writes it,
    each folder among the search paths ComfyUI will use (read from the tree's files the way the pin reads
    them, h3kit.workflow.models), and the model files found there per kind."""
    from h3kit.workflow import models as wf_models

    dirs = list((state or {}).get("models_dirs") or [])
    try:
        block = modelpaths.block_in(home)
        if dirs and block != modelpaths.render(modelpaths.read_template(root), dirs):
            problems.append(f"{modelpaths.CONFIG}: h3kit's section for the models folders is missing or was edited "
                            "(h3kit install writes it again)")
        elif block and not dirs:
            problems.append(f"{modelpaths.CONFIG} holds an h3kit section that no install recorded "
                            "(h3kit install removes it)")
    except H3kitError as e:
        problems.append(e.message)
    search = wf_models.open_install(str(home)).model_dirs if dirs else {}
    found: dict[str, list[str]] = {}
    for d in dirs:
        if not os.path.isdir(d):
            warnings.append(f"models folder {d} is not reachable (a shared disk not mounted?)")
        for kind in modelpaths.KINDS:
            folder = os.path.normpath(os.path.join(d, kind))
            if folder not in search.get(kind, []):
                problems.append(f"ComfyUI will not search {folder} for {kind}: {modelpaths.CONFIG} does not list it")
            elif os.path.isdir(folder):
                found.setdefault(kind, []).extend(sorted(f.name for f in os.scandir(folder) if f.is_file()))
    return {"dirs": dirs, "search_paths": {kind: search.get(kind, []) for kind in modelpaths.KINDS} if dirs else {},
            "files": found}


def _verify_packages(state: dict | None, warnings: list) -> dict | None:
    """The drift of the ComfyUI interpreter's packages since install (None when install recorded none)."""
    recorded = (state or {}).get("python_packages")
    python = (state or {}).get("python")
    if recorded is None or not python:
        return None
    try:
        now = pyenv.probe(python, packages=True).get("packages") or []
    except pyenv.PythonEnvError as e:
        warnings.append(f"cannot list the packages of {python}, which install recorded: {e.message}")
        return None
    drift = pyenv.package_drift(recorded, now)
    parts = ([f"changed {', '.join(drift['changed'])}"] if drift["changed"] else []) + \
        ([f"added {', '.join(drift['added'])}"] if drift["added"] else []) + \
        ([f"removed {', '.join(drift['removed'])}"] if drift["removed"] else [])
    if parts:
        warnings.append(f"the packages of {python} changed since install: " + "; ".join(parts)
                        + " (h3kit install records the new set)")
    return drift


# --- revert ---------------------------------------------------------------------------------------------

def revert(comfy_home: Path, force: bool = False, log=_nolog) -> dict:
    home = Path(comfy_home).expanduser().absolute()
    if not home.is_dir() or not gitutil.is_checkout(home):
        raise NotAComfyTree(home, "not a git checkout", hint=f"nothing to revert; h3kit install --comfy-home {home} "
                                                             "makes one")
    try:
        with locks.tree_lock(home, progress=log):
            recovered = _recover(home)
            if recovered:
                log(journal.Recovery(**recovered).describe())
            report = _revert(home, force, log)
            report["recovered"] = recovered
            return report
    except OSError as e:
        raise _fs_error(e, f"write {home}") from None


def _revert(home: Path, force: bool, log) -> dict:
    data = manifest.load()
    state = load_state(home)
    series = _applied_series(home) or Series.load(repo_root())
    pin = (state or {}).get("pin") or manifest.pin(data)
    touched = series.touched_files()
    journal.remove_temporaries(home, touched + list(((state or {}).get("files") or {})))
    current = read_tree_files(home, touched)
    pin_files = gitutil.read_blobs(home, pin, touched)
    plan = plan_reverse(series, current)
    report = {"ok": True, "comfy_home": str(home), "patches": [s.to_dict() for s in plan.states],
              "removed": [], "kept": [], "restored_from_pin": []}
    after = dict(plan.after)
    if plan.conflicts:
        if not force:
            raise PatchConflict("cannot reverse the series: " + _describe([s.to_dict() for s in plan.conflicts]),
                                hint="the patched files were edited after install; revert --force restores them "
                                     "from the pin", details=[s.to_dict() for s in plan.conflicts])
        for st in plan.conflicts:
            for p in series.patches:
                if p.name == st.name:
                    for rel in p.files:
                        after[rel] = pin_files[rel]
                        report["restored_from_pin"].append(rel)
    before = dict(current)
    for rel, sha in ((state or {}).get("files") or {}).items():
        dest = home / rel
        cur = dest.read_bytes() if dest.is_file() else None
        before[rel] = cur
        if cur is not None and (force or manifest.sha256_bytes(cur) == sha):
            after[rel] = None
            report["removed"].append(rel)
        else:
            after[rel] = cur
            if cur is not None:
                report["kept"].append(rel)
    if modelpaths.block_in(home):  # h3kit's section of extra_model_paths.yaml goes, the user's entries stay
        cur = _read_file(home / modelpaths.CONFIG)
        before[modelpaths.CONFIG] = cur
        after[modelpaths.CONFIG] = modelpaths.merge(cur, "", [])
        report["removed"].append(f"{modelpaths.CONFIG}: h3kit's section")
    s_before, s_after = _state_files(home, None, None)
    before.update(s_before)
    after.update(s_after)
    log(f"reversing {sum(s.state == 'reverse' for s in plan.states)} patches, removing {len(report['removed'])} files ...")
    _journaled_write(home, "revert", before, after)
    purge_bytecode(home, [rel for rel in after if not rel.startswith(STATE_DIR + "/")])
    applied = home / STATE_DIR / APPLIED_DIR
    if applied.is_dir() and not any(applied.iterdir()):
        applied.rmdir()
    return report
