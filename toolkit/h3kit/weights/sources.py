"""Where a model file comes from: the workflow's own `properties.models`, else h3kit's manifest.

A source is either a Hugging Face file (repository, path, revision: fetched with huggingface_hub from
HF_ENDPOINT, so a mirror serves it too) or a plain URL (fetched over HTTPS with resume). A URL on
huggingface.co (or hf.co, or the HF_ENDPOINT host) of the form /<owner>/<repo>/resolve/<revision>/<path> is
a Hugging Face file; a `datasets/` repository is one too. Any other https:// URL is a plain one; plain
http:// is refused (anyone on the way could change the file) except on a loopback host (a mirror on this
machine), and so is every other scheme.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import urllib.parse

from h3kit.errors import H3kitError
from h3kit.paths import repo_root

MANIFEST = ("workflows", "models", "manifest.json")
# another manifest in place of h3kit's (a mirror with its own files; tests whose stand-in hub serves small files)
MANIFEST_ENV = "H3KIT_MODELS_MANIFEST"
HF_HOSTS = ("huggingface.co", "hf.co", "www.huggingface.co")
DEFAULT_ENDPOINT = "https://huggingface.co"
# ComfyUI's legacy folder names in a `directory` (folder_paths.py at the pin)
LEGACY_DIRECTORIES = {"unet": "diffusion_models", "clip": "text_encoders"}
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_RESOLVE = re.compile(r"^/(?:(datasets|spaces)/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


class Source:
    """One place a file can be fetched from. `repo` is set for a Hugging Face file, else `url` is plain;
    `refused` says why a URL cannot be fetched (None when it can). `size` and `sha256` are what the
    workflow or the manifest publish (None when unknown); `origin` says which of the two it came from."""

    def __init__(self, *, origin: str, repo: str | None = None, path: str | None = None, revision: str = "main",
                 repo_type: str = "model", url: str | None = None, size: int | None = None,
                 sha256: str | None = None, refused: str | None = None, published_by=()):
        self.origin = origin
        self.repo = repo
        self.path = path
        self.revision = revision
        self.repo_type = repo_type
        self.url = url if url is not None else hf_url(repo, path, revision, repo_type)
        self.size = size
        self.sha256 = sha256
        self.refused = refused
        self.published_by = list(published_by)

    @property
    def is_hf(self) -> bool:
        return self.repo is not None

    def to_dict(self) -> dict:
        out = {"origin": self.origin, "url": self.url, "size": self.size, "sha256": self.sha256}
        if self.is_hf:
            out.update(repo=self.repo, path=self.path, revision=self.revision)
            if self.repo_type != "model":
                out["repo_type"] = self.repo_type
        if self.refused:
            out["refused"] = self.refused
        if self.origin == "manifest":
            out["published_by"] = self.published_by
        return out


def hf_url(repo: str | None, path: str | None, revision: str = "main", repo_type: str = "model") -> str | None:
    """The huggingface.co URL of a Hub file, as people know it (fetch itself goes to HF_ENDPOINT)."""
    if repo is None or path is None:
        return None
    prefix = "" if repo_type == "model" else f"{repo_type}s/"
    return f"{DEFAULT_ENDPOINT}/{prefix}{repo}/resolve/{urllib.parse.quote(revision, safe='')}/" \
           f"{urllib.parse.quote(path)}"


def endpoint() -> str:
    """HF_ENDPOINT as huggingface_hub reads it, read afresh (huggingface_hub keeps the value it saw at import)."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _is_loopback(host: str | None) -> bool:
    return bool(host) and (host == "localhost" or host == "::1" or host.startswith("127."))


def from_url(url: str, *, origin: str, size: int | None = None, sha256: str | None = None) -> Source:
    """The source a URL names (see the module docstring); a URL that cannot be fetched has `refused` set."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return Source(origin=origin, url=url, refused="not a URL", size=size, sha256=sha256)
    host = (parts.hostname or "").lower()
    hub_hosts = set(HF_HOSTS) | {urllib.parse.urlsplit(endpoint()).hostname or ""}
    if parts.scheme in ("http", "https") and host in hub_hosts:
        m = _RESOLVE.match(parts.path)
        if m:
            kind, repo, revision, path = m.groups()
            if kind == "spaces":
                return Source(origin=origin, url=url, size=size, sha256=sha256,
                              refused="a file of a Space, not of a model repository: download it by hand")
            return Source(origin=origin, repo=urllib.parse.unquote(repo), path=urllib.parse.unquote(path),
                          revision=urllib.parse.unquote(revision), repo_type="dataset" if kind else "model",
                          size=size, sha256=sha256)
    if parts.scheme == "https" and host:
        return Source(origin=origin, url=url, size=size, sha256=sha256)
    if parts.scheme == "http" and _is_loopback(host):
        return Source(origin=origin, url=url, size=size, sha256=sha256)
    why = ("plain http: anyone on the way can change the file; give an https:// URL" if parts.scheme == "http"
           else f"{parts.scheme or 'no'} scheme: h3kit fetches https:// URLs and Hugging Face files only")
    return Source(origin=origin, url=url, size=size, sha256=sha256, refused=why)


def _int_or_none(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _sha_or_none(value) -> str | None:
    return value.lower() if isinstance(value, str) and _SHA256.match(value.lower()) else None


def normal_directory(directory) -> str | None:
    if not isinstance(directory, str) or not directory:
        return None
    return LEGACY_DIRECTORIES.get(directory, directory)


# ------------------------------------------------------------------------------------- properties.models

def workflow_entries(data) -> dict[tuple[str | None, str], dict]:
    """{(directory or None, name): entry} for every `properties.models` entry of a UI workflow's nodes, the
    nodes of its subgraph definitions included, and of its top-level `models` list (older frontends); an
    API prompt has none. The first entry of a name wins."""
    out: dict = {}
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        return out
    lists = [data.get("models")]
    graphs = [data]
    definitions = data.get("definitions")
    if isinstance(definitions, dict) and isinstance(definitions.get("subgraphs"), list):
        graphs += [g for g in definitions["subgraphs"] if isinstance(g, dict)]
    for g in graphs:
        for node in g.get("nodes") or ():
            props = node.get("properties") if isinstance(node, dict) else None
            if isinstance(props, dict):
                lists.append(props.get("models"))
    for entries in lists:
        if not isinstance(entries, list):
            continue
        for e in entries:
            if isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("url"), str):
                out.setdefault((normal_directory(e.get("directory")), e["name"]), e)
    return out


def entry_source(entry: dict) -> Source:
    sha = _sha_or_none(entry.get("hash")) if str(entry.get("hash_type", "")).lower() == "sha256" else None
    return from_url(entry["url"], origin="workflow", size=_int_or_none(entry.get("size")), sha256=sha)


# -------------------------------------------------------------------------------------------- manifest

_manifest_cache: dict = {}
_notes: dict = {}


def load_manifest() -> dict[tuple[str, str], list[Source]]:
    """{(directory, name): [Source, ...]} from h3kit's manifest, in the order fetch tries them."""
    try:
        path = manifest_path()
    except H3kitError:  # no h3kit data at all: install and the rest say so; here, no manifest sources
        return {}
    key = (str(path), path.stat().st_mtime_ns if path.is_file() else None)
    if key in _manifest_cache:
        return _manifest_cache[key]
    out: dict = {}
    if key[1] is not None:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        for entry in doc.get("files", []):
            sources = []
            for s in entry.get("sources", []):
                sources.append(Source(origin="manifest", repo=s["repo"], path=s["path"],
                                      revision=s.get("revision", "main"), repo_type=s.get("repo_type", "model"),
                                      size=_int_or_none(s.get("size", entry.get("size"))),
                                      sha256=_sha_or_none(s.get("sha256", entry.get("sha256"))),
                                      published_by=s.get("published_by", ())))
            key_ = (normal_directory(entry["directory"]), entry["name"])
            out[key_] = sources
            if entry.get("note"):
                _notes[key_] = entry["note"]
    _manifest_cache.clear()
    _manifest_cache[key] = out
    return out


def manifest_path():
    """h3kit's manifest (workflows/models/manifest.json of its data), or the file $H3KIT_MODELS_MANIFEST names."""
    from pathlib import Path

    env = os.environ.get(MANIFEST_ENV)
    return Path(env) if env else repo_root().joinpath(*MANIFEST)


def sources_for(kind: str, name: str, entries: dict | None = None) -> list[Source]:
    """The sources of the file `name` a loader of model kind `kind` loads: the workflow's entry (matched by
    name, and by directory when the entry gives one) first, then the manifest's."""
    out = []
    if entries:
        entry = entries.get((kind, name)) or entries.get((None, name))
        if entry is not None:
            out.append(entry_source(entry))
    return dedupe(out + load_manifest().get((kind, name), []))


def dedupe(sources: list[Source]) -> list[Source]:
    """One source per place: the workflow and the manifest usually name the same Hub file, which fetch would
    otherwise ask (and report failing) twice. The first keeps its place and origin and takes a size or sha256
    only a later one publishes."""
    out: list[Source] = []
    for s in sources:
        same = next((o for o in out if o.url == s.url), None)
        if same is None:
            out.append(s)
            continue
        same.size = same.size if same.size is not None else s.size
        same.sha256 = same.sha256 or s.sha256
        same.published_by = same.published_by or s.published_by
    return out


def manifest_note(kind: str, name: str) -> str | None:
    """What the manifest says of a file it gives no source for (the demo's tiny weights), or None."""
    load_manifest()
    return _notes.get((kind, name))


def describe(sources: list[Source]) -> str:
    """A short 'from where' for messages: the first source's URL and where that came from."""
    return describe_dict(sources[0].to_dict() if sources else None)


def describe_dict(src: dict | None) -> str:
    if not src:
        return "none known (neither the workflow's properties.models nor h3kit's manifest names it)"
    where = "the workflow's properties.models" if src["origin"] == "workflow" else "h3kit's manifest"
    text = f"{src['url']} ({where})"
    if src.get("repo") and endpoint() != DEFAULT_ENDPOINT:
        text += f", fetched through HF_ENDPOINT={endpoint()}"
    return text + (f"; refused: {src['refused']}" if src.get("refused") else "")


# ------------------------------------------------------------------------------------- a file on disk

HASH_CHUNK = 8 * 2**20


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def disk_problem(path: str, sources: list[Source], verify_hash: bool = False) -> str | None:
    """Why the file at `path` is not one its sources publish (None when it is, or when none publishes figures):
    its size against every published size; with `verify_hash`, its sha256 against every published sha256 (reads
    the whole file: minutes for tens of GB)."""
    sizes = sorted({s.size for s in sources if s.size is not None})
    shas = sorted({s.sha256 for s in sources if s.sha256})
    try:
        size = os.path.getsize(path)
    except OSError as e:
        return f"unreadable: {e.strerror or e}"
    if sizes and size not in sizes:
        return (f"{size} bytes on disk, {' or '.join(map(str, sizes))} published: an incomplete or other file; move "
                "it away and run h3kit models fetch (h3kit never overwrites a file it did not write)")
    if verify_hash and shas:
        try:
            got = sha256_file(path)
        except OSError as e:
            return f"unreadable: {e.strerror or e}"
        if got not in shas:
            return (f"sha256 {got}, {' or '.join(shas)} published: another file of the same size; move it away "
                    "and run h3kit models fetch")
    return None
