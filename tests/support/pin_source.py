"""Pure helper functions of the pinned upstream, compiled from the pin's own source (test support).

Upstream modules such as comfy_extras/nodes_minimax_h3.py import torch and ComfyUI at the top, but some of
their helpers (frame alignment, latent lengths, canvas adaptation) are plain arithmetic. pin_functions()
takes those function definitions, and the module-level constants they read, out of the checked-out pin and
compiles them alone, so tests compare h3kit's copies with the pin's code itself, in any interpreter.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path


def pin_functions(pin_tree: Path, path: str, names) -> dict:
    """{name: function} for the module-level functions `names` of `path` in the pin checkout `pin_tree`."""
    tree = ast.parse((Path(pin_tree) / path).read_text(), filename=path)
    keep = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            keep.append(node)
        elif (isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets)):
            keep.append(node)  # constants such as FPS or MAX_PIXELS
    found = {n.name for n in keep if isinstance(n, ast.FunctionDef)}
    missing = set(names) - found
    if missing:
        raise LookupError(f"{path} at the pin has no function(s) {sorted(missing)}")
    namespace = {"math": math}
    exec(compile(ast.Module(body=keep, type_ignores=[]), f"<pin {path}>", "exec"), namespace)
    return {name: namespace[name] for name in names}
