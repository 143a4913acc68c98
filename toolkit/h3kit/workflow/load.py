"""Read a workflow file and say which of the three shapes it has.

UI format: the frontend's saved workflow, {"nodes": [...], "links": [...], "definitions": {"subgraphs": [...]}}.
API format: a prompt, {node_id: {"class_type": ..., "inputs": {...}}}.
Request body: what the frontend POSTs to /prompt, {"prompt": {API format}, "extra_data": ...}.

Anything else, and anything that is not readable JSON, raises WorkflowFileError (exit 2): a file the checker
cannot read is not a file it has checked.
"""

from __future__ import annotations

import json
import os
import stat

from h3kit.errors import UsageError

# A 91 KB template is the largest upstream H3 workflow; 64 MiB leaves room for workflows carrying
# embedded images without letting a stray video file be read into memory.
MAX_FILE_BYTES = 64 * 1024 * 1024

UI, API = "ui", "api"


class WorkflowFileError(UsageError):
    code = "bad_workflow"


class Workflow:
    """A parsed file: `kind` is "ui" or "api"; `data` the UI document or the API prompt dict."""

    __slots__ = ("path", "kind", "data", "wrapped")

    def __init__(self, path: str, kind: str, data: dict, wrapped: bool = False):
        self.path = path
        self.kind = kind
        self.data = data
        self.wrapped = wrapped


def read_workflow(path: str) -> Workflow:
    return parse_workflow(read_capped(path, MAX_FILE_BYTES, "workflow"), path)


def read_capped(path: str, limit: int, what: str) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; anything else raises WorkflowFileError.

    Opened without blocking and checked on the open descriptor: a FIFO with no writer would block a plain
    open forever, and /dev/zero or a growing file would be read until memory runs out."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except IsADirectoryError:
        raise WorkflowFileError(f"{path} is a directory", hint=f"pass {what} JSON files") from None
    except OSError as e:
        raise WorkflowFileError(f"cannot read {path}: {e.strerror or e}", hint="check the path") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise WorkflowFileError(f"{path} is a directory", hint=f"pass {what} JSON files")
        if not stat.S_ISREG(st.st_mode):
            raise WorkflowFileError(f"{path} is not a regular file (a device, a pipe or a socket)",
                                    hint=f"save the {what} to a file and pass that")
        if st.st_size > limit:
            raise WorkflowFileError(f"{path}: {st.st_size} bytes is too large for a {what}",
                                    hint=f"{what}s are JSON documents under {limit // 2**20} MiB")
        os.set_blocking(fd, True)
        chunks, total = [], 0
        while True:  # at most limit + 1 bytes, even if the file grows while it is read
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise WorkflowFileError(f"{path} grew past {limit // 2**20} MiB while it was read",
                                        hint=f"{what}s are JSON documents under {limit // 2**20} MiB")
        return b"".join(chunks)
    except OSError as e:
        raise WorkflowFileError(f"cannot read {path}: {e.strerror or e}", hint="check the path") from None
    finally:
        os.close(fd)


def parse_workflow(raw: bytes | str, path: str = "<input>") -> Workflow:
    try:
        text = raw.decode("utf-8-sig") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as e:
        raise WorkflowFileError(f"{path} is not UTF-8 text (byte {e.start})",
                                hint="save the workflow from ComfyUI (Workflow > Export)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise WorkflowFileError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                                hint="the file may be truncated; export it again from ComfyUI") from None
    except RecursionError:
        raise WorkflowFileError(f"{path} nests JSON too deeply to be a workflow") from None
    except ValueError as e:  # e.g. an integer literal past Python's 4300-digit limit
        raise WorkflowFileError(f"{path} has a value JSON cannot hold: {e}") from None
    return classify(data, path)


def classify(data, path: str = "<input>") -> Workflow:
    if isinstance(data, dict):
        if isinstance(data.get("nodes"), list):
            return Workflow(path, UI, data)
        if "prompt" in data and "class_type" not in data:
            prompt = data["prompt"]
            if isinstance(prompt, dict) and _looks_like_api(prompt):
                return Workflow(path, API, prompt, wrapped=True)
            raise WorkflowFileError(f"{path}: \"prompt\" is not an API-format prompt",
                                    hint='a /prompt body is {"prompt": {"<id>": {"class_type": ..., "inputs": {...}}}}')
        if _looks_like_api(data):
            return Workflow(path, API, data)
    raise WorkflowFileError(
        f"{path} is not a ComfyUI workflow",
        hint="expected a UI workflow (with \"nodes\"), an API prompt ({id: {class_type, inputs}}) "
             "or a /prompt request body ({\"prompt\": ...})")


def _looks_like_api(data: dict) -> bool:
    return bool(data) and any(isinstance(v, dict) and "class_type" in v for v in data.values())
