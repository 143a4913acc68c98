"""One patch file of the series: its DEP-3 header and its per-file diff sections.

A patch is a DEP-3 header, a line `---`, then `diff --git a/P b/P` sections (unified diff, a/ b/ prefixes).
Each section records its base as `git diff --full-index` writes it: `index <base>..<new> <mode>` (a new file:
`new file mode <mode>` then `index 0000...0000..<blob>`), where <base> is the blob of the file as the series
leaves it before this patch (the pin's blob for the first patch that touches it) and <new> the blob after it.
With them `git apply --3way` can merge a patch into a newer upstream file (h3kit.rebase). `h3kit patches
refresh` writes these lines and `h3kit patches check` compares them with the pin.

Sections that *add* a file whose source is kept under `patches/src/<path>` are generated from that source
(`render_new_file_section`), so the patch cannot drift from the code the tests import; all other sections
are hand-written edits of upstream files (their index lines are rewritten by refresh).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from h3kit.errors import H3kitError

REQUIRED_FIELDS = ("Description", "Origin", "Forwarded", "Last-Update")
_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_DIFF_RE = re.compile(r"^diff --git a/(\S+) b/(\S+)$")
_INDEX_RE = re.compile(r"^index ([0-9a-f]{7,40})\.\.([0-9a-f]{7,40})(?: ([0-7]{6}))?$")
ZERO_BLOB = "0" * 40
DEFAULT_MODE = "100644"


class PatchFormatError(H3kitError):
    code = "patch_format"


@dataclass
class Hunk:
    header: str
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: list[str]


@dataclass
class Section:
    path: str
    text: str  # the whole section, from its `diff --git` line, newline-terminated
    new_file: bool = False
    deleted_file: bool = False
    hunks: list[Hunk] = field(default_factory=list)
    index_old: str | None = None  # the `index` line's blobs (None: the section has no index line)
    index_new: str | None = None
    mode: str | None = None


@dataclass
class PatchFile:
    name: str
    path: Path
    header: dict[str, str]
    header_text: str
    sections: list[Section]
    raw: bytes

    @property
    def files(self) -> list[str]:
        return [s.path for s in self.sections]

    @property
    def description(self) -> str:
        return self.header.get("Description", "").splitlines()[0] if self.header.get("Description") else ""

    def section(self, path: str) -> Section | None:
        return next((s for s in self.sections if s.path == path), None)

    def find_hunk(self, path: str, line: int, reverse: bool = False) -> Hunk | None:
        """The hunk git reported as failing at `line` (old start forward, new start in reverse)."""
        sec = self.section(path)
        if sec is None:
            return None
        for h in sec.hunks:
            if (h.new_start if reverse else h.old_start) == line:
                return h
        return sec.hunks[0] if len(sec.hunks) == 1 else None


def _parse_header(text: str, name: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if not line.strip():
            current = None
            continue
        if line[0] in " \t" and current:
            fields[current] += "\n" + line.strip()
            continue
        if ":" not in line:
            raise PatchFormatError(f"{name}: header line {line!r} is not 'Field: value'",
                                   hint="DEP-3 headers are 'Field: value' lines; continue a field with a leading space")
        key, _, value = line.partition(":")
        current = key.strip()
        fields[current] = value.strip()
    return fields


def _parse_hunks(lines: list[str], name: str, path: str) -> list[Hunk]:
    hunks: list[Hunk] = []
    i = 0
    while i < len(lines):
        m = _HUNK_RE.match(lines[i])
        if not m:
            i += 1
            continue
        old_start, old_len = int(m.group(1)), int(m.group(2) if m.group(2) is not None else 1)
        new_start, new_len = int(m.group(3)), int(m.group(4) if m.group(4) is not None else 1)
        body = []
        j = i + 1
        o = n = 0
        while j < len(lines) and (o < old_len or n < new_len):
            ln = lines[j]
            tag = ln[:1]
            if tag == " ":
                o += 1
                n += 1
            elif tag == "-":
                o += 1
            elif tag == "+":
                n += 1
            elif tag == "\\":
                pass
            elif ln == "":  # an empty context line whose leading space an editor stripped
                raise PatchFormatError(f"{name}: {path}: empty line inside a hunk (line {j + 1} of the section)",
                                       hint="context lines start with a space; regenerate the hunk")
            else:
                raise PatchFormatError(f"{name}: {path}: hunk {lines[i]!r} ends early")
            body.append(ln)
            j += 1
        while j < len(lines) and lines[j].startswith("\\"):
            body.append(lines[j])
            j += 1
        if o != old_len or n != new_len:
            raise PatchFormatError(f"{name}: {path}: hunk {lines[i]!r} has {o} old and {n} new lines")
        hunks.append(Hunk(lines[i], old_start, old_len, new_start, new_len, body))
        i = j
    return hunks


def parse_patch(path: Path) -> PatchFile:
    raw = path.read_bytes()
    name = path.name
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PatchFormatError(f"{name}: not UTF-8 ({e})") from None
    lines = text.split("\n")
    first_diff = next((i for i, ln in enumerate(lines) if ln.startswith("diff --git ")), None)
    if first_diff is None:
        raise PatchFormatError(f"{name}: no 'diff --git' section")
    head_lines = lines[:first_diff]
    while head_lines and head_lines[-1].strip() in ("", "---"):
        head_lines.pop()
    header_text = "\n".join(head_lines) + "\n"
    header = _parse_header(header_text, name)
    missing = [f for f in REQUIRED_FIELDS if not header.get(f)]
    if missing:
        raise PatchFormatError(f"{name}: DEP-3 header lacks {', '.join(missing)}",
                               hint="every patch needs Description, Origin, Forwarded and Last-Update")

    starts = [i for i, ln in enumerate(lines) if ln.startswith("diff --git ")] + [len(lines)]
    sections: list[Section] = []
    for a, b in zip(starts, starts[1:]):
        chunk = lines[a:b]
        m = _DIFF_RE.match(chunk[0])
        if not m or m.group(1) != m.group(2):
            raise PatchFormatError(f"{name}: unsupported section header {chunk[0]!r}",
                                   hint="renames are not used; sections read 'diff --git a/PATH b/PATH'")
        index = [ln for ln in chunk[1:4] if ln.startswith("index ")]
        im = _INDEX_RE.match(index[0]) if index else None
        if index and im is None:
            raise PatchFormatError(f"{name}: {m.group(1)}: malformed line {index[0]!r}",
                                   hint="index lines read 'index BASE..NEW MODE' (run h3kit patches refresh)")
        sec_text = "\n".join(chunk).rstrip("\n") + "\n"
        sec = Section(path=m.group(1), text=sec_text,
                      new_file=any(ln.startswith("new file mode") for ln in chunk[1:3]),
                      deleted_file=any(ln.startswith("deleted file mode") for ln in chunk[1:3]),
                      index_old=im.group(1) if im else None, index_new=im.group(2) if im else None,
                      mode=(im.group(3) if im else None))
        if sec.new_file and im is not None:
            mm = re.match(r"^new file mode ([0-7]{6})$", chunk[1])
            sec.mode = mm.group(1) if mm else sec.mode
        sec.hunks = _parse_hunks(chunk, name, sec.path)
        if not sec.hunks and not sec.deleted_file:
            raise PatchFormatError(f"{name}: {sec.path}: section has no hunk")
        if any(s.path == sec.path for s in sections):
            raise PatchFormatError(f"{name}: {sec.path} appears in two sections")
        sections.append(sec)
    return PatchFile(name=name, path=path, header=header, header_text=header_text,
                     sections=sections, raw=raw)


def git_blob_id(data: bytes) -> str:
    """The id git gives `data` as a blob (what `git hash-object` prints), without running git."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def with_index(section_text: str, old: str, new: str, mode: str = DEFAULT_MODE) -> str:
    """`section_text` (a modified file's section) with its index line set to `old..new mode`."""
    lines = section_text.split("\n")
    lines = [lines[0]] + [ln for ln in lines[1:4] if not ln.startswith("index ")] + lines[4:]
    lines.insert(1, f"index {old}..{new} {mode}")
    return "\n".join(lines)


def render_new_file_section(rel_path: str, content: bytes) -> str:
    """The diff section that adds `rel_path` with `content` (text, UTF-8), as `git diff --full-index` writes it."""
    text = content.decode("utf-8")
    if not text:
        raise PatchFormatError(f"{rel_path}: empty source file cannot be added by a patch")
    body = text.split("\n")
    no_eol = not text.endswith("\n")
    if not no_eol:
        body = body[:-1]
    out = [f"diff --git a/{rel_path} b/{rel_path}", f"new file mode {DEFAULT_MODE}",
           f"index {ZERO_BLOB}..{git_blob_id(content)}", "--- /dev/null",
           f"+++ b/{rel_path}", f"@@ -0,0 +1,{len(body)} @@" if len(body) != 1 else "@@ -0,0 +1 @@"]
    out += ["+" + ln for ln in body]
    if no_eol:
        out.append("\\ No newline at end of file")
    return "\n".join(out) + "\n"


def render_patch(header_text: str, sections: list[str]) -> str:
    return header_text.rstrip("\n") + "\n---\n" + "".join(sections)
