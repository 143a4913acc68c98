"""Read the commands, ports and file references out of README.md and docs/*.md, and check them against h3kit's
CLI and the files the repository and the wheel carry (tests/test_docs.py). Parsing only: nothing is run.

A command is an `h3kit ...` invocation on a line of a fenced (```) or indented code block, after an optional
prompt, environment assignments or a shell separator; `\\` continues it on the next line, `#` starts a comment.
A synopsis (`h3kit start --comfy-home DIR [--port 8189] [--device-type auto|npu]`) is read as a command: its
brackets dropped, a|b|c read as a; a bracketed option with a literal value claims that value is the default.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PORT_COMMAND = ("start",)  # whose --port default is the service's port
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\.\.\.)?$|^[A-Z_]+=|^<.*>$|\.\.\.$")
_START = re.compile(r"(?:^|[;&|(]\s*|^\$\s+|^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+)(?:sudo\s+(?:-\S+\s+)*)?h3kit\s")
_OUTPUT = re.compile(r"h3kit\s+\S*:(\s|$)")
_LOOPBACK_URL = re.compile(r"(?:https?://(?:127\.0\.0\.1|localhost|\[::1\])|sport = ):(\d+)")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def code_blocks(text: str) -> list[tuple[int, list[str]]]:
    """[(first line number, lines)] of every fenced block and every indented block after a blank line."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].lstrip().startswith("```"):
                j += 1
            out.append((i + 2, lines[i + 1:j]))
            i = j + 1
            continue
        if lines[i].startswith("    ") and lines[i].strip() and (i == 0 or not lines[i - 1].strip()) \
                and not re.match(r"\s*([-*|]|\d+\.)\s", lines[i]):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            out.append((i + 1, [ln[4:] for ln in lines[i:j]]))
            i = j
            continue
        i += 1
    return out


def commands(path: Path) -> list[tuple[int, str]]:
    """[(line number, command text)] of every h3kit command in the file's code blocks."""
    out = []
    for first, block in code_blocks(path.read_text(encoding="utf-8")):
        joined, start = "", None
        for k, line in enumerate(block):
            if start is None:
                start = first + k
            if line.rstrip().endswith("\\"):
                joined += line.rstrip()[:-1] + " "
                continue
            joined += line
            m = _START.search(joined)
            if m and not _OUTPUT.match(joined[m.end() - len("h3kit "):]):  # output, not a command
                text = joined[m.end() - len("h3kit "):]
                out.append((start, _strip_comment(text)))
            joined, start = "", None
    return out


def inline_commands(path: Path) -> list[tuple[int, str]]:
    """[(line number, command text)] of every inline code span that starts with `h3kit ` (output lines such as
    `h3kit watch: ...` left out)."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        out += [(n, m.group(1)) for m in re.finditer(r"`(h3kit [^`]+)`", line) if not _OUTPUT.match(m.group(1))]
    return out


def is_mention(text: str, problems: list[str]) -> bool:
    """Whether an inline span names a command group or an option in prose (`h3kit models`, `h3kit start
    --devices`) rather than showing a command: the only problem is the missing subcommand or the last option's
    missing value."""
    return len(problems) == 1 and (problems[0].endswith("no subcommand given") or
                                   (problems[0].endswith("requires an argument.") and text.split()[-1].startswith("--")))


def _strip_comment(text: str) -> str:
    quote = None
    for i, ch in enumerate(text):
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip()
    return text.rstrip()


def _words(command: str) -> tuple[list[str], dict[str, str]]:
    """The argument words (synopsis brackets dropped, a|b read as a) and {option: literal value} of every
    bracketed `[--option value]` (the text's claim of the default)."""
    claims = {m.group(1): m.group(2) for m in re.finditer(r"\[(--[a-z][a-z0-9-]*) ([^\]\s|]+)\]", command)}
    depth, kept = 0, []
    for i, ch in enumerate(command):  # " | " inside [...] or (...) separates alternatives; outside, a shell pipe
        depth += ch in "[(" and 1 or ch in "])" and -1 or 0
        spaced = ch == "|" and command[i - 1:i] == " " and command[i + 1:i + 2] == " "
        kept.append(" " if ch in "[]()" or (spaced and depth > 0) else ch)
    command = re.split(r"\s(?:\||&&|;|>|2>)\s", "".join(kept))[0]
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    # "..." after an option is its elided value; elsewhere it repeats what came before; {2,4,8} reads as 2
    words = [re.sub(r"^\{([^,}]+).*\}$", r"\1", w) for k, w in enumerate(words)
             if not (w.endswith("...") and not (k and words[k - 1].startswith("--")))]
    words = [w.split("|")[0] if "|" in w and not w.startswith("-") else w for w in words]
    return words[1:], claims


def check(main: click.Group, command: str) -> list[str]:
    """What is wrong with one documented command: an unknown subcommand or option, a group without its
    subcommand, a value the option refuses, a bracketed value that is not the option's default."""
    args, claims = _words(command)
    cmd, path, problems = main, ["h3kit"], []
    while isinstance(cmd, click.Group):
        ctx = click.Context(cmd, info_name=" ".join(path))
        try:
            opts, rest, _ = cmd.make_parser(ctx).parse_args(args=list(args))
        except click.UsageError as e:
            return [f"{' '.join(path)}: {e.format_message()}"]
        if not rest:
            return problems if {"--help", "--version"} & set(args) else [f"{' '.join(path)}: no subcommand given"]
        sub = cmd.get_command(ctx, rest[0])
        if sub is None and _PLACEHOLDER.search(rest[0]) and {"--help"} & set(args):
            return problems  # `h3kit COMMAND --help`
        if sub is None:
            return [f"{' '.join(path)}: no subcommand {rest[0]!r}"]
        cmd, path, args = sub, path + [rest[0]], rest[1:]
    problems += _parse(cmd, path, args)
    problems += _claims(cmd, path, claims)
    return problems


def _parse(cmd: click.Command, path: list[str], args: list[str]) -> list[str]:
    """Options and their values as click reads them; a placeholder (DIR, WORKFLOW..., <id>) is any value, and a
    missing required option or argument is the text's business (an elided part), not an error."""
    try:
        ctx = click.Context(cmd, info_name=" ".join(path))  # the parser alone: required values are not checked
        parser = cmd.make_parser(ctx)
        opts, rest, order = parser.parse_args(args=list(args))
    except click.UsageError as e:
        return [f"{' '.join(path)}: {e.format_message()}"]
    problems = []
    for param in order:
        value = opts.get(param.name)
        if value is None or not isinstance(param, click.Option) or param.is_flag:
            continue
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, str) and not _PLACEHOLDER.search(v) and "$" not in v and not isinstance(
                    param.type, click.Path):
                try:
                    param.type.convert(v, param, ctx)
                except click.BadParameter as e:
                    problems.append(f"{' '.join(path)} {param.opts[0]} {v}: {e.format_message()}")
    arguments = [p for p in cmd.params if isinstance(p, click.Argument)]
    if rest and not arguments and not cmd.allow_extra_args:
        problems.append(f"{' '.join(path)}: unexpected argument(s) {rest}")
    return problems


def _claims(cmd: click.Command, path: list[str], claims: dict[str, str]) -> list[str]:
    out = []
    for opt, value in claims.items():
        param = next((p for p in cmd.params if opt in getattr(p, "opts", ())), None)
        default = param.default if param is not None else None
        if param is None or _PLACEHOLDER.search(value) or getattr(param, "multiple", False) \
                or not isinstance(default, (int, float, str)) or isinstance(default, bool):
            continue
        same = str(default) == value
        if isinstance(default, (int, float)):
            try:
                same = float(value) == float(default)
            except ValueError:
                same = False
        if not same:
            out.append(f"{' '.join(path)} [{opt} {value}]: the default is {param.default}")
    return out


def loopback_ports(path: Path) -> list[tuple[int, int]]:
    """[(line number, port)] of every loopback URL (and `ss ... sport = :N`) in the file."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        out += [(n, int(m.group(1))) for m in _LOOPBACK_URL.finditer(line)]
    return out


def ports_given(path: Path) -> set[int]:
    """The ports the file's commands give with --port (a URL on such a port is that server's)."""
    return {int(m.group(1)) for m in re.finditer(r"--port[ =](\d+)", path.read_text(encoding="utf-8"))}


# -------------------------------------------------------------------------------------------- links

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
# a path in inline code that leaves the page's folder, or names a file beside it (`./comfyui`, a folder the
# reader makes, is not a reference)
_CODE_PATH = re.compile(r"`(\.\./[^`\s]+|\./[^`\s]+\.(?:md|json|py|sh|ya?ml|png|txt|toml|cfg))`")


def relative_links(path: Path) -> list[tuple[int, str]]:
    """[(line number, target)] of every relative link and every `./` or `../` path in inline code."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for m in _LINK.finditer(line):
            target = m.group(1) or m.group(2)
            if not re.match(r"^[a-z][a-z0-9+.-]*:|^#", target):
                out.append((n, target.split("#", 1)[0]))
        out += [(n, m.group(1)) for m in _CODE_PATH.finditer(line)]
    return out


def carried(doc: Path, target: str) -> bool:
    """Whether a clone or the wheel has the link's file. The wheel's h3kit/_data/ holds a part of the checkout
    with the same layout (setup.py: DATA_ENTRIES and DOC_ENTRIES), so the question is whether the file is inside
    the checkout, not beside it (a sibling folder of this machine is in neither)."""
    resolved = (doc.parent / target).resolve()
    try:
        resolved.relative_to(ROOT)
    except ValueError:
        return False
    return resolved.exists()
