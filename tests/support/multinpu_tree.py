"""The runtime area's stand-in for the install engine: a patched copy of the pin, and patch refresh.

Until `h3kit install` (the lead's foundation work) provides the `installed_tree` fixture, the runtime
tests build their own tree here: copy the pinned checkout, `git apply` every patch of patches/series
in order (no fuzz: git apply has none). Switching to `installed_tree` is a one-line change in
tests/conftest-style fixtures of the runtime tests (`patched_tree`).

`refresh_new_files(patch)` regenerates the new-file sections of a patch from patches/src/, which
stay the source of truth (the lead's `h3kit patches refresh` does the same for the whole series);
`stale_new_files(patch)` lists the sections that drifted. Run as a script to refresh patches:
    python tests/support/multinpu_tree.py patches/multinpu-collectives.patch ...
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATCHES = ROOT / "patches"
SRC = PATCHES / "src"
_SECTION = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.M)


def series(patches_dir: Path = PATCHES) -> list[Path]:
    out = []
    for line in (patches_dir / "series").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(patches_dir / line)
    return out


def new_file_section(rel: str, src: Path = SRC) -> str:
    """The diff section adding patches/src/<rel> as <rel>: a/ b/ prefixes, no index line."""
    lines = (src / rel).read_text().splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        raise ValueError(f"{src / rel}: the last line has no newline")
    body = "".join("+" + line for line in lines)
    return (f"diff --git a/{rel} b/{rel}\nnew file mode 100644\n--- /dev/null\n+++ b/{rel}\n"
            f"@@ -0,0 +1,{len(lines)} @@\n{body}")


def split_patch(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(DEP-3 header up to and including the '---' line, [(path, section text)])."""
    starts = [m.start() for m in _SECTION.finditer(text)]
    if not starts:
        raise ValueError("no diff --git section")
    head = text[:starts[0]]
    sections = []
    for a, b in zip(starts, starts[1:] + [len(text)]):
        chunk = text[a:b]
        sections.append((_SECTION.match(chunk).group(2), chunk))
    return head, sections


def compose(header: str, new_files: list[str], edits: list[str]) -> str:
    """A patch: the DEP-3 header, '---', new-file sections generated from patches/src, then hand-written edits."""
    parts = [header.rstrip("\n") + "\n---\n"]
    parts += [new_file_section(rel) for rel in new_files]
    parts += [e if e.endswith("\n") else e + "\n" for e in edits]
    return "".join(parts)


def stale_new_files(patch: Path) -> list[str]:
    _, sections = split_patch(patch.read_text())
    return [path for path, text in sections
            if "\nnew file mode " in text.split("@@", 1)[0] and text != new_file_section(path)]


def refresh_new_files(patch: Path) -> list[str]:
    """Rewrite the new-file sections of `patch` from patches/src; returns the paths that changed."""
    head, sections = split_patch(patch.read_text())
    changed, out = [], [head]
    for path, text in sections:
        if "\nnew file mode " in text.split("@@", 1)[0]:
            fresh = new_file_section(path)
            if fresh != text:
                changed.append(path)
            text = fresh
        out.append(text)
    patch.write_text("".join(out))
    return changed


def build_patched_tree(pin_tree: Path, dest: Path, patches: list[Path] = None) -> Path:
    """Copy the pinned checkout (without .git) to dest and apply the series; returns dest."""
    shutil.copytree(pin_tree, dest, symlinks=True, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    for patch in series() if patches is None else patches:
        proc = subprocess.run(["git", "apply", "--whitespace=error-all", "-p1", str(patch)], cwd=dest,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"git apply {patch.name} failed in {dest}:\n{proc.stderr}")
    return dest


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        changed = refresh_new_files(Path(arg))
        print(f"{arg}: {'refreshed ' + ', '.join(changed) if changed else 'up to date'}")
