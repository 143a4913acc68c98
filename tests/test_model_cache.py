"""The global model cache: the module itself (imported from patches/src), its wiring into the real
upstream loaders, and the A B A B A measurement on the pin against the patched tree."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.support import comfy_server

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.torch  # the cache module imports torch


@pytest.fixture
def cache(monkeypatch):
    monkeypatch.setenv("COMFY_MODEL_CACHE_ENTRIES", "3")
    monkeypatch.setenv("COMFY_MODEL_CACHE_GB", str(10 / 1024 ** 3))  # a budget of 10 bytes
    spec = importlib.util.spec_from_file_location("h3kit_src_model_cache", ROOT / "patches/src/comfy/model_cache.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Model:
    def __init__(self, size):
        self.size = size

    def model_size(self):
        return self.size


def files(tmp_path, *names):
    out = []
    for n in names:
        p = tmp_path / n
        p.write_bytes(b"weights " + n.encode())
        out.append(str(p))
    return out


def test_same_files_and_options_return_the_same_object(cache, tmp_path):
    a, = files(tmp_path, "a")
    calls = []

    def loader(path, model_options={}):
        calls.append(path)
        return Model(1)

    first = cache.load("dit", [a], loader, a, model_options={"dtype": __import__("torch").bfloat16})
    again = cache.load("dit", [a], loader, a, model_options={"dtype": __import__("torch").bfloat16})
    assert first is again and calls == [a]
    other = cache.load("dit", [a], loader, a, model_options={"dtype": __import__("torch").float16})
    assert other is not first and len(calls) == 2
    assert cache.stats()["hits"] == 1 and cache.stats()["misses"] == 2


def test_unhashable_arguments_are_normalised(cache, tmp_path):
    import torch
    a, b = files(tmp_path, "a", "b")
    key1 = cache.make_key("clip", [a, b], ([a, b], ["emb"]), {"model_options": {"y": 1, "x": [1, 2]},
                                                             "device": torch.device("cpu")})
    key2 = cache.make_key("clip", [a, b], ((a, b), ("emb",)), {"device": torch.device("cpu"),
                                                             "model_options": {"x": (1, 2), "y": 1}})
    assert key1 == key2 and hash(key1) == hash(key2)
    assert cache.make_key("clip", [b, a]) != cache.make_key("clip", [a, b])


def test_replaced_file_loads_again(cache, tmp_path):
    a, = files(tmp_path, "a")
    first = cache.load("vae", [a], lambda: Model(1))
    st = os.stat(a)
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))
    assert cache.load("vae", [a], lambda: Model(1)) is not first


def test_least_recently_used_goes_first_by_count(cache, tmp_path):
    names = files(tmp_path, "a", "b", "c", "d")
    made = {n: cache.load("dit", [n], Model, 1) for n in names[:3]}
    cache.load("dit", [names[0]], Model, 1)  # touch a: b is now the oldest
    cache.load("dit", [names[3]], Model, 1)
    assert cache.load("dit", [names[0]], Model, 1) is made[names[0]]
    assert cache.load("dit", [names[1]], Model, 1) is not made[names[1]]
    assert cache.stats()["evictions"] >= 1 and cache.stats()["entries"] <= 3


def test_byte_budget_bounds_the_cache(cache, tmp_path):
    a, b = files(tmp_path, "a", "b")
    ma = cache.load("dit", [a], Model, 6)
    cache.load("dit", [b], Model, 6)  # 12 bytes > 10: a goes
    assert cache.stats()["entries"] == 1 and cache.stats()["bytes"] == 6
    assert cache.load("dit", [a], Model, 6) is not ma
    big = cache.load("dit", [a], Model, 11)  # larger than the whole budget: returned, never cached
    assert cache.load("dit", [a], Model, 11) is not big


def test_clear_drops_everything(cache, tmp_path):
    a, = files(tmp_path, "a")
    m = cache.load("dit", [a], Model, 1)
    cache.clear()
    assert cache.stats()["entries"] == 0 and cache.load("dit", [a], Model, 1) is not m


WIRING = r"""
import os, sys, json
import comfy.cli_args
comfy.cli_args.args.cpu = True
import comfy.model_management, comfy.sd, comfy.model_cache, comfy.utils, folder_paths, nodes
path, other = sys.argv[1], sys.argv[2]
from h3kit.runtime import reads as read_counter
counts = read_counter.count(comfy.utils)
out = {}
m1 = comfy.sd.load_diffusion_model(path)
m2 = comfy.sd.load_diffusion_model(path)
out["dit_same"] = m1 is m2
out["dit_reads"] = sum(counts.values())
m3 = comfy.sd.load_diffusion_model(path, model_options={"dtype": __import__("torch").float16})
out["dtype_distinct"] = m3 is not m1
fn, args = m1.cached_patcher_init[0], m1.cached_patcher_init[1]
out["factory"] = fn.__name__
fresh = fn(*args)
out["factory_fresh"] = fresh.model is not m1.model
out["reads_after_factory"] = sum(counts.values())
comfy.model_management.unload_all_models()
out["after_unload_entries"] = comfy.model_cache.stats()["entries"]
m4 = comfy.sd.load_diffusion_model(path)
out["reload_after_unload"] = m4 is not m1
# load_clip and VAELoader route through the same cache (the loaders' bodies are upstream's)
clip_calls = []
comfy.sd.load_clip_uncached = lambda *a, **k: clip_calls.append(a) or object()
c1 = comfy.sd.load_clip([path], clip_type=comfy.sd.CLIPType.MINIMAX)
c2 = comfy.sd.load_clip([path], clip_type=comfy.sd.CLIPType.MINIMAX)
c3 = comfy.sd.load_clip([path, other], clip_type=comfy.sd.CLIPType.MINIMAX)
out["clip_same"], out["clip_calls"], out["clip_two_files_distinct"] = c1 is c2, len(clip_calls), c3 is not c1
vae_calls = []
nodes.VAELoader.load_vae_uncached = lambda self, name: vae_calls.append(name) or (object(),)
folder_paths.get_full_path_or_raise = lambda folder, name: path
v1 = nodes.VAELoader().load_vae("h3_vae.safetensors")
v2 = nodes.VAELoader().load_vae("h3_vae.safetensors")
out["vae_same"], out["vae_calls"] = v1 is v2, len(vae_calls)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def tiny_dits(installed_tree, comfy_python, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    paths = [d / "h3kit_tiny_a.safetensors", d / "h3kit_tiny_b.safetensors"]
    comfy_server.write_tiny_dits(comfy_python, installed_tree, paths, seed=1)
    return paths


@pytest.mark.upstream
def test_loaders_use_the_cache_inside_the_patched_upstream(installed_tree, comfy_python, tiny_dits, tmp_path):
    a, b = tiny_dits
    proc = subprocess.run([comfy_python, "-c", WIRING, str(a), str(b)], cwd=installed_tree, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(installed_tree), str(ROOT / "toolkit")])))
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, proc.stdout + proc.stderr
    out = __import__("json").loads(line[7:])
    assert out == {
        "dit_same": True, "dit_reads": 1, "dtype_distinct": True,
        "factory": "load_diffusion_model_uncached", "factory_fresh": True, "reads_after_factory": 3,
        "after_unload_entries": 0, "reload_after_unload": True,
        "clip_same": True, "clip_calls": 2, "clip_two_files_distinct": True,
        "vae_same": True, "vae_calls": 1,
    }


def _abab_loads(tree, python, workdir, port_range, tiny, free=True):
    """Five prompts A B A B A (UNETLoader -> ModelSave) on a server, then (`free`: the patched tree, whose model
    cache logs what POST /free drops) a free and B again; returns (weight-file reads, reads after the free, logs,
    seconds)."""
    workdir.mkdir()
    with comfy_server.running(tree, workdir, python, port_range, count_loads=True) as srv:
        dm = srv.models / "diffusion_models"
        dm.mkdir()
        for src in tiny:
            shutil.copy(src, dm / src.name)
        t0 = time.perf_counter()
        for i, name in enumerate("ABABA"):
            prompt = {"1": {"class_type": "UNETLoader",
                            "inputs": {"unet_name": f"h3kit_tiny_{name.lower()}.safetensors", "weight_dtype": "default"}},
                      "2": {"class_type": "ModelSave", "inputs": {"model": ["1", 0], "filename_prefix": f"p{i}"}}}
            srv.run_prompt(prompt)
        elapsed = time.perf_counter() - t0
        abab_log = srv.log_text()  # the five prompts' part alone: POST /free is processed between prompts, later
        reads = [ln for ln in abab_log.splitlines() if ln.startswith("H3KIT-LOAD") and "h3kit_tiny_" in ln]
        if not free:  # the pin has no model cache: nothing of it to drop, and no line that says it did
            return reads, [], (abab_log, abab_log), elapsed
        # POST /free with unload_models empties the cache: B (not the executor's last output) is read again
        comfy_server.http("POST", srv.url + "/free", {"unload_models": True})
        # the prompt worker acts on a free between queue items: a prompt queued before it woke ran first (CI,
        # loaded). The cache holds A and B here, so its 'dropping' line is sure to come; without it, fail
        srv.wait_for_log("Model cache: dropping", since=len(abab_log), timeout=120)
        srv.run_prompt({"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "h3kit_tiny_b.safetensors",
                                                                   "weight_dtype": "default"}},
                        "2": {"class_type": "ModelSave", "inputs": {"model": ["1", 0], "filename_prefix": "after_free"}}})
        log = srv.log_text()
        after_free = [ln for ln in srv.log_text().splitlines() if ln.startswith("H3KIT-LOAD") and "h3kit_tiny_" in ln]
    return reads, after_free, (abab_log, log), elapsed


@pytest.mark.upstream
@pytest.mark.slow
def test_alternating_prompts_load_each_file_once(pin_tree, installed_tree, comfy_python, tiny_dits, tmp_path):
    """At the pin, A B A B A reads a model five times; with the caches each file is read once."""
    pin_reads, _, _, _ = _abab_loads(pin_tree, comfy_python, tmp_path / "pin", (8300, 8349), tiny_dits, free=False)
    reads, after_free, (abab_log, log), _ = _abab_loads(installed_tree, comfy_python, tmp_path / "patched", (8350, 8399),
                                                       tiny_dits)
    assert len(pin_reads) == 5, pin_reads
    assert len(reads) == 2, reads
    assert sorted(r.rsplit("/", 1)[1] for r in reads) == ["h3kit_tiny_a.safetensors", "h3kit_tiny_b.safetensors"]
    assert abab_log.count("Model cache: reusing diffusion_model") == 3  # A B A B A: three reuses
    assert "Model cache: dropping 2 cached models" in log
    assert len(after_free) == 3 and after_free[-1].endswith("h3kit_tiny_b.safetensors")  # /free dropped the cache
