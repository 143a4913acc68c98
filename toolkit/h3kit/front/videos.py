"""The OpenAI-style job API for apps: /v1/videos, mapped onto the shipped H3 workflows.

POST /v1/videos takes JSON or a multipart form: `prompt` (required), `size` ("WIDTHxHEIGHT"), `seconds`, an
optional reference image (`input_reference`: a file in a form, or a data: URL in JSON), and h3kit's own
`npu_count` (an integer, or "auto", the default: any server). Without a reference the job runs the text-to-video
workflow (workflows/t2va_8steps_lora.json), with one the reference-to-video one (ref2va_8steps_lora.json);
`h3kit front --video-workflow t2v=FILE` (or ref2v=FILE) replaces either, in UI or API format. The UI form is
flattened to the API form with the toolkit's own workflow graph (h3kit.workflow.graph, as the frontend does).
The H3 node's prompt, width, height and length (seconds x the CreateVideo fps, aligned to H3's 17k+5 frames)
take the request's values; a LoadImage feeding the reference takes the uploaded image.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from pathlib import Path

from h3kit.front import FrontUsageError

H3_NODES = ("MiniMaxH3ImageToVideo", "MiniMaxH3ReferenceToVideo")
DEFAULT_WORKFLOWS = {"t2v": "workflows/t2va_8steps_lora.json", "ref2v": "workflows/ref2va_8steps_lora.json"}
VIDEO_EXT = (".mp4", ".webm", ".mov", ".mkv", ".gif")
MAX_IMAGE = 32 << 20
STATUS = {"queued": "queued", "running": "in_progress", "done": "completed", "failed": "failed",
          "cancelled": "cancelled"}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": self.param, "code": None}}


def api_prompt(path: str | Path) -> dict:
    """The workflow file in API form (a UI file flattened as the frontend does)."""
    from h3kit.workflow import catalog, graph, load

    wf = load.read_workflow(str(path))
    if wf.kind == load.API:
        return {k: v for k, v in wf.data.items() if isinstance(v, dict)}
    g = graph.build_graph(wf, catalog.load_catalog())
    errors = [f for f in g.findings if str(getattr(f, "code", "")).startswith("H34")]
    if errors:
        raise FrontUsageError(f"{path}: the workflow does not flatten: {errors[0].message}",
                              hint="open it in ComfyUI and save it again, or export it in API format")
    out = {}
    for node in g.nodes.values():
        inputs = {name: [v.node, v.slot] if isinstance(v, graph.Link) else v for name, v in node.inputs.items()}
        out[node.id] = {"class_type": node.class_type, "inputs": inputs}
    return out


def load_workflows(overrides: dict[str, str]) -> dict[str, dict]:
    from h3kit.paths import repo_root

    out = {}
    for kind, rel in DEFAULT_WORKFLOWS.items():
        path = Path(overrides.get(kind) or (repo_root() / rel))
        prompt = api_prompt(path)
        if not any(n.get("class_type") in H3_NODES for n in prompt.values()):
            raise FrontUsageError(f"{path}: the {kind} workflow has no H3 node ({', '.join(H3_NODES)})",
                                  hint="give a workflow built on the shipped one")
        out[kind] = prompt
    return out


def parse_size(size) -> tuple[int, int] | None:
    if size in (None, ""):
        return None
    m = re.fullmatch(r"\s*(\d{2,5})\s*[xX]\s*(\d{2,5})\s*", str(size))
    if not m:
        raise BadRequest("size must be WIDTHxHEIGHT, e.g. 1344x768", "size")
    w, h = int(m[1]), int(m[2])
    if not (32 <= w <= 4096 and 32 <= h <= 4096) or w % 32 or h % 32:
        raise BadRequest("size: width and height must be multiples of 32 between 32 and 4096", "size")
    return w, h


def parse_seconds(seconds) -> float | None:
    if seconds in (None, ""):
        return None
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        raise BadRequest("seconds must be a number", "seconds") from None
    if not 0 < s <= 60:
        raise BadRequest("seconds must be above 0 and at most 60", "seconds")
    return s


def parse_npu_count(value) -> int | None:
    if value in (None, "", "auto"):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise BadRequest('npu_count must be 1, 2, 4, 8 or "auto"', "npu_count") from None
    if n not in (1, 2, 4, 8):
        raise BadRequest('npu_count must be 1, 2, 4, 8 or "auto"', "npu_count")
    return n


def decode_data_url(value) -> tuple[bytes, str]:
    if isinstance(value, dict):
        value = value.get("image_url") or value.get("url")
    if not isinstance(value, str) or not value.startswith("data:") or "," not in value:
        raise BadRequest("input_reference must be an uploaded file or a data: URL", "input_reference")
    head, data = value.split(",", 1)
    ext = {"image/png": "png", "image/jpeg": "jpg", "image/webp": "webp"}.get(head[5:].split(";")[0], "png")
    try:
        return base64.b64decode(data, validate=True), ext
    except (binascii.Error, ValueError):
        raise BadRequest("input_reference: the data URL is not valid base64", "input_reference") from None


def build_job(workflows: dict, req: dict, image: bytes | None, image_ext: str, inputs_dir: Path) -> tuple[dict, dict, int | None]:
    """(prompt, parameters, npu_count) for a request; the image is stored under inputs_dir for the dispatcher."""
    text = req.get("prompt")
    if not isinstance(text, str) or not text.strip():
        raise BadRequest("prompt is required", "prompt")
    size, seconds = parse_size(req.get("size")), parse_seconds(req.get("seconds"))
    npu_count = parse_npu_count(req.get("npu_count"))
    kind = "ref2v" if image else "t2v"
    prompt = json.loads(json.dumps(workflows[kind]))
    h3 = next(n for n in prompt.values() if n.get("class_type") in H3_NODES)
    h3["inputs"]["prompt"] = text
    if size:
        h3["inputs"]["width"], h3["inputs"]["height"] = size
    fps = next((n["inputs"].get("fps") for n in prompt.values() if n.get("class_type") == "CreateVideo"), 24)
    if seconds:
        from h3kit.workflow.checks import align_frame_count

        h3["inputs"]["length"] = align_frame_count(max(5, round(seconds * float(fps or 24))))
    ref = None
    if image:
        if len(image) > MAX_IMAGE:
            raise BadRequest("input_reference is larger than 32 MB", "input_reference")
        ref = f"h3front/{uuid.uuid4().hex}.{image_ext}"
        (inputs_dir / "h3front").mkdir(parents=True, exist_ok=True)
        (inputs_dir / ref).write_bytes(image)
        for node in prompt.values():
            if node.get("class_type") == "LoadImage":
                node["inputs"]["image"] = ref
    for node in prompt.values():
        if node.get("class_type") == "MultiNPUParallelConfig":
            node["inputs"]["npu_count"] = npu_count if npu_count else "auto"
    inputs = h3["inputs"]
    params = {"kind": kind, "size": f"{inputs.get('width')}x{inputs.get('height')}",
              "seconds": str(seconds if seconds else round(int(inputs.get("length") or 0) / float(fps or 24), 2)),
              "prompt": text, "reference": ref, "model": str(req.get("model") or "minimax-h3")}
    return prompt, params, npu_count


def video_object(job, position: int | None = None) -> dict:
    p = (job.extra or {}).get("video") or {}
    out = {"id": job.id, "object": "video", "created_at": int(job.created_at), "status": STATUS[job.state],
           "model": p.get("model", "minimax-h3"), "progress": 100 if job.state == "done" else 0,
           "seconds": p.get("seconds"), "size": p.get("size"), "prompt": p.get("prompt"),
           "completed_at": int(job.finished_at) if job.finished_at else None, "error": None,
           "attempts": job.attempts}
    if job.state == "running" and job.cancel:
        out["status"] = "cancelling"
    if job.error:
        out["error"] = {"code": job.state, "message": job.error}
    if position is not None:
        out["queue_position"] = position
    return out


def content_file(job, outputs_dir: Path) -> Path | None:
    """The published video of a done job, in the front's data folder."""
    from h3kit.front.dispatch import OUTPUT_PREFIX, output_items

    for item in output_items(job.outputs or {}):
        sub = item.get("subfolder") or ""
        if item.get("type") == "output" and item["filename"].lower().endswith(VIDEO_EXT) and \
                sub.startswith(f"{OUTPUT_PREFIX}/"):
            rel = sub[len(OUTPUT_PREFIX) + 1:]
            path = outputs_dir / rel / item["filename"]
            if path.is_file():
                return path
    return None
