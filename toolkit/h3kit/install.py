"""Install, verify and revert: the pinned ComfyUI checkout, the patch series and the shipped files.

install  clone (or reuse) the checkout at the pin, check the interpreter, check every patch, then write the
         patched files and the shipped files in one all-or-nothing step and record what was written.
verify   recompute what the series produces from the pin's blobs and compare it with the tree.
revert   reverse the series and remove the shipped files the user did not edit.

State lives in <comfy-home>/.h3kit/: state.json (pin, interpreter, patches with sha256, installed files with
sha256) and applied-patches/ (the patch files as applied, so a newer h3kit can reverse an older series).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from h3kit import gitutil, manifest, pyenv
from h3kit.errors import H3kitError
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


def _write_state(home: Path, state: dict, series: Series) -> None:
    sdir = home / STATE_DIR
    sdir.mkdir(exist_ok=True)
    applied = sdir / APPLIED_DIR
    tmp_applied = sdir / (APPLIED_DIR + ".tmp")
    shutil.rmtree(tmp_applied, ignore_errors=True)
    tmp_applied.mkdir()
    for p in series.patches:
        (tmp_applied / p.name).write_bytes(p.raw)
    (tmp_applied / "series").write_text("".join(n + "\n" for n in series.names))
    shutil.rmtree(applied, ignore_errors=True)
    tmp_applied.rename(applied)
    tmp = sdir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(sdir / STATE_FILE)
    _exclude_state_dir(home)


def _exclude_state_dir(home: Path) -> None:
    exclude = home / ".git" / "info" / "exclude"
    try:
        text = exclude.read_text() if exclude.exists() else ""
    except OSError:
        return
    if "/.h3kit/" not in text.splitlines():
        exclude.parent.mkdir(parents=True, exist_ok=True)
        with exclude.open("a") as f:
            f.write(("" if text.endswith("\n") or not text else "\n") + "# h3kit install state and runtime files\n/.h3kit/\n")


def _applied_series(home: Path) -> Series | None:
    """The series as it was applied by the last install (None when no copy was kept)."""
    applied = home / STATE_DIR / APPLIED_DIR
    if not (applied / "series").is_file():
        return None
    fake_root = Path(tempfile.mkdtemp(prefix="h3kit-applied-"))
    atexit.register(shutil.rmtree, fake_root, True)  # the engine reads the patch files until the command ends
    try:
        shutil.copytree(applied, fake_root / "patches")
        return Series.load(fake_root)
    except H3kitError:
        return None


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

    def to_dict(self) -> dict:
        return {"ok": True, **self.__dict__}


def _prepare_checkout(opts: InstallOptions, source: str, pin: str, data: dict, report: InstallReport, log) -> Path | None:
    """Return the checkout to patch (None in a dry run that would clone). Clones into a temporary sibling
    and renames it into place, so a failed clone leaves nothing behind."""
    home = opts.comfy_home
    if not home.exists() or (home.is_dir() and not any(home.iterdir())):
        if opts.dry_run:
            log(f"would clone {source} into {home} and check out {pin[:12]}")
            report.cloned = True
            return None
        home.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{home.name}.h3kit-clone-", dir=home.parent))
        try:
            log(f"cloning {source} (no checkout) ...")
            gitutil.clone_no_checkout(source, tmp / "tree", progress=opts.progress)
            if not gitutil.has_commit(tmp / "tree", pin):
                raise InstallError(f"{source} does not hold the commit {pin}", code="pin_missing",
                                   hint="use a mirror that holds the pin (--source or H3KIT_COMFY_SOURCE)")
            log(f"checking out {pin[:12]} ...")
            missing = gitutil.checkout_detached(tmp / "tree", pin)
            _judge_missing(missing, data, report)
            if home.exists():
                home.rmdir()
            (tmp / "tree").rename(home)
            opts._cloned = True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        report.cloned = True
        return home
    if not home.is_dir() or not gitutil.is_checkout(home):
        raise InstallRefused(f"{home} exists, is not empty and is not a git checkout of ComfyUI",
                             hint="choose an empty or new folder for --comfy-home")
    head = gitutil.head(home)
    if head != pin:
        if not opts.force:
            raise InstallRefused(f"{home} is at commit {head[:12]}, not the pin {pin[:12]}",
                                 hint="use a new folder, or --force to check out the pin here (local changes to "
                                      "tracked files are discarded)")
        if opts.dry_run:
            log(f"would check out {pin[:12]} (now at {head[:12]})")
            return home
        if not gitutil.has_commit(home, pin):
            log(f"fetching {pin[:12]} from {source} ...")
            gitutil.fetch_commit(home, source, pin)
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


def install(opts: InstallOptions, log=_nolog) -> InstallReport:
    """Install as described in the module docstring; raises on any refusal or conflict, changing nothing."""
    home = Path(opts.comfy_home).expanduser().absolute()
    existed = home.exists()
    report: InstallReport | None = None
    try:
        report = _install(opts, log)
        return report
    except BaseException:
        # a clone made by this run is part of what failed: leave the folder as it was (absent or empty)
        if getattr(opts, "_cloned", False) and home.exists():
            shutil.rmtree(home, ignore_errors=True)
            if existed:
                home.mkdir()
        raise


def _install(opts: InstallOptions, log) -> InstallReport:
    data = manifest.load()
    root = repo_root()
    series = Series.load(root)
    source = resolve_source(opts.source, data)
    pin = gitutil.check_commit_arg(opts.commit) if opts.commit else manifest.pin(data)
    opts.comfy_home = Path(opts.comfy_home).expanduser().absolute()
    report = InstallReport(comfy_home=str(opts.comfy_home), source=source, pin=pin, dry_run=opts.dry_run)

    python = opts.python or sys.executable
    env = pyenv.check(python, data)
    report.python = env.to_dict()
    if env.errors:
        raise pyenv.PythonEnvError(f"{python} cannot run ComfyUI at the pin: " + "; ".join(env.errors),
                                   hint="give --python an interpreter with a supported Python and a matching "
                                        "torch / torch-npu pair (README, 'Environment')", details=env.to_dict())
    report.warnings += env.warnings

    home = _prepare_checkout(opts, source, pin, data, report, log)
    if home is None:  # dry run before a clone: nothing to check patches against yet
        report.patches = [{"patch": n, "state": "apply", "failures": []} for n in series.names]
        report.files["installed"] = sorted(shipped_files(root))
        return report
    if len(pin) < 40:
        pin = report.pin = gitutil.resolve_commit(home, pin)

    touched = series.touched_files()
    old_series = _applied_series(home)
    if old_series is not None:
        touched = sorted(set(touched) | set(old_series.touched_files()))
    pin_files = gitutil.read_blobs(home, pin, touched)
    current = read_tree_files(home, touched)

    for p in series.patches:  # upstream drift: the checkout's base blobs against the ones the series was made on
        entry = manifest.patch_entry(data, p.name) or {}
        for f in entry.get("files", []):
            found = manifest.git_blob_id(pin_files[f["path"]]) if pin_files.get(f["path"]) is not None else None
            if f.get("base_blob") != found:
                report.drift.append({"patch": p.name, "file": f["path"], "expected_base": f.get("base_blob"),
                                     "found": found, "kind": "upstream"})

    try:
        expected = series_result(series, pin_files)
    except PatchConflict as e:
        raise PatchConflict(f"the patch series does not apply to {pin[:12]}: " + _describe(e.details),
                            hint="the upstream files differ from the ones the series was made for "
                                 "(see drift); install the pin from source_deps_info.json",
                            details={"patches": e.details, "drift": report.drift}) from None

    # Where does the tree stand? Decided for the whole tree, because patch state is per patch, not per
    # file: the series on top of what is there (fresh, partly or fully applied), else an older series to
    # reverse wholesale, else local edits.
    as_is = plan_forward(series, current)
    old_expected = series_result(old_series, pin_files) if old_series is not None else None
    offending: list[str] = []
    if not as_is.conflicts and as_is.after == expected_all(expected, pin_files, touched):
        start = current
    elif old_expected is not None and all(current[f] == old_expected.get(f, pin_files[f]) for f in touched):
        start = dict(pin_files)
    else:
        offending = [f for f in touched if current[f] not in (pin_files[f], expected.get(f, pin_files[f]))
                     and (old_expected is None or current[f] != old_expected.get(f, pin_files[f]))]
        for rel in offending:
            report.drift.append({"file": rel, "kind": "local",
                                 "expected_base": manifest.git_blob_id(pin_files[rel]) if pin_files[rel] is not None else None,
                                 "found": manifest.git_blob_id(current[rel]) if current[rel] is not None else None})
        if not opts.force:
            raise InstallRefused("local edits to files the patches touch: " + ", ".join(offending or touched),
                                 hint="commit or copy your edits elsewhere; install --force restores these files "
                                      "to the pin before patching",
                                 details={"files": offending, "patches": [st.to_dict() for st in as_is.states],
                                          "drift": report.drift})
        start = dict(pin_files)
    report.discarded_edits = offending

    plan = plan_forward(series, start)
    report.patches = [s.to_dict() for s in plan.states]
    if plan.conflicts or plan.after != expected_all(expected, pin_files, touched):
        raise InstallError("internal: the series' plan disagrees with its result", details=[st.to_dict() for st in plan.states])

    state = load_state(home)
    f_before, f_after, modes = _shipped_plan(home, root, state, opts.force, report)
    overlap = set(f_after) & set(touched)
    if overlap:
        raise InstallError(f"shipped files collide with patched files: {sorted(overlap)}")
    before = {**current, **f_before}
    after = {**{k: expected.get(k, pin_files[k]) for k in touched}, **f_after}
    report.changed = sorted(p for p in after if after[p] != before.get(p))

    if opts.dry_run:
        return report

    if report.changed:
        log(f"applying {sum(s['state'] == 'apply' for s in report.patches)} of {len(series.patches)} patches, "
            f"writing {len(report.changed)} files ...")
    try:
        write_tree_files(home, before, after, modes)
    except OSError as e:  # write_tree_files has restored what it could, and says what it could not
        lost = getattr(e, "h3kit_not_restored", [])
        outcome = ("every file was restored" if not lost else
                   "these files could not be restored and differ from before: " + ", ".join(lost))
        raise InstallError(f"could not write {e.filename or 'the tree'}: {e.strerror or e}; {outcome}",
                           code="write_failed", hint="check the folder's permissions and free space",
                           details={"not_restored": lost}) from None
    report.purged_bytecode = purge_bytecode(home, touched + list(f_after))

    # a kept (user-edited) file stays recorded with the checksum of what h3kit installed, so that it keeps
    # counting as edited on the next run instead of being taken for ours and overwritten
    recorded = (state or {}).get("files", {})
    kept = set(report.files["kept"])
    # (a file that was there before h3kit ever installed it is the user's alone: not recorded at all)
    files_sha = {rel: (recorded[rel] if rel in kept else manifest.sha256_bytes(data_))
                 for rel, data_ in f_after.items() if data_ is not None and (rel not in kept or rel in recorded)}
    _write_state(home, {
        "schema": 1,
        "pin": pin,
        "source": source,
        "python": python,
        "h3kit_root": str(root),
        "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "patches": [{"name": p.name, "sha256": manifest.sha256_bytes(p.raw)} for p in series.patches],
        "files": files_sha,
    }, series)
    return report


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
    home = Path(comfy_home).expanduser().absolute()
    data = manifest.load()
    root = repo_root()
    series = Series.load(root)
    problems: list[str] = []
    warnings: list[str] = []
    if not home.is_dir() or not gitutil.is_checkout(home):
        raise InstallError(f"{home} is not a ComfyUI checkout", code="not_installed",
                           hint="run h3kit install --comfy-home " + str(home))
    state = load_state(home)
    pin = manifest.pin(data)
    if state is None:
        problems.append("no install state (.h3kit/state.json): this tree was not installed by h3kit")
    head = gitutil.head(home)
    if head != pin:
        problems.append(f"HEAD is {head[:12]}, not the pin {pin[:12]}")

    for p in series.patches:
        entry = manifest.patch_entry(data, p.name)
        if entry is None or entry.get("sha256") != manifest.sha256_bytes(p.raw):
            problems.append(f"h3kit's {p.name} does not match source_deps_info.json (the h3kit checkout was edited)")
    if state is not None:
        installed = [(x["name"], x["sha256"]) for x in state.get("patches", [])]
        current = [(p.name, manifest.sha256_bytes(p.raw)) for p in series.patches]
        if installed != current:
            problems.append("the tree was installed with another version of the patch series: run h3kit install")

    touched = series.touched_files()
    if head == pin:
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
                problems.append(f"{rel} differs from what the series produces")

    for rel, sha in ((state or {}).get("files") or {}).items():
        dest = home / rel
        if not dest.is_file():
            problems.append(f"installed file {rel} is missing")
        elif manifest.sha256_file(dest) != sha:
            problems.append(f"installed file {rel} was modified")
    for st in stale_bytecode(home, touched + list(((state or {}).get("files") or {}).keys())):
        problems.append(f"stale bytecode: {st}")

    known_absent = set(data["upstream"].get("absent_from_mirrors", []))
    for code, rel in gitutil.status(home):
        if rel in touched or rel.startswith(STATE_DIR + "/"):
            continue
        if code.strip() == "D" and rel in known_absent:
            continue
        if code != "??":
            warnings.append(f"local change outside the series: {code.strip()} {rel}")
    return {"ok": not problems, "comfy_home": str(home), "pin": pin, "head": head, "problems": problems,
            "warnings": warnings, "patches": [p.name for p in series.patches]}


# --- revert ---------------------------------------------------------------------------------------------

def revert(comfy_home: Path, force: bool = False, log=_nolog) -> dict:
    home = Path(comfy_home).expanduser().absolute()
    data = manifest.load()
    if not home.is_dir() or not gitutil.is_checkout(home):
        raise InstallError(f"{home} is not a ComfyUI checkout", code="not_installed")
    state = load_state(home)
    series = _applied_series(home) or Series.load(repo_root())
    pin = (state or {}).get("pin") or manifest.pin(data)
    touched = series.touched_files()
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
    log(f"reversing {sum(s.state == 'reverse' for s in plan.states)} patches, removing {len(report['removed'])} files ...")
    write_tree_files(home, before, after)
    purge_bytecode(home, list(after))
    sdir = home / STATE_DIR
    shutil.rmtree(sdir / APPLIED_DIR, ignore_errors=True)
    state_path(home).unlink(missing_ok=True)
    return report
