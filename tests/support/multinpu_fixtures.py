"""The patched ComfyUI tree the runtime tests run in, built once per session.

Until the install engine's `installed_tree` fixture lands, this copies `pin_tree` and applies
patches/series (tests/support/multinpu_tree.py). Switching over is this one function: return the
installed tree instead.
"""

from __future__ import annotations

from pathlib import Path

import multinpu_tree

_BUILT = {}


def patched_tree_for(pin_tree: Path, tmp_path_factory) -> Path:
    key = str(pin_tree)
    if key not in _BUILT:
        dest = tmp_path_factory.mktemp("multinpu") / "ComfyUI"
        _BUILT[key] = multinpu_tree.build_patched_tree(Path(pin_tree), dest)
    return _BUILT[key]
