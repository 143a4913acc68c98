"""The runtime area's patches: listed in order, DEP-3 headers, new files generated from patches/src,
and the whole series applied to the pin (the installed tree the other runtime tests use)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from h3kit import manifest
from h3kit.patches import Series, structural_problems

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_PATCHES = {
    "multidevice-npu-device-layer.patch": ["comfy/multidevice.py", "comfy/model_management.py"],
    "npu-int8-linear.patch": ["comfy/npu_quant.py", "comfy/quant_ops.py", "comfy/ops.py"],
    "multinpu-collectives.patch": ["comfy/multinpu.py", "comfy/multinpu_clock.py"],
    "multinpu-weights-read-once.patch": ["comfy/multinpu_weights.py"],
    "h3-dit-sharded-weights.patch": ["comfy/multinpu_shard.py"],
    "h3-dit-sequence-parallel.patch": ["comfy/multinpu_dit.py"],
    "h3-text-encoder-tensor-parallel.patch": ["comfy/multinpu_te.py"],
    "h3-video-vae-decode-parallel.patch": ["comfy/multinpu_vae.py"],
    "multinpu-parallel-config-node.patch": ["comfy_extras/nodes_multinpu.py", "nodes.py"],
}


@pytest.fixture(scope="module")
def series():
    return Series.load(ROOT)


def test_series_order(series):
    mine = [n for n in series.names if n in RUNTIME_PATCHES]
    # collectives and the weight copies before the model code that uses them, the node last; each listed once
    assert mine == list(RUNTIME_PATCHES)


@pytest.mark.parametrize("name", list(RUNTIME_PATCHES))
def test_patch_format(series, name):
    patch = next(p for p in series.patches if p.name == name)
    assert patch.header["Origin"] == "vendor, h3kit" and patch.header["Forwarded"] == "not-needed"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", patch.header["Last-Update"])
    assert "\n" in patch.header["Description"], "a summary line, then the long description"
    assert patch.raw.decode().split("\ndiff --git ", 1)[0].endswith("\n---")
    assert patch.files == RUNTIME_PATCHES[name]


def test_new_files_match_their_sources(series):
    assert structural_problems(series, manifest.load(ROOT)) == []


@pytest.mark.upstream
def test_series_applied_to_the_pin(installed_tree):
    tree = installed_tree
    for rel in ("comfy/multidevice.py", "comfy/multinpu.py", "comfy/multinpu_weights.py", "comfy/multinpu_shard.py",
                "comfy/multinpu_dit.py",
                "comfy/multinpu_te.py", "comfy/multinpu_vae.py", "comfy_extras/nodes_multinpu.py", "comfy/npu_quant.py"):
        assert (tree / rel).read_text() == (ROOT / "patches" / "src" / rel).read_text()
    mm = (tree / "comfy" / "model_management.py").read_text()
    assert "torch.npu.set_device(device)" in mm and "torch.npu.synchronize()" in mm
    assert '"nodes_multinpu.py",' in (tree / "nodes.py").read_text()
    assert "comfy.npu_quant.register(ck.registry)" in (tree / "comfy" / "quant_ops.py").read_text()
    assert "p = comfy.npu_quant.landed(p)" in (tree / "comfy" / "ops.py").read_text()


# The parallel components ask one factory for their runtime (comfy.multinpu_process.runtime_for) and never name a
# transport; comfy.multinpu_process.transport() is the one place that chooses one (issue 28 item 5).
COMPONENT_FILES = ("comfy/multinpu_dit.py", "comfy/multinpu_te.py", "comfy/multinpu_vae.py", "comfy/multinpu_shard.py",
                   "comfy_extras/nodes_multinpu.py")
TRANSPORT_NAMES = re.compile(r"\b(ThreadRuntime|GroupRuntime|ProcessComm|ThreadComm|ThreadSpec|ThreadTransport|THREADS"
                             r"|multinpu_threads|get_runtime)\b")
# every spelling a branch on the transport has had: on the backend's name, on a runtime given or not, on the type of a
# communicator or runtime, on what attributes a runtime happens to have
TRANSPORT_BRANCHES = re.compile(r'backend == "threads"|\.transport ==|\bruntime is (not )?None|\bruntime or '
                                r'|isinstance\([^)]*(Comm|Runtime)\b|\b(get|has)attr\(\s*[\w.]*(runtime|comm)\s*,')


# Monitoring (GET /metrics) reports which transport runs: the process group's ranks and beats, else the server's own
# devices. It observes and is no code path a prompt runs, so it alone may ask whether a process group is there.
OBSERVERS = ("comfy/multinpu_metrics.py",)


def _lines(path: Path):
    return enumerate(path.read_text().splitlines(), 1)


def test_no_transport_fork_left_in_the_patch_sources():
    # one code path per component (issues 19 item 7, 28 item 5): no branch on the transport anywhere in patches/src,
    # under any of the spellings it has had
    src = ROOT / "patches" / "src"
    forks = [f"{p.relative_to(src)}:{i}: {line.strip()}" for p in sorted(src.rglob("*.py")) for i, line in _lines(p)
             if TRANSPORT_BRANCHES.search(line) and str(p.relative_to(src)) not in OBSERVERS]
    assert forks == [], forks


def test_components_name_no_transport():
    src = ROOT / "patches" / "src"
    named = [f"{rel}:{i}: {line.strip()}" for rel in COMPONENT_FILES for i, line in _lines(src / rel)
             if TRANSPORT_NAMES.search(line)]
    assert named == [], named
    # and each asks the one factory
    for rel in ("comfy/multinpu_dit.py", "comfy/multinpu_te.py", "comfy/multinpu_vae.py"):
        assert "comfy.multinpu_process.runtime_for(" in (src / rel).read_text(), rel


@pytest.mark.parametrize("line", [
    'runtime = runtime or comfy.multinpu_threads.ThreadRuntime.on(devices, vae.device, "VAE", timeout)',
    '    return "devices" if runtime.spec.backend == "threads" else "processes"',
    "    if isinstance(comm, ProcessComm):",
    "        if runtime is not None:",
    '        return getattr(self.runtime, "timeout", self.runtime.spec.timeout)',
    '        if hasattr(self.runtime, "timeout"):',
    '    ranks = getattr(runtime, "devices", None)',
])
def test_the_fork_patterns_catch_every_spelling_seen(line):
    # the spellings issue 28 found in patches/src (af60090); the test above must catch each of them
    assert TRANSPORT_BRANCHES.search(line)


def test_the_fork_patterns_leave_ordinary_code_alone():
    for line in ('        return getattr(self._local, "comm", None)', "    return _RUNTIME or comfy.multinpu_threads.THREADS",
                 "    runtime = comfy.multinpu_process.runtime_for(devices, vae.device, \"VAE\", timeout)"):
        assert not TRANSPORT_BRANCHES.search(line), line


@pytest.mark.parametrize("name", Series.load(ROOT).names)
def test_each_patch_header_names_every_file_it_adds(series, name):
    # a header says what the patch does now: every new file of the patch is described there (the process group's
    # header once described a store relay and a comfy/multinpu_group.py holding what four later modules hold)
    patch = next(p for p in series.patches if p.name == name)
    described = patch.header["Description"]
    missing = [s.path for s in patch.sections if s.new_file and s.path not in described]
    assert missing == [], f"{name}'s Description does not mention {missing}"


def test_no_header_describes_the_removed_store_relay(series):
    stale = [p.name for p in series.patches if "relays them to the other ranks" in p.header["Description"]
             or "worker threads" in p.header["Description"] or "in waves" in p.header["Description"]]
    assert stale == [], stale
