"""A stand-in for the Hugging Face Hub's file endpoints, on 127.0.0.1, for `h3kit models fetch` (test support).

It answers what huggingface_hub asks when it downloads one file (HF_ENDPOINT pointed here,
HF_HUB_DISABLE_XET=1): HEAD and GET on /<owner>/<repo>/resolve/<revision>/<path>, with X-Repo-Commit, an
ETag (the sha256 of the content, as the Hub gives LFS files), Content-Length and Accept-Ranges, and GET with
`Range: bytes=N-` answered 206 from byte N. /files/<name> serves plain files the same way, without
X-Repo-Commit (a non-Hub https server). Every request is recorded (method, path, Range).

Faults a test can set per file: `claim_size` (HEAD announces another size), `serve` (GET sends other bytes
than the ETag names), `stall_after` (GET sends that many bytes, then waits until `release` is set, bounded),
`fail_gets` (GET answers 500), `token` (a gated repository: 401 without that bearer token).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
STALL_LIMIT_S = 60


def manifest_with_figures(dest: Path, figures: dict | None = None) -> Path:
    """A copy of h3kit's manifest (for $H3KIT_MODELS_MANIFEST) whose published sizes and hashes are `figures`
    ({repository path: (size, sha256 or None)}) and none else: the stand-in serves small files of its own, which
    the real figures (tens of GB) would refuse."""
    src = Path(__file__).resolve().parents[2] / "workflows" / "models" / "manifest.json"
    doc = json.loads(src.read_text(encoding="utf-8"))
    for entry in doc["files"]:
        for s in entry["sources"]:
            s.pop("size", None)
            s.pop("sha256", None)
            size, sha = (figures or {}).get(s["path"], (None, None))
            if size is not None:
                s["size"] = size
            if sha is not None:
                s["sha256"] = sha
    dest.write_text(json.dumps(doc), encoding="utf-8")
    return dest


class HubFile:
    def __init__(self, content: bytes):
        self.content = content
        self.claim_size: int | None = None
        self.serve: bytes | None = None
        self.stall_after: int | None = None
        self.fail_gets = False
        self.token: str | None = None  # a gated repository: 401 without `Authorization: Bearer <token>`

    @property
    def etag(self) -> str:
        return hashlib.sha256(self.content).hexdigest()


class HubStandin:
    def __init__(self):
        self.files: dict[str, HubFile] = {}   # "/<repo>/resolve/<rev>/<path>" or "/files/<name>" -> file
        self.requests: list[tuple[str, str, str | None]] = []
        self.authorization: list[tuple[str, str | None]] = []  # (path, Authorization header) per request
        self.release = threading.Event()
        self.stalled = threading.Event()
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, repo: str, path: str, content: bytes, revision: str = "main") -> HubFile:
        f = self.files[f"/{repo}/resolve/{revision}/{path}"] = HubFile(content)
        return f

    def add_plain(self, name: str, content: bytes) -> HubFile:
        f = self.files[f"/files/{name}"] = HubFile(content)
        return f

    def gets(self) -> list:
        return [r for r in self.requests if r[0] == "GET"]

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _handler(self):
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _file(self):
                path = self.path.split("?", 1)[0]
                with hub._lock:
                    hub.requests.append((self.command, path, self.headers.get("Range")))
                    hub.authorization.append((path, self.headers.get("Authorization")))
                f = hub.files.get(path)
                if f is not None and f.token and self.headers.get("Authorization") != f"Bearer {f.token}":
                    body = b"Access to this repository is restricted"
                    self.send_response(401)
                    self.send_header("X-Error-Code", "GatedRepo")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(body)
                    return path, None
                return path, f

            def _headers(self, path, f, length, status=200, extra=()):
                self.send_response(status)
                if not path.startswith("/files/"):
                    self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{f.etag}"')
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(length))
                for k, v in extra:
                    self.send_header(k, v)
                self.end_headers()

            def _missing(self):
                body = b"Entry not found"
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_HEAD(self):
                path, f = self._file()
                if f is None:
                    return None if path in hub.files else self._missing()
                self._headers(path, f, f.claim_size if f.claim_size is not None else len(f.content))

            def do_GET(self):
                path, f = self._file()
                if f is None:
                    return None if path in hub.files else self._missing()
                if f.fail_gets:
                    self.send_response(500)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = f.serve if f.serve is not None else f.content
                start = 0
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes=") and rng.endswith("-"):
                    start = int(rng[len("bytes="):-1])
                body = data[start:]
                if start:
                    self._headers(path, f, len(body), 206,
                                  [("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")])
                else:
                    self._headers(path, f, len(body))
                if f.stall_after is not None and not hub.release.is_set():
                    self.wfile.write(body[:f.stall_after])
                    self.wfile.flush()
                    hub.stalled.set()
                    hub.release.wait(STALL_LIMIT_S)
                    self.close_connection = True
                    return
                self.wfile.write(body)

        return Handler
