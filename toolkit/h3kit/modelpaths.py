"""The H3 section of ComfyUI's extra_model_paths.yaml: model folders on shared storage (`install --models-dir`).

The section comes from the template additional_files/extra_model_paths.h3kit.yaml.example (its lines from
the first one naming a section on), one copy per models folder (sections h3kit_1, h3kit_2, ...), and lives
in the tree's extra_model_paths.yaml between two marker lines. Merging keeps the user's file as it was,
byte for byte, outside the markers (their sections and comments); the result is parsed back and must hold
every one of their sections unchanged plus the H3 ones, else nothing is written. The pin reads the file with
utils/extra_config.py (base_path joined to each line, expandvars and expanduser applied): a folder whose
path those would change is refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from h3kit.errors import H3kitError, UsageError

CONFIG = "extra_model_paths.yaml"
TEMPLATE = "extra_model_paths.h3kit.yaml.example"  # under additional_files/
BEGIN = "# >>> h3kit: written by `h3kit install --models-dir` (revert removes it); your own sections go outside"
END = "# <<< h3kit"
SECTION_PREFIX = "h3kit_"
KINDS = ("diffusion_models", "text_encoders", "vae", "loras")


class ModelPathsError(H3kitError):
    code = "extra_model_paths"


def names(model_dirs: dict[str, list[str]], folder: str) -> bool:
    """Whether ComfyUI's search paths (`model_dirs`, kind -> folders, as h3kit.workflow.models reads them)
    include `folder`/<kind> for each of the H3 kinds: what an h3kit section for `folder` adds."""
    return all(os.path.normpath(os.path.join(folder, kind)) in model_dirs.get(kind, []) for kind in KINDS)


def check_dirs(dirs: list[str]) -> list[str]:
    """Absolute, de-duplicated folders, in order. Bad input: a path with characters the pin would expand
    ($, ~) or that YAML lines cannot carry (newlines), or a file."""
    out: list[str] = []
    for d in dirs:
        if "\n" in d or "\r" in d or "$" in d or d.startswith("~"):
            raise UsageError(f"--models-dir {d!r}: ComfyUI would expand or split this path",
                             code="bad_models_dir", hint="give the folder's plain absolute path")
        path = os.path.abspath(d)
        if os.path.exists(path) and not os.path.isdir(path):
            raise UsageError(f"--models-dir {d} is a file, not a folder", code="bad_models_dir",
                             hint="give the folder that holds diffusion_models/, text_encoders/, vae/ and loras/")
        if path not in out:
            out.append(path)
    return out


def render(template: str, dirs: list[str]) -> str:
    """The marked block for `dirs` ("" for none)."""
    if not dirs:
        return ""
    lines = template.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln and not ln.startswith(("#", " "))), None)
    if start is None:
        raise ModelPathsError(f"the template {TEMPLATE} names no section")
    body = "\n".join(lines[start:]) + "\n"
    sections = [body.replace("{index}", str(i)).replace("{models_dir}", json.dumps(d))
                for i, d in enumerate(dirs, 1)]
    return BEGIN + "\n" + "".join(sections) + END + "\n"


def split(text: str) -> tuple[str, str]:
    """(the user's part, h3kit's block) of the file's text; the block's marker lines included."""
    lines = text.splitlines(keepends=True)
    begins = [i for i, ln in enumerate(lines) if ln.rstrip("\r\n") == BEGIN]
    ends = [i for i, ln in enumerate(lines) if ln.rstrip("\r\n") == END]
    if not begins and not ends:
        return text, ""
    if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0]:
        raise ModelPathsError(f"{CONFIG}: h3kit's marker lines are damaged (one '{BEGIN[:11]}...' and one "
                              f"'{END}' line, in that order, are expected)",
                              hint=f"remove h3kit's lines from {CONFIG} by hand, then run h3kit install again")
    b, e = begins[0], ends[0]
    cut = b - 1 if b > 0 and lines[b - 1] in ("\n", "\r\n") else b  # the blank line merge() puts before it
    return "".join(lines[:cut] + lines[e + 1:]), "".join(lines[b:e + 1])


def _load(text: str, what: str) -> dict:
    import yaml

    try:
        data = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ModelPathsError(f"{what} is not valid YAML: {str(e).splitlines()[0]}",
                              hint=f"fix {CONFIG} (see extra_model_paths.yaml.example in the tree)") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ModelPathsError(f"{what} is not a mapping of sections", hint=f"fix {CONFIG}")
    return data


def _text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ModelPathsError(f"{CONFIG} is not UTF-8 text", hint=f"fix {CONFIG}: ComfyUI reads it as UTF-8") from None


def merge(current: bytes | None, template: str, dirs: list[str]) -> bytes | None:
    """The file with h3kit's block for `dirs` (none: the block removed); None when nothing is left of a file
    that held only h3kit's block. Raises ModelPathsError when the user's part cannot be kept intact."""
    text = _text(current) if current is not None else ""
    user, _ = split(text)
    if not dirs:  # only h3kit's block goes: the user's part is kept as it is, whatever it holds
        return user.encode("utf-8") if current is not None and user.strip() else None
    mine = _load(user, CONFIG)
    taken = sorted(k for k in mine if str(k).startswith(SECTION_PREFIX))
    if taken:
        raise ModelPathsError(f"{CONFIG} has sections named like h3kit's own, outside its markers: "
                              + ", ".join(map(str, taken)), hint=f"rename them (h3kit writes {SECTION_PREFIX}1, ...)")
    block = render(template, dirs)
    merged = user + ("" if not user or user.endswith("\n") else "\n") + ("\n" if user.strip() else "") + block
    refused = ModelPathsError(f"h3kit's section cannot follow what {CONFIG} holds without changing your own "
                              "entries (a flow-style {...} mapping, or a last entry left open)",
                              hint=f"write {CONFIG} in block style, one 'name:' line per section, then run h3kit "
                                   "install again")
    try:
        parsed = _load(merged, CONFIG)
    except ModelPathsError:
        raise refused from None
    if {k: v for k, v in parsed.items() if not str(k).startswith(SECTION_PREFIX)} != mine:
        raise refused
    for i, d in enumerate(dirs, 1):
        section = parsed.get(f"{SECTION_PREFIX}{i}") or {}
        if section.get("base_path") != d or not set(KINDS) <= set(section):
            raise ModelPathsError(f"the template {TEMPLATE} does not give section {SECTION_PREFIX}{i} the "
                                  f"base_path {d} and the folders {', '.join(KINDS)}")
    return merged.encode("utf-8")


def read_template(root: Path) -> str:
    path = root / "additional_files" / TEMPLATE
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise ModelPathsError(f"cannot read the template {path}: {e.strerror or e}",
                              hint="reinstall h3kit: its data is incomplete") from None


def block_in(home: Path) -> str:
    """h3kit's block as it stands in the tree's file ("" when there is none, or no file)."""
    path = home / CONFIG
    if not path.is_file():
        return ""
    return split(_text(path.read_bytes()))[1]
