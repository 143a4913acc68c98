"""A stand-in for ComfyUI's main.py, written for h3kit's service tests: it misbehaves on request.

NOT ComfyUI. Tests copy this file to `main.py` in a fake ComfyUI home, so `h3kit start` launches it exactly
as it launches the real server (`python -B main.py --listen H --port P [--cpu] ...`). It serves the
endpoints h3kit reads (/system_stats, /queue, /history, /free, /prompt) from the standard library, and
its behaviour comes from `standin.json` beside it:

    boot_delay       seconds before it listens (default 0.2)
    exit_during_boot exit with this code after boot_delay, after printing a traceback, never listening
    healthy          false: /system_stats answers 503 forever (a server that never becomes healthy)
    unhealthy_after  seconds after listening when /system_stats starts answering 503
    die_after        seconds after listening when the process exits (code 1)
    ignore_sigterm   true: SIGTERM is ignored, so only SIGKILL stops it
    devices          device count /system_stats lists (default: from the visible-device variables)
    queue            [running, pending] counts /queue reports: prompts "r0".., "p0".. with client id
                     "standin-client" (they never run)
    oom_log_after    seconds after listening when it writes ComfyUI's OOM log lines (traceback + marker)
    boots            list of per-boot overrides: entry i applies to the (i+1)-th start in this home

POST /standin/oom {"log": true, "history": true} makes it report an out-of-memory error now: ComfyUI's OOM
log lines, and/or a /history entry whose execution_error is a torch.OutOfMemoryError.

When the home has a `comfy/cli_args.py` (tests copy tests/support/standin_cli_args.py there), the stand-in
first parses its arguments with it, exactly as ComfyUI does at start: a bad argument prints argparse's
usage and `main.py: error: ...` and exits 2.

POST /prompt queues the prompt as pending (it never runs) under its `prompt_id` (or a new one) and appends
the body, with the boot's number, to `standin-prompts.jsonl`; a prompt whose "prompt" has a node of class
"StandinRefuse", or whose id is in the config's `refuse` list, is refused with HTTP 400, as ComfyUI
refuses an invalid prompt.

Each boot appends one JSON line to `standin-boots.jsonl` (pid, argv, the device variables, whether -B was
given, pgid and sid); each POST /free appends its body to `standin-free.jsonl`.
"""

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOME = os.getcwd()
DEVICE_VARS = ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "H3KIT_SIM_DEVICES", "H3KIT_GROUP", "H3KIT_GROUP_KEY")


def log(msg):
    print(msg, flush=True)


def load_config(boot_index):
    path = os.path.join(HOME, "standin.json")
    cfg = {}
    if os.path.exists(path):
        with open(path) as f:
            cfg = json.load(f)
    boots = cfg.pop("boots", [])
    if boot_index < len(boots):
        cfg.update(boots[boot_index])
    return cfg


def parse_args(argv):
    out = {"listen": "127.0.0.1", "port": 8188, "cpu": False}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("--listen", "--port"):
            out[a[2:]] = argv[i + 1]
            i += 2
            continue
        if a == "--cpu":
            out["cpu"] = True
        i += 1
    out["port"] = int(out["port"])
    return out


def device_entries(cfg):
    if "devices" in cfg:
        count, kind = int(cfg["devices"]), "npu"
    elif os.environ.get("ASCEND_RT_VISIBLE_DEVICES"):
        count, kind = len(os.environ["ASCEND_RT_VISIBLE_DEVICES"].split(",")), "npu"
    elif os.environ.get("CUDA_VISIBLE_DEVICES"):
        count, kind = len(os.environ["CUDA_VISIBLE_DEVICES"].split(",")), "cuda"
    else:
        count, kind = 1, "cpu"
    return [{"name": f"{kind}:{i} stand-in", "type": kind, "index": i, "vram_total": 64 * 1024 ** 3,
             "vram_free": 60 * 1024 ** 3, "torch_vram_total": 0, "torch_vram_free": 0} for i in range(count)]


OOM_LINES = [
    "\x1b[1m\x1b[31m[ERROR]\x1b[0m !!! Exception during processing !!! NPU out of memory. Tried to allocate 2.00 GiB",
    "\x1b[1m\x1b[31m[ERROR]\x1b[0m Traceback (most recent call last):",
    '  File "/comfy/execution.py", line 530, in execute',
    "    output_data, output_ui, has_subgraph = await get_output_data(prompt_id, unique_id, obj)",
    "torch.OutOfMemoryError: NPU out of memory. Tried to allocate 2.00 GiB",
    "",
    "\x1b[32m[INFO]\x1b[0m Memory summary: (stand-in)",
    "\x1b[1m\x1b[31m[ERROR]\x1b[0m Got an OOM, unloading all loaded models.",
]


def check_args_like_comfy(argv):
    path = os.path.join(HOME, "comfy", "cli_args.py")
    if os.path.exists(path):
        import importlib.util
        spec = importlib.util.spec_from_file_location("standin_cli_args", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.parser.parse_args(argv)  # exits 2 with argparse's message on a bad argument


def main():
    check_args_like_comfy(sys.argv[1:])
    args = parse_args(sys.argv[1:])
    boots_path = os.path.join(HOME, "standin-boots.jsonl")
    boot_index = 0
    if os.path.exists(boots_path):
        with open(boots_path) as f:
            boot_index = sum(1 for _ in f)
    cfg = load_config(boot_index)
    with open(boots_path, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "argv": sys.argv, "dont_write_bytecode": sys.flags.dont_write_bytecode,
                            "env": {k: os.environ.get(k) for k in DEVICE_VARS},
                            "pgid": os.getpgid(0), "sid": os.getsid(0), "boot": boot_index}) + "\n")
    if cfg.get("ignore_sigterm"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log(f"stand-in server (not ComfyUI), boot {boot_index}, pid {os.getpid()}, args {args}")
    time.sleep(float(cfg.get("boot_delay", 0.2)))
    if cfg.get("exit_during_boot") is not None:
        log("Traceback (most recent call last):")
        log('  File "main.py", line 1, in <module>')
        log("RuntimeError: stand-in boot failure")
        sys.exit(int(cfg["exit_during_boot"]))

    state = {"t0": time.monotonic(), "free": 0}
    history = {}
    posted = []  # queue items of the prompts POSTed to this boot, in order

    def report_oom(in_log, in_history):
        if in_log:
            log("got prompt")
            for line in OOM_LINES:
                log(line)
        if in_history:
            prompt_id = f"standin-oom-{len(history)}"
            history[prompt_id] = {"prompt": [], "outputs": {}, "status": {
                "status_str": "error", "completed": False, "messages": [
                    ["execution_start", {"prompt_id": prompt_id}],
                    ["execution_error", {"prompt_id": prompt_id, "node_id": "3",
                                         "exception_type": "torch.OutOfMemoryError",
                                         "exception_message": "NPU out of memory. Tried to allocate 2.00 GiB"}]]}}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *a):
            pass

        def _json(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            path = self.path.split("?")[0].removeprefix("/api")
            up = time.monotonic() - state["t0"]
            if path == "/system_stats":
                if cfg.get("healthy", True) is False or up >= float(cfg.get("unhealthy_after", 1e9)):
                    return self._json(503, {"error": "stand-in: unhealthy"})
                return self._json(200, {"system": {"os": sys.platform, "argv": sys.argv,
                                                   "comfyui_version": "stand-in"},
                                        "devices": device_entries(cfg)})
            if path == "/queue":
                if cfg.get("queue_broken"):  # a server that no longer answers its queue (wedged)
                    return self._json(500, {"error": "stand-in: queue_broken"})
                running, pending = cfg.get("queue", [0, 0])
                extra = {"client_id": "standin-client", "create_time": 1}
                return self._json(200, {"queue_running": [[i, f"r{i}", {"1": {}}, extra, ["1"]] for i in range(running)],
                                        "queue_pending": [[i, f"p{i}", {"1": {}}, extra, ["1"]] for i in range(pending)]
                                        + posted})
            if path == "/history":
                with open(os.path.join(HOME, "standin-history-reads"), "a") as f:
                    f.write(".")  # one per read: a test counts watch's ticks (each reads /history)
                return self._json(200, history)
            if path == "/prompt":
                return self._json(200, {"exec_info": {"queue_remaining": sum(cfg.get("queue", [0, 0]))}})
            return self._json(404, {"error": "not found"})

        def do_POST(self):
            path = self.path.split("?")[0].removeprefix("/api")
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            if path == "/standin/oom":
                req = json.loads(body or b"{}")
                report_oom(req.get("log", True), req.get("history", False))
                return self._json(200, {"ok": True})
            if path == "/prompt":
                req = json.loads(body or b"{}")
                with open(os.path.join(HOME, "standin-prompts.jsonl"), "a") as f:
                    f.write(json.dumps({"boot": boot_index, **req}) + "\n")
                if req.get("prompt_id") in cfg.get("refuse", []) or any(
                        isinstance(n, dict) and n.get("class_type") == "StandinRefuse"
                        for n in (req.get("prompt") or {}).values()):
                    return self._json(400, {"error": {"type": "prompt_outputs_failed_validation",
                                                      "message": "Prompt outputs failed validation"},
                                            "node_errors": {}})
                prompt_id = req.get("prompt_id") or f"standin-{len(posted)}"
                extra = dict(req.get("extra_data") or {}, client_id=req.get("client_id"), create_time=2)
                posted.append([1000 + len(posted), prompt_id, req.get("prompt"), extra,
                               req.get("partial_execution_targets") or []])
                return self._json(200, {"prompt_id": prompt_id, "number": 1000 + len(posted), "node_errors": {}})
            if path == "/free":
                with open(os.path.join(HOME, "standin-free.jsonl"), "a") as f:
                    f.write(body.decode() + "\n")
                log("stand-in: POST /free " + body.decode())
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            return self._json(404, {"error": "not found"})

    ThreadingHTTPServer.allow_reuse_address = True
    ThreadingHTTPServer.daemon_threads = True
    server = ThreadingHTTPServer((args["listen"], args["port"]), Handler)
    log(f"To see the GUI go to: http://{args['listen']}:{args['port']} (stand-in)")

    def timers():
        t0 = state["t0"]
        oom_at = cfg.get("oom_log_after")
        die_at = cfg.get("die_after")
        while True:
            up = time.monotonic() - t0
            if oom_at is not None and up >= float(oom_at):
                report_oom(True, False)
                oom_at = None
            if die_at is not None and up >= float(die_at):
                log("stand-in: dying on purpose (die_after)")
                os._exit(1)
            time.sleep(0.05)

    threading.Thread(target=timers, daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
