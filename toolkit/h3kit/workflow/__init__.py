"""Static checks of ComfyUI workflows for MiniMax H3 on 1, 2, 4 or 8 NPUs (`h3kit check-workflow`).

load.py reads the three input shapes, graph.py flattens them into the executed graph (subgraphs, muted and
bypassed nodes, primitives), resolve.py finds input values statically, checks.py holds the checks,
models.py the --comfy-home file and node-type checks, service.py talks to the running service, report.py
formats findings. This package imports only the standard library and h3kit modules at load time: the
command must start fast and without torch, numpy or websocket-client.
"""

from __future__ import annotations

import os


class Result:
    def __init__(self, findings, summary, exit_code):
        self.findings = findings
        self.summary = summary
        self.exit_code = exit_code


def check_paths(paths: list[str], *, devices: str | None = None, comfy_home: str | None = None,
                runtime_root: str | None = None, environ=None, device_memory: float | None = None,
                port: int | None = None) -> Result:
    """Check each file; exit code 2 if any could not be read, else 1 if any error was found, else 0.

    Devices: `devices` (a device list, as `h3kit start --devices`), else ASCEND_RT_VISIBLE_DEVICES (or
    CUDA_VISIBLE_DEVICES) in `environ`, else the running service of `comfy_home` (the one on `port` when several
    run). Memory of one card (GB):
    `device_memory`, else the smallest card the running service's /system_stats lists. Bad device lists and
    a --comfy-home that is not ComfyUI raise UsageError.
    """
    # imported here, not at package import, so `python -m h3kit.workflow.catalog` runs cleanly
    from h3kit import devices as devices_mod
    from h3kit.workflow import checks, report
    from h3kit.workflow.catalog import load_catalog

    environ = os.environ if environ is None else environ
    catalog = load_catalog()
    device_list, source, why = None, None, None
    if devices is not None:
        device_list, source = devices_mod.parse_device_list(devices), f"--devices {devices}"
    else:
        found = devices_mod.visible_devices_from_env(environ)
        if found is not None:
            device_list, source = found[1], f"{found[0]}={environ.get(found[0])}"
    memory, memory_source = (device_memory, f"--device-memory {device_memory:g}") if device_memory else (None, None)
    install, service, service_args = None, None, []
    if comfy_home:
        from h3kit.workflow import models, service as service_mod

        service, why = service_mod.connect(comfy_home, runtime_root, port)
        object_info = service.object_info() if service else None
        if object_info:
            catalog.merge_object_info(object_info)
        service_args = service.args if service else []
        install = models.open_install(comfy_home, object_info=object_info, service_args=service_args)
        if device_list is None and service is not None and service.devices is not None:
            device_list, source = service.devices, f"the running service at {service.base_url}"
        if memory is None and service is not None and service.device_memory is not None:
            memory, memory_source = service.device_memory, f"/system_stats of {service.base_url}"
    ctx = checks.Context(catalog, device_list, source, install, service_args, memory, memory_source)

    findings: list[report.Finding] = []
    unreadable = False
    for path in paths:
        file_findings, ok = _check_one(path, ctx)
        unreadable |= not ok
        for f in file_findings:
            f.file = path
        findings += file_findings
    extra = {"devices": device_list, "device_count": len(device_list) if device_list is not None else None,
             "device_source": source or (why and f"none ({why})") or "none",
             "device_memory_gb": memory, "memory_source": memory_source or "none"}
    summary = report.summarize(findings, list(paths), extra)
    summary["ok"] = summary["ok"] and not unreadable
    exit_code = 2 if unreadable else (1 if summary["errors"] else 0)
    return Result(findings, summary, exit_code)


def _check_one(path: str, ctx) -> tuple[list, bool]:
    from h3kit.workflow import checks, graph as graph_mod, load, report

    try:
        workflow = load.read_workflow(path)
    except load.WorkflowFileError as e:
        message = e.message + (f"; {e.hint}" if e.hint else "")
        return [report.Finding("H3001", message)], False
    try:
        graph = graph_mod.build_graph(workflow, ctx.catalog)
        graph.file = path
        if workflow.kind == load.UI:
            from h3kit.weights import sources

            graph.model_entries = sources.workflow_entries(workflow.data)
        return checks.run_checks(graph, ctx), True
    except graph_mod.GraphTooLarge as e:
        return [report.Finding("H3002", f"{e}: split the workflow, or flatten nested subgraphs")], False
    except RecursionError:
        return [report.Finding("H3002", "the workflow nests links or subgraphs too deeply to check: "
                               "flatten nested subgraphs or remove long reroute chains")], False
