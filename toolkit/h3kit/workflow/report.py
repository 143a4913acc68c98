"""Findings, their stable codes, and their text form grouped by severity (--json prints them through cliutil).

Codes never change meaning once released; docs/check-workflow.md lists each with its fix, and a test keeps
the two in step. Severity: "error" fails the check (exit 1), "warning" and "note" do not.
"""

from __future__ import annotations


ERROR, WARNING, NOTE = "error", "warning", "note"
SEVERITY_ORDER = (ERROR, WARNING, NOTE)

# code: (severity, short title). Ranges: H30xx input files, H31xx devices and MultiNPUParallelConfig,
# H32xx H3 geometry, H33xx H3 model and sampler traps, H34xx graph structure, H35xx the ComfyUI install.
CODES = {
    "H3001": (ERROR, "file cannot be read or is not a workflow"),
    "H3002": (ERROR, "workflow too large or nested too deeply to check"),
    "H3101": (ERROR, "npu_count is not 1, 2, 4 or 8"),
    "H3102": (ERROR, "npu_count differs from the exposed devices"),
    "H3103": (ERROR, "more than one active MultiNPUParallelConfig"),
    "H3104": (ERROR, "MultiNPUParallelConfig's MODEL reaches no sampler"),
    "H3105": (NOTE, "exposed devices unknown: npu_count not compared"),
    "H3106": (NOTE, "npu_count cannot be resolved statically"),
    "H3107": (NOTE, "no MultiNPUParallelConfig: H3 runs on one device"),
    "H3108": (ERROR, "npu_count 8 without 8 exposed devices"),
    "H3109": (WARNING, "the workflow's tier does not fit the service's cards"),
    "H3110": (ERROR, "weights is not auto, replicated or sharded"),
    "H3111": (ERROR, "a diffusion-model wrapper node (EasyCache) after MultiNPUParallelConfig"),
    "H3112": (NOTE, "npu_count auto: the count it takes on the server named"),
    "H3201": (ERROR, "width or height not a multiple of 32"),
    "H3202": (WARNING, "canvas area above 768x1344"),
    "H3203": (WARNING, "length off the 17k+5 frame grid"),
    "H3204": (ERROR, "width, height or length out of range"),
    "H3205": (ERROR, "MiniMaxH3AddGuide with nothing to anchor"),
    "H3206": (ERROR, "MiniMaxH3AddGuide image or audio without its VAE"),
    "H3207": (ERROR, "MiniMaxH3AddGuide frame_idx outside the video"),
    "H3301": (WARNING, "Turbo LoRA on a pruned base model"),
    "H3302": (WARNING, "ancestral or SDE sampler with H3"),
    "H3303": (WARNING, "audio VAE is not fp32"),
    "H3304": (WARNING, "1 device, BF16 weights, 768p and 15 s"),
    "H3305": (WARNING, "SageAttention with H3"),
    "H3401": (ERROR, "link to a missing node, slot or link"),
    "H3402": (ERROR, "required input not connected"),
    "H3403": (ERROR, "cycle in the graph"),
    "H3404": (ERROR, "subgraph contains itself"),
    "H3405": (ERROR, "malformed node entry"),
    "H3406": (NOTE, "widget values do not match the node definition"),
    "H3501": (ERROR, "model file not found"),
    "H3502": (WARNING, "node type unknown to the installed ComfyUI"),
    "H3503": (WARNING, "part of the install could not be read"),
}


class Finding:
    __slots__ = ("code", "severity", "node", "path", "message", "file")

    def __init__(self, code: str, message: str, *, node: str | None = None, path: str | None = None,
                 file: str | None = None, severity: str | None = None):
        self.code = code
        self.severity = severity or CODES[code][0]
        self.node = node
        self.path = path
        self.message = message
        self.file = file

    def to_dict(self) -> dict:
        return {"code": self.code, "severity": self.severity, "node": self.node, "path": self.path,
                "message": self.message, "file": self.file}

    def __repr__(self):
        return f"Finding({self.code} {self.severity} node={self.node} {self.message!r})"


def summarize(findings: list[Finding], files: list[str], context: dict | None = None) -> dict:
    counts = {s: sum(1 for f in findings if f.severity == s) for s in SEVERITY_ORDER}
    summary = {"files": len(files), "errors": counts[ERROR], "warnings": counts[WARNING],
               "notes": counts[NOTE], "ok": counts[ERROR] == 0}
    if context:
        summary.update(context)
    return summary


def render_text(findings: list[Finding], files: list[str], summary: dict) -> str:
    lines = []
    for severity in SEVERITY_ORDER:
        group = [f for f in findings if f.severity == severity]
        if not group:
            continue
        title = {ERROR: "Errors", WARNING: "Warnings", NOTE: "Notes"}[severity]
        lines.append(f"{title} ({len(group)}):")
        for f in group:
            where = f.file or ""
            if f.node is not None:
                where += f" node {f.node}"
                if f.path and f.path != f.node:
                    where += f" ({f.path})"
            lines.append(f"  {f.code} {where.strip()}")
            lines.append(f"        {f.message}")
    devices = summary.get("devices")
    if devices is not None:
        lines.append(f"Devices: {summary.get('device_count')} from {summary.get('device_source')}")
    verdict = "FAILED" if summary["errors"] else "OK"
    lines.append(f"{verdict}: {summary['files']} file(s), {summary['errors']} error(s), "
                 f"{summary['warnings']} warning(s), {summary['notes']} note(s)")
    return "\n".join(lines)
