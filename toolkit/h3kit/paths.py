"""Where h3kit finds its own data (patches, manifest, shipped files) and its caches."""

from __future__ import annotations

import os
from pathlib import Path

from h3kit.errors import H3kitError

MANIFEST_NAME = "source_deps_info.json"


def repo_root() -> Path:
    """The h3kit checkout holding patches/, additional_files/ and the manifest.

    `H3KIT_ROOT` overrides; otherwise the checkout this package was installed from (h3kit is installed
    editable, `pip install -e .`, so its data stays beside the code).
    """
    env = os.environ.get("H3KIT_ROOT")
    root = Path(env) if env else Path(__file__).resolve().parents[2]
    if not (root / MANIFEST_NAME).is_file():
        raise H3kitError(f"h3kit data not found: {root / MANIFEST_NAME} is missing",
                         code="no_h3kit_data",
                         hint="install h3kit editable from its checkout (pip install -e .) or set H3KIT_ROOT")
    return root


def cache_dir() -> Path:
    return Path(os.environ.get("H3KIT_CACHE") or Path.home() / ".cache" / "h3kit")
