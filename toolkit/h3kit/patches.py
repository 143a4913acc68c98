"""The patch series and the engine that checks, applies and reverses it, all or nothing.

Nothing is applied in place. The engine copies every file the series touches (as it is in the tree, or
absent) into a scratch directory, runs `git apply` there patch by patch, and only when every patch either
applies cleanly or is already applied does it write the results into the tree, restoring every file it
wrote if a write fails. A conflict therefore leaves the tree byte-identical to before. `git apply` allows
no fuzz and matches whitespace exactly, so upstream drift is reported instead of being papered over.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from h3kit import gitutil, locks, manifest, testhooks
from h3kit.errors import H3kitError
from h3kit.patchfile import (DEFAULT_MODE, ZERO_BLOB, PatchFile, PatchFormatError, git_blob_id, parse_patch,
                             render_new_file_section, render_patch, with_index)

GIT_TIMEOUT = 60  # seconds; applying a patch to a handful of files takes milliseconds
_FAILED_RE = re.compile(r"^error: patch failed: (.+):(\d+)$")
_FILE_ERR_RE = re.compile(r"^error: (.+?): (patch does not apply|already exists in working directory|"
                          r"does not exist in index|No such file or directory)$")


class SeriesError(H3kitError):
    code = "series"


class PatchConflict(H3kitError):
    code = "patch_conflict"


@dataclass
class Failure:
    patch: str
    path: str
    message: str
    hunk: str | None = None
    line: int | None = None

    def to_dict(self) -> dict:
        return {"patch": self.patch, "file": self.path, "hunk": self.hunk, "line": self.line,
                "message": self.message}

    def __str__(self) -> str:
        where = f"{self.path}" + (f", hunk {self.hunk}" if self.hunk else "")
        return f"{self.patch}: {where}: {self.message}"


@dataclass
class PatchState:
    name: str
    state: str  # "apply" (applies cleanly), "applied" (already in the tree), "conflict"
    failures: list[Failure] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"patch": self.name, "state": self.state, "failures": [f.to_dict() for f in self.failures]}


@dataclass
class Plan:
    states: list[PatchState]
    before: dict[str, bytes | None]
    after: dict[str, bytes | None]

    @property
    def conflicts(self) -> list[PatchState]:
        return [s for s in self.states if s.state == "conflict"]

    @property
    def changed(self) -> list[str]:
        return sorted(p for p in self.after if self.after[p] != self.before.get(p))


class Series:
    """patches/series and the patch files it lists, in order."""

    def __init__(self, root: Path, names: list[str], patches: list[PatchFile]):
        self.root = root
        self.patches_dir = root / "patches"
        self.src_dir = self.patches_dir / "src"
        self.names = names
        self.patches = patches

    @classmethod
    def load(cls, root: Path) -> "Series":
        return cls.load_dir(root / "patches", root)

    @classmethod
    def load_dir(cls, patches_dir: Path, root: Path | None = None) -> "Series":
        """The series in `patches_dir` (its `series` file and the patches it lists)."""
        root = root if root is not None else patches_dir.parent
        series_file = patches_dir / "series"
        try:
            lines = series_file.read_text().splitlines()
        except OSError as e:
            raise SeriesError(f"cannot read {series_file}: {e}") from None
        names: list[str] = []
        for n, line in enumerate(lines, 1):
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            if entry in names:
                raise SeriesError(f"patches/series line {n}: {entry} is listed twice")
            if entry.startswith("/") or ".." in Path(entry).parts:
                raise SeriesError(f"patches/series line {n}: {entry} points outside patches/")
            names.append(entry)
        patches = []
        for name in names:
            path = patches_dir / name
            if not path.is_file():
                raise SeriesError(f"patches/series lists {name}, which does not exist")
            patches.append(parse_patch(path))
        series = cls(root, names, patches)
        series.patches_dir = patches_dir
        return series

    def touched_files(self) -> list[str]:
        return sorted({p for patch in self.patches for p in patch.files})

    def source_of(self, rel_path: str) -> Path | None:
        src = self.src_dir / rel_path
        return src if src.is_file() else None


# --- the scratch directory -------------------------------------------------------------------------

class Scratch:
    """A throwaway copy of the touched files, where `git apply` runs outside any repository.

    It lives in h3kit's private temporary folder and is owned by this process (h3kit.locks.owned_tempdir):
    one left by a killed run is removed by the next."""

    SCRATCH_PREFIX = "h3kit-scratch-"

    def __init__(self, files: dict[str, bytes | None]):
        self._owner = locks.owned_tempdir(locks.scratch_parent(), self.SCRATCH_PREFIX)
        self.dir = self._owner.__enter__()
        self.paths = sorted(files)
        try:
            for rel, data in files.items():
                if data is not None:
                    dest = self.dir / rel
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(data)
        except BaseException:
            self._owner.__exit__(None, None, None)
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._owner.__exit__(None, None, None)

    def git_apply(self, patch: PatchFile, *, reverse=False, check=False) -> subprocess.CompletedProcess:
        args = ["git", "apply", "--whitespace=nowarn"]
        if reverse:
            args.append("-R")
        if check:
            args.append("--check")
        args.append(str(patch.path.resolve()))
        env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(self.dir.parent), LC_ALL="C")
        env.pop("GIT_DIR", None)
        env.pop("GIT_WORK_TREE", None)
        try:
            return subprocess.run(args, cwd=self.dir, capture_output=True, text=True, env=env, timeout=GIT_TIMEOUT,
                                  **gitutil.dies_with_us())
        except FileNotFoundError:
            raise H3kitError("git is not installed", code="no_git", hint="install git") from None

    def read(self) -> dict[str, bytes | None]:
        out = {}
        for rel in self.paths:
            p = self.dir / rel
            out[rel] = p.read_bytes() if p.is_file() else None
        return out


def _failures(patch: PatchFile, stderr: str, reverse: bool) -> list[Failure]:
    found: list[Failure] = []
    for line in stderr.splitlines():
        m = _FAILED_RE.match(line)
        if m:
            path, lineno = m.group(1), int(m.group(2))
            hunk = patch.find_hunk(path, lineno, reverse=reverse)
            found.append(Failure(patch.name, path, "hunk does not match the file",
                                 hunk=hunk.header if hunk else None, line=lineno))
            continue
        m = _FILE_ERR_RE.match(line)
        if m and m.group(2) != "patch does not apply":
            path, what = m.group(1), m.group(2)
            msg = {"already exists in working directory": "the file the patch adds already exists with other content",
                   "does not exist in index": "the file the patch changes is missing",
                   "No such file or directory": "the file the patch changes is missing"}[what]
            found.append(Failure(patch.name, path, msg))
    if not found:
        found.append(Failure(patch.name, "?", stderr.strip() or "git apply failed"))
    return found


def plan_forward(series: Series, current: dict[str, bytes | None]) -> Plan:
    """Decide, patch by patch on a scratch copy of `current`, what applying the series would do."""
    states = []
    with Scratch(current) as scratch:
        for patch in series.patches:
            fwd = scratch.git_apply(patch, check=True)
            if fwd.returncode == 0:
                scratch.git_apply(patch).check_returncode()
                states.append(PatchState(patch.name, "apply"))
            elif scratch.git_apply(patch, reverse=True, check=True).returncode == 0:
                states.append(PatchState(patch.name, "applied"))
            else:
                states.append(PatchState(patch.name, "conflict", _failures(patch, fwd.stderr, reverse=False)))
        after = scratch.read()
    return Plan(states, dict(current), after)


def plan_reverse(series: Series, current: dict[str, bytes | None]) -> Plan:
    """The same for reversing the series, last patch first. States: "reverse", "absent", "conflict"."""
    states = []
    with Scratch(current) as scratch:
        for patch in reversed(series.patches):
            rev = scratch.git_apply(patch, reverse=True, check=True)
            if rev.returncode == 0:
                scratch.git_apply(patch, reverse=True).check_returncode()
                states.append(PatchState(patch.name, "reverse"))
            elif scratch.git_apply(patch, check=True).returncode == 0:
                states.append(PatchState(patch.name, "absent"))
            else:
                states.append(PatchState(patch.name, "conflict", _failures(patch, rev.stderr, reverse=True)))
        after = scratch.read()
    states.reverse()
    return Plan(states, dict(current), after)


def series_result(series: Series, base: dict[str, bytes | None]) -> dict[str, bytes | None]:
    """What the whole series produces from `base` (the pin's files); raises PatchConflict if it cannot."""
    plan = plan_forward(series, base)
    bad = [s for s in plan.states if s.state != "apply"]
    if bad:
        raise PatchConflict(f"the series does not apply to the pin: {bad[0].name} is {bad[0].state}",
                            details=[s.to_dict() for s in bad])
    return plan.after


# --- reading and writing the tree ------------------------------------------------------------------

def read_tree_files(tree: Path, paths: list[str]) -> dict[str, bytes | None]:
    out = {}
    for rel in paths:
        p = tree / rel
        out[rel] = p.read_bytes() if p.is_file() else None
    return out


def write_tree_files(tree: Path, before: dict[str, bytes | None], after: dict[str, bytes | None],
                     modes: dict[str, int] | None = None) -> list[str]:
    """Make the tree hold `after` for every path where it differs from `before`, all or nothing.

    Each file is written to a temporary name beside it and renamed over the original (keeping its mode,
    or taking `modes[path]` when given); if any step fails, every file already written is restored and
    every file created is removed.
    """
    modes = modes or {}
    changed = sorted(p for p in after if after[p] != before.get(p))
    done: list[str] = []
    created_dirs: list[Path] = []
    stats: dict[str, os.stat_result] = {}
    try:
        for rel in changed:
            dest = tree / rel
            if dest.is_file():
                stats[rel] = dest.stat()
            _write_one(dest, after[rel], modes.get(rel), created_dirs)
            done.append(rel)
            testhooks.point("file-written")
    except BaseException as e:
        not_restored = _restore(tree, done, before, stats)
        if not_restored:
            e.h3kit_not_restored = not_restored  # the caller says so instead of claiming a clean tree
        for d in reversed(created_dirs):
            try:
                d.rmdir()
            except OSError:
                pass
        for rel in changed:
            (tree / rel).with_name(f".{Path(rel).name}.h3kit-tmp").unlink(missing_ok=True)
        raise
    # a reverse that deletes an added file leaves its folder behind only if the patch created it
    for rel in changed:
        if after[rel] is None:
            parent = (tree / rel).parent
            while parent != tree and parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()
                parent = parent.parent
    return changed


def _write_one(dest: Path, data: bytes | None, mode: int | None, created_dirs: list[Path]) -> None:
    """Delete `dest` (data None) or write it through a temporary beside it, making (and noting in `created_dirs`)
    the folders it lacks."""
    if data is None:
        if dest.exists():
            dest.unlink()
        return
    missing = []
    parent = dest.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for d in reversed(missing):
        d.mkdir()
        created_dirs.append(d)
    mode = mode or (dest.stat().st_mode & 0o7777 if dest.exists() else 0o644)
    tmp = dest.with_name(f".{dest.name}.h3kit-tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, mode)
    testhooks.point("tmp-written")
    os.replace(tmp, dest)


def _restore(tree: Path, done: list[str], before: dict[str, bytes | None], stats: dict[str, os.stat_result]
             ) -> list[str]:
    """Put back what `before` held for every path in `done`; the paths that could not be restored."""
    not_restored = []
    for rel in done:
        dest = tree / rel
        old = before.get(rel)
        try:
            if old is None:
                dest.unlink(missing_ok=True)
            else:  # the way it was written: a temporary beside it, renamed over (works on read-only files)
                tmp = dest.with_name(f".{dest.name}.h3kit-restore")
                tmp.write_bytes(old)
                if rel in stats:  # as it was: mode and times too
                    os.chmod(tmp, stats[rel].st_mode & 0o7777)
                    os.utime(tmp, ns=(stats[rel].st_atime_ns, stats[rel].st_mtime_ns))
                os.replace(tmp, dest)
        except OSError:
            not_restored.append(rel)
    return not_restored


# --- maintaining the series itself -----------------------------------------------------------------

@dataclass
class Step:
    """One patch of the series applied to the files the earlier patches left: its files before and after."""
    patch: PatchFile
    before: dict[str, bytes | None]
    after: dict[str, bytes | None]

    def blobs(self, path: str) -> tuple[str, str]:
        """(base, new) blob ids of `path` around this patch, as its index line records them."""
        old, new = self.before.get(path), self.after.get(path)
        return (git_blob_id(old) if old is not None else ZERO_BLOB, git_blob_id(new) if new is not None else ZERO_BLOB)


def walk(series: Series, base: dict[str, bytes | None]) -> list[Step]:
    """Apply the series to `base` (the pin's files) patch by patch, keeping each patch's before and after;
    raises PatchConflict naming the first patch that does not apply."""
    steps = []
    with Scratch(base) as scratch:
        current = scratch.read()
        for patch in series.patches:
            proc = scratch.git_apply(patch)
            if proc.returncode != 0:
                raise PatchConflict(f"the series does not apply to the pin: {patch.name} is conflict",
                                    details=[PatchState(patch.name, "conflict",
                                                        _failures(patch, proc.stderr, reverse=False)).to_dict()])
            after = scratch.read()
            steps.append(Step(patch, current, after))
            current = after
    return steps


def index_lines(steps: list[Step]) -> dict[str, dict[str, tuple[str, str]]]:
    """{patch: {path: (base, new)}}: the index line each section must carry."""
    return {st.patch.name: {sec.path: st.blobs(sec.path) for sec in st.patch.sections} for st in steps}


def index_problems(series: Series, steps: list[Step]) -> list[str]:
    """Sections whose index line is missing or differs from the blobs the series produces on the pin."""
    want = index_lines(steps)
    problems = []
    for patch in series.patches:
        for sec in patch.sections:
            old, new = want[patch.name][sec.path]
            if sec.index_old is None:
                problems.append(f"{patch.name}: {sec.path}: no index line (run h3kit patches refresh)")
            elif (sec.index_old, sec.index_new) != (old, new):
                problems.append(f"{patch.name}: {sec.path}: index line {sec.index_old[:12]}..{sec.index_new[:12]} but "
                                f"the series on the pin goes {old[:12]}..{new[:12]} (run h3kit patches refresh)")
    return problems


def regenerate(series: Series, index: dict[str, dict[str, tuple[str, str]]] | None = None,
               modes: dict[str, str] | None = None) -> dict[str, str]:
    """Patch texts with every new-file section rebuilt from patches/src and, given `index` (index_lines), every
    other section's index line set; {name: text} of those that change."""
    changed = {}
    modes = modes or {}
    for patch in series.patches:
        sections = []
        for sec in patch.sections:
            src = series.source_of(sec.path)
            if sec.new_file and src is not None:
                sections.append(render_new_file_section(sec.path, src.read_bytes()))
            elif index is not None and not sec.new_file and not sec.deleted_file:
                old, new = index[patch.name][sec.path]
                sections.append(with_index(sec.text, old, new, modes.get(sec.path, sec.mode or DEFAULT_MODE)))
            else:
                sections.append(sec.text)
        text = render_patch(patch.header_text, sections)
        if text.encode() != patch.raw:
            changed[patch.name] = text
    return changed


def add_source_sections(series: Series, name: str, rel_paths: list[str]) -> str:
    """Patch text of `name` with new-file sections for `rel_paths` (sources under patches/src) appended."""
    patch = next(p for p in series.patches if p.name == name)
    sections = [s.text for s in patch.sections]
    for rel in rel_paths:
        src = series.source_of(rel)
        if src is None:
            raise SeriesError(f"patches/src/{rel} does not exist")
        if patch.section(rel) is None:
            sections.append(render_new_file_section(rel, src.read_bytes()))
    return render_patch(patch.header_text, sections)


def diff_sections(old_tree, new_tree, rel_paths: list[str]) -> str:
    """Unified diff sections, one per path that differs, from `old_tree` to `new_tree` in the series' format
    (with index lines: pasted under a patch, they are right when OLD is the tree the earlier patches leave)."""
    out = []
    for rel in rel_paths:
        a, b = Path(old_tree) / rel, Path(new_tree) / rel
        proc = subprocess.run(["git", "diff", "--no-index", "--no-color", "-U3", "--no-renames", "--full-index",
                               str(a) if a.exists() else "/dev/null", str(b) if b.exists() else "/dev/null"],
                              capture_output=True, text=True, timeout=GIT_TIMEOUT)
        if proc.returncode not in (0, 1):
            raise SeriesError(f"git diff failed for {rel}: {proc.stderr.strip()}")
        if not proc.stdout:
            continue
        lines = []
        for ln in proc.stdout.splitlines():
            if ln.startswith("diff --git "):
                ln = f"diff --git a/{rel} b/{rel}"
            elif ln.startswith("--- ") and ln != "--- /dev/null":
                ln = f"--- a/{rel}"
            elif ln.startswith("+++ ") and ln != "+++ /dev/null":
                ln = f"+++ b/{rel}"
            lines.append(ln)
        out.append("\n".join(lines) + "\n")
    return "".join(out)


def structural_problems(series: Series, data: dict) -> list[str]:
    """Everything `h3kit patches check` finds without an upstream tree; empty when the series is sound."""
    problems = []
    listed = set(series.names)
    for f in sorted(series.patches_dir.glob("*.patch")):
        if f.name not in listed:
            problems.append(f"{f.name} is in patches/ but not in patches/series")
    covered = {s.path for p in series.patches for s in p.sections if s.new_file}
    if series.src_dir.is_dir():
        for src in sorted(series.src_dir.rglob("*")):
            if src.is_file() and "__pycache__" not in src.parts:
                rel = src.relative_to(series.src_dir).as_posix()
                if rel not in covered:
                    problems.append(f"patches/src/{rel} is added by no patch")
    for name in regenerate(series):
        problems.append(f"{name}: new-file sections differ from patches/src (run h3kit patches refresh)")
    for p in series.patches:
        for s in p.sections:
            if s.index_old is None:
                problems.append(f"{p.name}: {s.path}: no index line, so the patch cannot merge three-way "
                                "(run h3kit patches refresh)")
    owners: dict[str, str] = {}
    for p in series.patches:
        for s in p.sections:
            if s.new_file and s.path in owners:
                problems.append(f"{s.path} is added by both {owners[s.path]} and {p.name}")
            owners.setdefault(s.path, p.name)
    pin = (data.get("upstream") or {}).get("commit")
    for p in series.patches:
        said = p.header.get("Upstream-Commit")
        if said and pin and said != pin:
            problems.append(f"{p.name}: its header says Upstream-Commit: {said[:12]}, the pin is {pin[:12]} "
                            "(h3kit patches rebase --onto the pin writes the series for it)")
    entries = data.get("patches", [])
    if [e["name"] for e in entries] != series.names:
        problems.append("source_deps_info.json lists the patches "
                        f"{[e['name'] for e in entries]} but patches/series has {series.names} (run h3kit patches refresh)")
    for p in series.patches:
        entry = manifest.patch_entry(data, p.name)
        if entry is None:
            continue
        if entry.get("sha256") != manifest.sha256_bytes(p.raw):
            problems.append(f"{p.name}: sha256 differs from source_deps_info.json (run h3kit patches refresh)")
        if sorted(f["path"] for f in entry.get("files", [])) != sorted(p.files):
            problems.append(f"{p.name}: touched files differ from source_deps_info.json (run h3kit patches refresh)")
    return problems


def _function_imports(source: bytes) -> set[tuple[str, str]]:
    """(function, module) for each `import a.b` (no `as`) inside a function body of `source`."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    found = set()

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{where}.{child.name}" if where else child.name)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{where}.{child.name}" if where else child.name)
            else:
                if isinstance(child, ast.Import) and where:
                    for alias in child.names:
                        if "." in alias.name and alias.asname is None:
                            found.add((where, alias.name))
                visit(child, where)

    visit(tree, "")
    return found


def local_import_problems(series: Series, base: dict[str, bytes | None], result: dict[str, bytes | None]) -> list[str]:
    """Functions the series gives an `import a.b`: that binds `a` as a local name in the whole function, so any
    use of a.* before it raises UnboundLocalError (main.py's start_comfyui did when its hook imported at its
    use). The fix the message names: `from a import b`."""
    problems = []
    for rel in series.touched_files():
        if not rel.endswith(".py") or base.get(rel) is None or result.get(rel) is None:
            continue
        for where, module in sorted(_function_imports(result[rel]) - _function_imports(base[rel])):
            pkg, _, rest = module.partition(".")
            owner = next((p.name for p in series.patches for sec in p.sections if sec.path == rel
                          and any(ln.startswith("+") and f"import {module}" in ln for h in sec.hunks for ln in h.lines)),
                         "the series")
            problems.append(f"{owner}: {rel}: {where}() gains 'import {module}', which makes {pkg!r} a local name of "
                            f"the whole function (UnboundLocalError at any earlier {pkg}.* use); write "
                            f"'from {pkg} import {rest}'")
    return problems


def manifest_entries(series: Series, base: dict[str, bytes | None]) -> list[dict]:
    """The manifest's "patches" list: per patch its sha256 and the upstream files with their base blobs."""
    entries = []
    for p in series.patches:
        files = []
        for s in p.sections:
            data = base.get(s.path)
            files.append({"path": s.path, "status": "added" if s.new_file else "modified",
                          "base_blob": manifest.git_blob_id(data) if data is not None else None})
        entries.append({"name": p.name, "description": p.description,
                        "sha256": manifest.sha256_bytes(p.raw), "files": files})
    return entries


__all__ = ["local_import_problems", "Step", "walk", "index_lines", "index_problems", "Series", "Plan", "PatchState", "Failure", "PatchConflict", "PatchFormatError", "SeriesError",
           "plan_forward", "plan_reverse", "series_result", "read_tree_files", "write_tree_files",
           "regenerate", "structural_problems", "manifest_entries", "add_source_sections", "diff_sections"]
