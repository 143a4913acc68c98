"""The fork server a launcher starts its workers from on the CPU: `python -B -m comfy.multinpu_zygote FD MODULE...`
imports the MODULEs once (none touches a device), then forks a worker per request on socket FD, which runs its module
as `python -m` would, and reports each worker's pid and exit. docs/multinpu.md, "The launcher"."""

from __future__ import annotations

import importlib
import json
import logging
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback


WORKER_START_ENV = "H3KIT_WORKER_START"
WORKER_STARTS = ("fork", "exec")
# what the fork server imports: nothing that picks or touches a device (comfy.model_management does: each worker
# imports it and the H3 runners itself); ComfyUI's worker also gets the libraries its model code pulls in
PRELOAD = ("torch", "torch.distributed", "comfy.multinpu_group", "comfy.multinpu_links", "comfy.multinpu_wire")
PRELOAD_COMFY = ("comfy.options", "torch._dynamo", "transformers", "comfy_kitchen", "torchvision", "safetensors")


def worker_start(spec) -> str:
    """How a host's workers start: "fork" (from a fork server) or "exec" (a new interpreter each); H3KIT_WORKER_START,
    else fork on the CPU and exec on NPU and CUDA, where fork is unmeasured."""
    from comfy.multinpu_wire import GroupError
    asked = os.environ.get(WORKER_START_ENV, "").strip().lower()
    if asked and asked not in WORKER_STARTS:
        raise GroupError(f"{WORKER_START_ENV}={asked!r} is not one of {', '.join(WORKER_STARTS)}")
    return asked or ("fork" if spec.device_type == "cpu" else "exec")


def preload(spec) -> tuple:
    return PRELOAD + (PRELOAD_COMFY if spec.worker_module == "comfy.multinpu_worker" else ())


def fork_worker(workers, rank: int, env: dict):
    """Worker `rank` of a LocalWorkers forked from its fork server (started with the first worker's environment, and
    again if it ended); None, with a warning, when the fork server cannot: the launcher then starts an interpreter."""
    from comfy.multinpu_wire import GroupError
    try:
        if workers.fork_server is None or not workers.fork_server.alive():
            workers.fork_server = ForkServer(preload(workers.spec), env, workers.cwd)
        return workers.fork_server.fork(workers.spec.worker_module, workers.spec.worker_args, env, workers.cwd)
    except GroupError as e:
        logging.warning(f"MultiNPU: {e}; starting {workers.spec.describe_rank(rank)} as a new interpreter")
        return None


class ForkServer:
    """The launcher's end, started with the workers' shared environment in `cwd`; fork() gives a ForkedWorker."""

    def __init__(self, preload, env: dict, cwd: str):
        ours, theirs = socket.socketpair()
        home = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder holding comfy/
        if os.path.realpath(home) != os.path.realpath(cwd):  # a launcher outside the ComfyUI tree (tests)
            env = dict(env, PYTHONPATH=os.pathsep.join(p for p in (home, env.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-B", "-m", __name__, str(theirs.fileno()), *preload], cwd=cwd,
                                     env=env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), close_fds=True)
        theirs.close()
        self.sock, self.lock, self.buffer, self.exits = ours, threading.Lock(), b"", {}  # exits: pid -> Popen's code
        logging.info(f"MultiNPU: started the workers' fork server as pid {self.proc.pid} ({', '.join(preload)})")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, module: str, args, env: dict, cwd) -> "ForkedWorker":
        from comfy.multinpu_wire import GroupError
        request = {"module": module, "args": [str(a) for a in args], "env": env, "cwd": str(cwd)}
        with self.lock:
            try:
                self.sock.sendall(json.dumps(request).encode() + b"\n")
                deadline = time.monotonic() + 300.0  # the fork server imports its modules before it answers
                while self.alive() and time.monotonic() < deadline:
                    if (reply := self._read(1.0)) is not None:
                        return ForkedWorker(self, reply["pid"], reply["identity"])
            except OSError as e:
                raise GroupError(f"the fork server (pid {self.proc.pid}) is unreachable: {e}") from e
        raise GroupError(f"the fork server (pid {self.proc.pid}) did not start {module}"
                         + ("" if self.alive() else ": it ended"))

    def _read(self, timeout: float):
        """Note the exits that arrive within `timeout`; the pid reply among them, if any."""
        reply = None
        if self.sock.fileno() >= 0 and select.select([self.sock], [], [], timeout)[0]:
            data = self.sock.recv(65536)
            if not data:
                raise OSError("it closed its end")
            self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            if "exit" in (message := json.loads(line)):
                self.exits[message["exit"]] = message["code"]
            reply = reply if "exit" in message else message
        return reply

    def exit_code(self, pid: int):
        """Worker `pid`'s exit code, None while it runs; once the fork server is gone its workers got SIGTERM."""
        with self.lock:
            try:
                self._read(0.0)
            except OSError:
                pass
            if pid not in self.exits and not self.alive() and not os.path.exists(f"/proc/{pid}"):
                self.exits[pid] = -signal.SIGTERM
            return self.exits.get(pid)

    def close(self):
        """End the fork server (its workers that still run get SIGTERM, their death signal) and wait for it."""
        self.sock.close()
        try:
            self.proc.wait(10.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5.0)


class ForkedWorker:
    """A worker forked by a ForkServer, with the part of subprocess.Popen's interface the launcher uses; `identity`
    was read by the fork server before it could reap the worker."""

    def __init__(self, server: ForkServer, pid: int, identity=None):
        self.server, self.pid, self.identity, self.returncode = server, pid, identity, None

    def poll(self):
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:  # its exit unreported: the pid is still its own (the fork server reports at once)
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def _run_worker(request: dict):
    """In a forked child: become `python -B -m MODULE ARGS` in the request's environment and folder; never returns."""
    from comfy.multinpu_wire import PARENT_ENV, die_with_parent
    code = 1
    try:
        os.environ.clear()
        os.environ.update(request["env"], **{PARENT_ENV: str(os.getppid())})
        die_with_parent()  # SIGTERM when the fork server ends, whatever the module does
        for handler in list(logging.root.handlers):  # the module's own logging.basicConfig must take effect
            logging.root.removeHandler(handler)
        os.chdir(request["cwd"])
        sys.argv = ["-m", *request["args"]]  # runpy puts the module's path first, as `python -m` does
        if os.environ.get("OMP_NUM_THREADS") and "torch" in sys.modules:  # OpenMP read it once, in the fork server
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(sock: socket.socket):
    """Fork a worker per request line, reply with its pid and identity (read before it can be reaped: one that ends
    at once is gone before the launcher looks), report each exit; return when the launcher closes its end."""
    import psutil
    own_cmdline = psutil.Process().cmdline()  # a forked worker's, until it execs (it never does)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    buffer = b""
    while True:
        ready = select.select([sock, wake_r], [], [])[0]
        try:
            while os.read(wake_r, 512):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock.sendall(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        if sock in ready:
            if not (data := sock.recv(65536)):
                return
            buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            sys.stdout.flush()
            sys.stderr.flush()
            if (pid := os.fork()) == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w, sock.fileno()):
                    os.close(fd)
                _run_worker(json.loads(line))
            identity = {"pid": pid, "create_time": psutil.Process(pid).create_time(), "cmdline": own_cmdline}
            sock.sendall(json.dumps({"pid": pid, "identity": identity}).encode() + b"\n")


if __name__ == "__main__":
    from comfy.multinpu_wire import die_with_parent
    die_with_parent()  # the launcher's end: this process's, then (their death signal) every worker's
    logging.basicConfig(level=logging.INFO, format="[fork server] %(levelname)s %(message)s", stream=sys.stdout)
    for name in sys.argv[2:]:
        try:
            importlib.import_module(name)
        except Exception as e:  # the workers import it themselves
            logging.warning(f"MultiNPU: the fork server could not import {name}: {e}")
    serve(socket.socket(fileno=int(sys.argv[1])))
    os._exit(0)
