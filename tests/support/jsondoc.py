"""Read h3kit's --json document (h3kit.cliutil: one shape for every command) and check its shape.

    data(r.stdout, r.returncode)   the "data" of a command that did its work
    error(r.stdout, r.returncode)  the "error" of one that could not
    document(text, rc)             the whole document

Each checks the keys, the schema tag, that exactly one of data / error is there, that an error carries code,
message and fix, and, given the exit code, that "ok" is true exactly when it is 0.
"""

from __future__ import annotations

import json

SCHEMA = "h3kit/1"


def document(text: str, rc: int | None = None) -> dict:
    doc = json.loads(text)
    assert isinstance(doc, dict), doc
    assert doc.get("schema") == SCHEMA, doc
    assert set(doc) in ({"schema", "command", "ok", "data"}, {"schema", "command", "ok", "error"}), sorted(doc)
    assert isinstance(doc["ok"], bool) and (doc["command"] is None or isinstance(doc["command"], str)), doc
    if "error" in doc:
        err = doc["error"]
        assert doc["ok"] is False, doc
        assert {"code", "message", "fix"} <= set(err) <= {"code", "message", "fix", "details"}, err
        assert isinstance(err["code"], str) and err["code"] and isinstance(err["message"], str) and err["message"]
        assert err["fix"] is None or isinstance(err["fix"], str), err
    if rc is not None:
        assert doc["ok"] is (rc == 0), (rc, doc)
    return doc


def data(text: str, rc: int | None = None):
    doc = document(text, rc)
    assert "data" in doc, doc
    return doc["data"]


def error(text: str, rc: int | None = None) -> dict:
    doc = document(text, rc)
    assert "error" in doc, doc
    return doc["error"]
