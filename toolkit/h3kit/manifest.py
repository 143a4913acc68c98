"""source_deps_info.json: the pin, the Python range, the torch / torch-npu pairing, and the patch list.

Install and verify check against this file; `h3kit patches refresh` rewrites its "patches" list.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from h3kit.errors import H3kitError
from h3kit.paths import MANIFEST_NAME, repo_root


class ManifestError(H3kitError):
    code = "manifest"


def load(root: Path | None = None) -> dict:
    path = (root or repo_root()) / MANIFEST_NAME
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ManifestError(f"cannot read {path}: {e}") from None
    for key in ("upstream", "python", "torch", "patches"):
        if key not in data:
            raise ManifestError(f"{path}: missing {key!r}")
    return data


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    return sha256_bytes(Path(path).read_bytes())


def git_blob_id(data: bytes) -> str:
    """The id git gives `data` as a blob (what `git hash-object` prints), without running git."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def pin(data: dict) -> str:
    return data["upstream"]["commit"]


def patch_entry(data: dict, name: str) -> dict | None:
    return next((p for p in data["patches"] if p["name"] == name), None)
