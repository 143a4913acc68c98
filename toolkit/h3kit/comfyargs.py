"""ComfyUI's own command-line rules, read from the tree, to check what `h3kit start -- ARGS` passes through.

ComfyUI parses its arguments with argparse (comfy/cli_args.py), which accepts any unambiguous prefix of a
long option: `--liste 0.0.0.0` is `--listen 0.0.0.0`, `--por 8308` is `--port 8308`. A plain name check
would let such arguments change the listen address, the port or the devices behind h3kit's back (the
record and `status` would then describe a server that does not exist). So this module reads
comfy/cli_args.py with `ast` (nothing from the tree is executed), rebuilds a parser with the same option
strings, value counts (nargs, const), store_true flags, choices of its enums and mutually exclusive groups,
and parses with it:

- ARGS alone, to see which options they set, prefixes resolved as ComfyUI resolves them; options that
  decide the address, the port or the devices are refused (`OWNED`);
- h3kit's own arguments plus ARGS, so that anything ComfyUI's parser would reject (an unknown option, an
  ambiguous prefix, two options of one exclusive group, a value that is not a number) is refused before a
  server is started, with argparse's own message.

Validators the replica cannot copy (a function checking that a folder exists) are ComfyUI's to apply: such
an argument passes here, the server exits at once, and `h3kit status` / `logs --errors` show argparse's
error line.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from h3kit.errors import UsageError

CLI_ARGS = "comfy/cli_args.py"
MAX_ARGS = 200             # after `--`: more is a mistake, and the record keeps them all
MAX_ARG_CHARS = 4096

# dest: why h3kit owns it. `cpu` is allowed on a cpu start, where h3kit passes --cpu itself.
OWNED = {
    "listen": "the listen address (use h3kit's --listen)",
    "port": "the port (use h3kit's --port)",
    "cuda_device": "the devices (use h3kit's --devices)",
    "default_device": "the devices (use h3kit's --devices)",
    "directml": "the devices (use h3kit's --devices and --device-type)",
    "oneapi_device_selector": "the devices (use h3kit's --devices)",
    "cpu": "the device type (use h3kit's --device-type cpu)",
    "tls_keyfile": "the URL scheme: h3kit reaches the server over plain HTTP",
    "tls_certfile": "the URL scheme: h3kit reaches the server over plain HTTP",
    "help": "nothing: ComfyUI prints its help and exits",
    "list_feature_flags": "nothing: ComfyUI prints its feature flags and exits",
    "quick_test_for_ci": "nothing: ComfyUI exits after its start-up test",
}


class ExtraArgsError(UsageError):
    code = "bad_extra_args"


class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _Refused(message)

    def exit(self, status=0, message=None):
        raise _Refused(message or f"exit {status}")


def _literal(node):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _enum_values(tree: ast.Module) -> dict[str, list[str]]:
    """{class name: member values} of the Enum classes cli_args.py defines (their values are the choices)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any("Enum" in ast.unparse(b) for b in node.bases):
            values = [v for stmt in node.body if isinstance(stmt, ast.Assign)
                      for v in [_literal(stmt.value)] if isinstance(v, str)]
            if values:
                out[node.name] = values
    return out


def load_rules(comfy_home: Path) -> "_Parser":
    """The replica parser of the tree's comfy/cli_args.py; ExtraArgsError when there is none to read."""
    path = Path(comfy_home) / CLI_ARGS
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
    except (OSError, ValueError, SyntaxError, RecursionError, MemoryError) as e:
        raise ExtraArgsError(f"cannot read ComfyUI's options from {path} ({type(e).__name__}), so arguments "
                             "after -- cannot be checked", hint="install the tree with h3kit install, or start "
                             "without arguments after --") from None
    enums = _enum_values(tree)
    parser = _Parser(prog="main.py", add_help=False, allow_abbrev=True, argument_default=argparse.SUPPRESS)
    parser.add_argument("-h", "--help", action="store_true")  # argparse's default, as ComfyUI keeps it
    containers: dict[str, argparse._ActionsContainer] = {}
    # assignments in file order: `parser = argparse.ArgumentParser()`, `g = parser.add_..._group()`
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            call = stmt.value
            name = stmt.targets[0].id
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
                if call.func.attr == "ArgumentParser":
                    containers[name] = parser
                elif call.func.attr in ("add_mutually_exclusive_group", "add_argument_group") and \
                        isinstance(call.func.value, ast.Name) and call.func.value.id in containers:
                    containers[name] = getattr(containers[call.func.value.id], call.func.attr)()
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "add_argument" and isinstance(node.func.value, ast.Name) and \
                    node.func.value.id in containers:
                _add(containers[node.func.value.id], node, enums)
    if len(parser._actions) < 3:
        raise ExtraArgsError(f"{path} defines no ComfyUI options h3kit can read, so arguments after -- cannot "
                             "be checked", hint="start without arguments after --")
    return parser


def _add(container, call: ast.Call, enums: dict[str, list[str]]) -> None:
    flags = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    if not flags or not all(f.startswith("-") for f in flags):
        return
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    opts: dict = {}
    action = _literal(kw["action"]) if "action" in kw else None
    if action in ("store_true", "store_false", "count", "help", "version"):
        opts["action"] = "store_true" if action in ("help", "version") else action
    else:
        # store, append, or a class of cli_args.py's own (EnumAction, VerboseAction): values as nargs says
        if action in ("append", "extend"):
            opts["action"] = "append"
        elif action in ("store_const", "append_const"):
            opts["action"] = "store_true"
        if "nargs" in kw:
            nargs = _literal(kw["nargs"])
            if isinstance(nargs, int) or nargs in ("?", "*", "+"):
                opts["nargs"] = nargs
        if "const" in kw and opts.get("nargs") == "?":
            opts["const"] = _literal(kw["const"])  # ComfyUI's own, which its type accepts
        typ = kw.get("type")
        if isinstance(typ, ast.Name):
            if typ.id in ("int", "float"):
                opts["type"] = {"int": int, "float": float}[typ.id]
            elif typ.id in enums:
                opts["choices"] = enums[typ.id]
        choices = _literal(kw["choices"]) if "choices" in kw else None
        if isinstance(choices, (list, tuple)) and all(isinstance(c, str) for c in choices):
            opts["choices"] = list(choices)
    if "dest" in kw and isinstance(_literal(kw["dest"]), str):
        opts["dest"] = _literal(kw["dest"])
    try:
        container.add_argument(*flags, **opts)
    except (argparse.ArgumentError, ValueError, TypeError):
        pass  # a flag defined twice, or a form the replica does not know: ComfyUI's parser still judges it


def _action_for(parser: argparse.ArgumentParser, token: str):
    """The option a user's token stands for, resolved as ComfyUI resolves it (for messages)."""
    name = token.split("=", 1)[0]
    exact = [a for a in parser._actions if name in a.option_strings]
    if exact:
        return exact[0], name
    matches = [(a, s) for a in parser._actions for s in a.option_strings
               if s.startswith("--") and s.startswith(name)]
    return matches[0] if len(matches) == 1 else (None, None)


def check(comfy_home: Path, extra: list[str], own: list[str], device_type: str) -> list[str]:
    """`extra` if ComfyUI would accept it after h3kit's `own` arguments without h3kit losing control of
    the address, the port or the devices; ExtraArgsError naming the argument otherwise."""
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise ExtraArgsError("arguments after -- must be a list of strings")
    if len(extra) > MAX_ARGS or any(len(a) > MAX_ARG_CHARS or "\0" in a for a in extra):
        raise ExtraArgsError(f"arguments after --: at most {MAX_ARGS}, each under {MAX_ARG_CHARS} characters "
                             "and without NUL bytes")
    if not extra:
        return []
    parser = load_rules(comfy_home)
    try:
        given = vars(parser.parse_args(extra))
    except _Refused as e:
        raise ExtraArgsError(f"ComfyUI would reject the arguments after --: {e}",
                             hint="see `python main.py --help` in the tree for its options") from None
    for dest in given:
        if dest in OWNED and not (dest == "cpu" and device_type == "cpu"):
            token = next((t for t in extra if t.startswith("-") and getattr(_action_for(parser, t)[0], "dest", None)
                          == dest), dest)
            option = _action_for(parser, token)[1] or token
            said = f"{token} (ComfyUI reads it as {option})" if option != token.split("=", 1)[0] else token
            raise ExtraArgsError(f"{said} after -- would set {OWNED[dest]}",
                                 hint="h3kit records and checks the address, port and devices it starts the "
                                      "server with: set them with h3kit's own options")
    try:
        parser.parse_args(own + extra)
    except _Refused as e:
        raise ExtraArgsError(f"ComfyUI would reject the arguments after -- together with h3kit's "
                             f"({' '.join(own)}): {e}", hint="remove the conflicting argument") from None
    return list(extra)


def dests(comfy_home: Path, extra: list[str]) -> set[str]:
    """The options (argparse dests, prefixes resolved as ComfyUI resolves them) that `extra` sets; extra is
    assumed checked (`check`)."""
    if not extra:
        return set()
    try:
        return set(vars(load_rules(comfy_home).parse_args(extra)))
    except _Refused:
        return set()
