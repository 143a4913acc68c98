"""The journal of a write in progress, so that an install or revert killed half-way is finished or undone
by the next run instead of being taken for the user's edits.

Before the first file of the tree changes, `<home>/.h3kit/journal/` receives a copy of every file that
will change, before and after (content-addressed under `blobs/`), then `journal.json` naming them with
their sha256 and modes (written to a temporary name, synced, renamed: the journal exists only once it is
whole). The command removes the journal after its last write. A fresh clone being moved into an empty home
is journaled the same way (op "clone", the entries being moved).

The next install, revert or verify that finds a journal while no live h3kit holds the tree lock recovers:

- every file as the journal says it is *after*: the write had finished, only the journal was left;
- otherwise each file still *before* stays, each file already *after* is put back to before, and a file
  that is neither was edited since by someone else: it is kept and reported, never overwritten;
- the `.NAME.h3kit-tmp` / `.NAME.h3kit-restore` files beside the journaled paths are removed, and folders
  the write had created are removed again when empty;
- a "clone" journal removes the entries already moved into the home (the home was empty before).

Recovery is itself idempotent: killed during recovery, the next run recovers again.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from h3kit import manifest, testhooks
from h3kit.errors import H3kitError

STATE_DIR = ".h3kit"
JOURNAL_DIR = "journal"
JOURNAL_FILE = "journal.json"
TMP_SUFFIXES = (".h3kit-tmp", ".h3kit-restore")


class JournalError(H3kitError):
    code = "journal"


def journal_dir(home: Path) -> Path:
    return Path(home) / STATE_DIR / JOURNAL_DIR


def temp_names(rel: str) -> list[str]:
    """The temporary names a write of `rel` uses beside it (see h3kit.patches.write_tree_files)."""
    parent, _, name = rel.rpartition("/")
    return [(parent + "/" if parent else "") + f".{name}{suffix}" for suffix in TMP_SUFFIXES]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _missing_dirs(home: Path, rel: str) -> list[str]:
    out = []
    parent = (home / rel).parent
    while parent != home and not parent.exists():
        out.append(parent.relative_to(home).as_posix())
        parent = parent.parent
    return out


def _commit(home: Path, doc: dict, blobs: dict[str, bytes]) -> None:
    jdir = journal_dir(home)
    shutil.rmtree(jdir, ignore_errors=True)
    (jdir / "blobs").mkdir(parents=True)
    for sha, data in blobs.items():
        _write_synced(jdir / "blobs" / sha, data)
    testhooks.point("journal-blobs")
    tmp = jdir / (JOURNAL_FILE + ".tmp")
    _write_synced(tmp, (json.dumps(doc, indent=1) + "\n").encode())
    os.replace(tmp, jdir / JOURNAL_FILE)
    _fsync_dir(jdir)
    testhooks.point("journal-written")


def begin(home: Path, op: str, before: dict[str, bytes | None], after: dict[str, bytes | None],
          modes: dict[str, int] | None = None) -> None:
    """Journal the change from `before` to `after` (only the paths that differ) before it is made."""
    home = Path(home)
    modes = modes or {}
    files: dict[str, dict] = {}
    blobs: dict[str, bytes] = {}
    created: set[str] = set()
    for rel in sorted(p for p in after if after[p] != before.get(p)):
        entry = {}
        for side, data in (("before", before.get(rel)), ("after", after[rel])):
            if data is None:
                entry[side] = None
            else:
                sha = manifest.sha256_bytes(data)
                blobs[sha] = data
                entry[side] = sha
        dest = home / rel
        entry["mode_before"] = dest.stat().st_mode & 0o7777 if dest.is_file() else None
        entry["mode_after"] = modes.get(rel) or entry["mode_before"] or 0o644
        if after[rel] is not None:
            created.update(_missing_dirs(home, rel))
        files[rel] = entry
    doc = {"schema": 1, "op": op, "pid": os.getpid(), "files": files,
           "created_dirs": sorted(created, key=lambda d: -d.count("/"))}
    _commit(home, doc, blobs)


def begin_clone(home: Path, entries: list[str]) -> None:
    """Journal the move of a fresh clone's top-level entries into the (empty) home."""
    _commit(Path(home), {"schema": 1, "op": "clone", "pid": os.getpid(), "entries": sorted(entries)}, {})


def finish(home: Path) -> None:
    shutil.rmtree(journal_dir(home), ignore_errors=True)


def pending(home: Path) -> dict | None:
    """The journal of an unfinished write, or None. An incomplete journal (no journal.json) means no file
    had changed yet."""
    path = journal_dir(home) / JOURNAL_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise JournalError(f"{path} is unreadable ({e})",
                           hint="an interrupted h3kit write left it; restore the files it names by hand "
                                "(git status), delete .h3kit/journal, then run h3kit install") from None
    if not isinstance(doc, dict) or doc.get("op") not in ("install", "revert", "clone"):
        raise JournalError(f"{path} is not an h3kit journal")
    return doc


@dataclass
class Recovery:
    op: str
    pid: int | None
    outcome: str                                  # "completed", "rolled_back", "nothing_to_do"
    restored: list[str] = field(default_factory=list)
    kept_edits: list[str] = field(default_factory=list)
    removed_temporaries: list[str] = field(default_factory=list)

    def describe(self) -> str:
        what = {"completed": "had finished writing; its journal is removed",
                "rolled_back": f"was rolled back ({len(self.restored)} file(s) put back)",
                "nothing_to_do": "had not changed any file yet"}[self.outcome]
        text = f"an interrupted h3kit {self.op} (pid {self.pid}) {what}"
        if self.kept_edits:
            text += "; kept files edited since: " + ", ".join(self.kept_edits)
        return text

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes() if path.is_file() and not path.is_symlink() else None
    except OSError:
        return None


def _put(path: Path, data: bytes | None, mode: int | None) -> None:
    if data is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.h3kit-restore")
    tmp.write_bytes(data)
    os.chmod(tmp, mode or 0o644)
    os.replace(tmp, path)


def remove_temporaries(home: Path, rel_paths) -> list[str]:
    removed = []
    for rel in rel_paths:
        for tmp in temp_names(rel):
            p = Path(home) / tmp
            if p.is_file() or p.is_symlink():
                p.unlink()
                removed.append(tmp)
    return removed


def find_temporaries(home: Path, rel_paths) -> list[str]:
    return [tmp for rel in rel_paths for tmp in temp_names(rel) if (Path(home) / tmp).is_file()]


def recover(home: Path) -> Recovery | None:
    """Finish or undo the write a journal describes (see the module docstring); None without a journal.
    The caller holds the tree lock."""
    home = Path(home)
    doc = pending(home)
    jdir = journal_dir(home)
    if doc is None:
        if jdir.exists():  # an incomplete journal: it was being written, no file had changed
            finish(home)
        return None
    op, pid = doc["op"], doc.get("pid")
    if op == "clone":
        rec = Recovery("install", pid, "rolled_back")
        for name in doc.get("entries", []):
            p = home / name
            if name in (STATE_DIR, "") or "/" in name or name.startswith(".."):
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif os.path.lexists(p):
                p.unlink()
            else:
                continue
            rec.restored.append(name)
        finish(home)
        return rec
    files: dict[str, dict] = doc.get("files", {})
    blobs = jdir / "blobs"

    def data_of(sha):
        return None if sha is None else (blobs / sha).read_bytes()

    now = {rel: _read(home / rel) for rel in files}
    now_sha = {rel: (manifest.sha256_bytes(d) if d is not None else None) for rel, d in now.items()}
    rec = Recovery(op, pid, "nothing_to_do")
    if files and all(now_sha[rel] == e["after"] for rel, e in files.items()):
        rec.outcome = "completed"
    else:
        for rel, e in sorted(files.items()):
            if now_sha[rel] == e["before"]:
                continue
            if now_sha[rel] == e["after"]:
                _put(home / rel, data_of(e["before"]), e.get("mode_before"))
                rec.restored.append(rel)
                testhooks.point("recovering")
            else:
                rec.kept_edits.append(rel)
        if rec.restored:
            rec.outcome = "rolled_back"
        for d in doc.get("created_dirs", []):
            p = home / d
            if p.is_dir() and not any(p.iterdir()):
                p.rmdir()
    rec.removed_temporaries = remove_temporaries(home, files)
    finish(home)
    return rec
