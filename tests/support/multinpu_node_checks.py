"""Checks of the device layer, the DiT wrapper and the MultiNPUParallelConfig node, inside a patched tree.

    H3KIT_SIM_DEVICES=3 python multinpu_node_checks.py --comfy-home TREE --out FILE

Runs in the ComfyUI interpreter (comfy imports need the tree on sys.path and --cpu set first). Each
check records what it observed, {"ok": true, "value": ...} or {"ok": false, "error", "traceback"};
tests/test_multinpu_node.py asserts on the values. The process simulates 3 devices, so npu_count 4
is a mismatch and 2 is not (npu_count must equal the device count) either: only 1 passes.
"""

from __future__ import annotations

import os
import sys
import time
import types
import checks_runner  # noqa: E402  (tests/support, beside this script)

CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _tiny_patcher():
    import torch
    import comfy.sd
    sys.path.insert(0, os.environ["H3KIT_RUNTIME_DIR"])
    import parity_worker
    path = os.path.join(os.environ["H3KIT_CHECK_TMP"], "tiny.safetensors")
    if not os.path.exists(path):
        parity_worker._tiny_checkpoint(path, 0)
    return comfy.sd.load_diffusion_model(path, model_options={"dtype": torch.float32}), parity_worker


def _forward(patcher, seed=0):
    """One direct DiT forward with the patcher's wrappers and block replacements, as the sampler passes them."""
    import torch
    import comfy.patcher_extension
    _, pw = _tiny_patcher()
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(pw.VIDEO_SHAPE, generator=g), torch.randn(pw.AUDIO_SHAPE, generator=g)]
    ctx = torch.randn(1, pw.TEXT_LEN, pw.TINY["text_dim"], generator=g)
    to = comfy.patcher_extension.copy_nested_dicts(patcher.model_options["transformer_options"])
    to["wrappers"] = comfy.patcher_extension.copy_nested_dicts(patcher.wrappers)
    with torch.no_grad():
        return patcher.model.diffusion_model(x, torch.tensor([500.0]), ctx, transformer_options=to, minimax_payload={})


@check
def process_transport_server_copy():
    """With the process transport the server computes no DiT forward: its copy of the model must stay on the host,
    unpatched, while worker rank 0's device and the LoRA go to the workers. A stand-in accelerator ("meta") as the
    loaded model's device, and a stand-in runtime (apply_sequence_parallel only reads its size and settings)."""
    import torch
    import comfy.multinpu_dit
    import comfy.multinpu_runtime_base
    import comfy.multinpu_shard
    import comfy.multinpu_wire
    import comfy.patcher_extension
    from h3kit.runtime import parity_common, parity_dit
    base, _ = _tiny_patcher()
    lora = parity_common.lora_state_dict(base.model.diffusion_model.state_dict(), "blocks.", "diffusion_model.", 0)
    patched = parity_dit._apply_lora(base, lora)[0]
    runtime = comfy.multinpu_runtime_base.Runtime(comfy.multinpu_wire.GroupSpec(local_size=2, device_type="npu"))
    out = {}
    for weights in ("replicated", "sharded"):
        p = patched.clone()
        p.load_device = torch.device("meta")  # where an accelerator's rank 0 would compute
        with checks_runner.serving(runtime):
            m = comfy.multinpu_dit.apply_sequence_parallel(p, None, weights=weights)
        wrapper = comfy.multinpu_dit.get_wrapper(m)
        shards = comfy.multinpu_shard.of(m.model.diffusion_model)
        out[weights] = {"load_device": str(m.load_device), "offload_device": str(m.offload_device),
                        "rank_device": str(wrapper.rank_device), "devices": [str(wrapper.device)],
                        "server_patches": len(m.patches), "sent_patches": len(wrapper.config.payload["patches"]),
                        "shard_device": str(shards.device) if shards is not None else None,
                        "on_load": len(m.get_all_callbacks(comfy.patcher_extension.CallbacksMP.ON_LOAD))}
    return out


@check
def server_share_freed():
    """Issue 45 item 5: with the process transport the server's own models on device 0 (its text encoder embeddings
    and vision tower, its VAE encoder) are unloaded before sampling, so worker rank 0's loads there see the memory;
    not with threads (one memory manager) nor on a CPU. ComfyUI's free_memory recorded, not run."""
    import torch
    import comfy.model_management as mm
    import comfy.multinpu_dit as md
    import comfy.multinpu_process as mp
    import comfy.multinpu_threads as mt
    calls, real = [], mm.free_memory
    mm.free_memory = lambda required, device, *a, **k: calls.append([required, str(device)])
    try:
        out = {}
        for name, runtime, device in (("process_cuda0", object.__new__(mp.GroupRuntime), torch.device("cuda", 0)),
                                      ("process_cpu", object.__new__(mp.GroupRuntime), torch.device("cpu")),
                                      ("threads_cuda0", object.__new__(mt.ThreadRuntime), torch.device("cuda", 0))):
            calls.clear()
            md.free_server_share(runtime, device)
            out[name] = list(calls)
    finally:
        mm.free_memory = real
    import inspect
    out["rank_memory_calls_it"] = "free_server_share(" in inspect.getsource(md.RankMemory.__call__)
    return out


@check
def multidevice():
    import torch
    import comfy.multidevice as md
    env = {}
    counts = {v: md.sim_device_count({md.SIM_DEVICES_ENV: v}) for v in ("", "1", "4", "0", "x", "0,1")}
    counts["unset"] = md.sim_device_count(env)
    return {"kind": md.device_kind(), "counts": counts, "devices": [str(d) for d in md.get_devices()],
            "describe": md.describe_devices(), "devices_for_2": [str(d) for d in md.devices_for(torch.device("cpu"), 2)],
            "devices_for_4": md.devices_for(torch.device("cpu"), 4),
            "stream": md.current_stream(torch.device("cpu")), "sync": md.synchronize(torch.device("cpu"))}


@check
def multidevice_sim_accelerator():
    """H3KIT_SIM_DEVICES on a CUDA process (stood in by model_management answers): N ranks share the one card;
    without it, the visible devices in rank order."""
    import torch
    import comfy.model_management as mm
    import comfy.multidevice as md
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    saved = mm.cpu_state, mm.get_torch_device, mm.get_all_torch_devices, os.environ.get(md.SIM_DEVICES_ENV)
    mm.cpu_state, mm.get_torch_device, mm.get_all_torch_devices = mm.CPUState.GPU, lambda: cuda0, lambda: [cuda0, cuda1]
    try:
        sim = {"kind": md.device_kind(), "devices": [str(d) for d in md.get_devices()], "describe": md.describe_devices(),
               "devices_for_3": [str(d) for d in md.devices_for(cuda0, 3)], "devices_for_4": md.devices_for(cuda0, 4)}
        del os.environ[md.SIM_DEVICES_ENV]
        real = {"devices": [str(d) for d in md.get_devices()], "describe": md.describe_devices(),
                "devices_for_2": [str(d) for d in md.devices_for(cuda1, 2)], "devices_for_3": md.devices_for(cuda1, 3)}
    finally:
        mm.cpu_state, mm.get_torch_device, mm.get_all_torch_devices = saved[:3]
        os.environ[md.SIM_DEVICES_ENV] = saved[3]
    return {"sim": sim, "real": real}


@check
def npu_arms():
    """The NPU branches of model_management and multidevice, against a recording stand-in for torch.npu."""
    import torch
    import comfy.model_management as mm
    import comfy.multidevice as md
    import comfy.multinpu as mn
    calls = []

    class FakeNpu(types.ModuleType):
        current = 0

        def set_device(self, device):
            calls.append(("set_device", str(device)))
            FakeNpu.current = torch.device(device).index

        def current_device(self):
            return FakeNpu.current

        def synchronize(self, device=None):
            calls.append(("synchronize", None if device is None else str(device)))

        def current_stream(self, device=None):
            calls.append(("current_stream", None if device is None else str(device)))
            return types.SimpleNamespace(synchronize=lambda: calls.append(("stream_synchronize", None)))

    torch.utils.rename_privateuse1_backend("npu")
    torch._register_device_module("npu", FakeNpu("npu"))
    npu1 = torch.device("npu", 1)
    mm.set_torch_device(npu1)
    with mm.cuda_device_context(torch.device("npu", 2)):
        inside = FakeNpu.current
    after = FakeNpu.current
    saved = mm.cpu_state, mm.npu_available
    mm.cpu_state, mm.npu_available = mm.CPUState.GPU, True
    try:
        mm.synchronize()
        kind = md.device_kind()
    finally:
        mm.cpu_state, mm.npu_available = saved
    stream = mm.current_stream(npu1) is not None
    md.set_device(torch.device("npu", 3))
    md.synchronize(npu1)
    mn._stream_sync(npu1)
    threads = mn.RankThreads(["cpu", "npu:0"])  # the worker sets npu:0 through torch's device module
    time.sleep(0.2)
    threads.shutdown()
    return {"calls": calls, "inside": inside, "after": after, "kind": kind, "stream": stream}


@check
def schema():
    import comfy_extras.nodes_multinpu as nm
    node = nm.MultiNPUParallelConfigNode
    info = node.INPUT_TYPES()
    npu = info["required"]["npu_count"]
    weights = info["optional"]["weights"]
    return {"required": list(info["required"]), "optional": list(info.get("optional", {})),
            "npu_count": [npu[0], npu[1].get("options"), npu[1].get("default")],
            "weights": [weights[0], weights[1].get("options"), weights[1].get("default")],
            "return_types": list(node.RETURN_TYPES),
            "category": node.CATEGORY, "node_id": node.GET_SCHEMA().node_id}


@check
def device_check():
    import comfy.multinpu_dit
    import comfy_extras.nodes_multinpu as nm
    node = nm.MultiNPUParallelConfigNode
    verdicts = {n: node.validate_inputs(npu_count=n) for n in (1, 2, 3, 4, 8, "auto")}
    patcher, _ = _tiny_patcher()
    applied = []
    real = comfy.multinpu_dit.apply_sequence_parallel
    comfy.multinpu_dit.apply_sequence_parallel = lambda *a, **k: applied.append(a) or real(*a, **k)
    try:
        try:
            node.execute(model=patcher, npu_count=4)
            raised = None
        except ValueError as e:
            raised = str(e)
        out_one = node.execute(model=patcher, npu_count=1).args
    finally:
        comfy.multinpu_dit.apply_sequence_parallel = real
    return {"verdicts": verdicts, "raised": raised, "work_before_check": len(applied),
            "one_passes_through": out_one[0] is patcher and out_one[1:] == (None, None, None)}


def _rank_models(w):
    """Each rank's own copy of the DiT (BaseModel) in a thread runtime, its configuration installed first by a real
    command."""
    w.runtime.run("dit_empty_cache", None, configs=[w.config])
    return [c.configs[w.config.id].patcher.model for c in w.runtime.contexts]


@check
def wrapper_paths():
    """3 ranks (8 heads: auto picks the K/V gather) equal one device; replacements without the wrapper change nothing."""
    import torch
    import comfy.multinpu_dit
    import comfy.patcher_extension
    patcher, _ = _tiny_patcher()
    ref = _forward(patcher)
    m = comfy.multinpu_dit.apply_sequence_parallel(patcher, ["cpu"] * 3)
    w = comfy.multinpu_dit.get_wrapper(m)
    w.count_bytes = True  # every rank's counts to rank 0, as h3kit parity asks
    # the final layer must run once, on rank 0: the others stop after the last block
    final_calls = [0, 0, 0]
    models = _rank_models(w)
    hooks = [mdl.diffusion_model.final_layer.register_forward_hook(
        lambda mod, a, o, r=r: final_calls.__setitem__(r, final_calls[r] + 1)) for r, mdl in enumerate(models)]
    par = _forward(m)
    for h in hooks:
        h.remove()
    # every rank its own modules over the one host copy of the weights (the server's copy included)
    own = {id(mdl.diffusion_model) for mdl in models} | {id(m.model.diffusion_model)}
    replicas_share = len(own) == 4 and all(
        mdl.diffusion_model.blocks[0].attn.qkv_proj.weight.data_ptr()
        == patcher.model.diffusion_model.blocks[0].attn.qkv_proj.weight.data_ptr() for mdl in models)
    bare = m.clone()
    bare.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, comfy.multinpu_dit.KEY)
    no_wrapper = _forward(bare)
    again = comfy.multinpu_dit.apply_sequence_parallel(m, ["cpu"] * 3)
    return {"equal": checks_runner.all_equal(ref, par), "forwards": w.forwards,
            "rank_forwards": w.rank_forwards, "final_layer_calls": final_calls,
            "bytes": w.bytes_moved, "bytes_received": w.bytes_received, "attention_heads": 8,
            "replicas_share_weights": replicas_share, "server_device": str(m.load_device),
            "replicas": len(models), "extra_models": len(m.get_additional_models_with_key(comfy.multinpu_dit.KEY)),
            "blocks_without_wrapper_equal": checks_runner.all_equal(ref, no_wrapper),
            "reapplied_wrappers": len(again.get_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, comfy.multinpu_dit.KEY)),
            "reapplied_extra_models": len(again.get_additional_models_with_key(comfy.multinpu_dit.KEY))}


@check
def refusals():
    import torch
    import comfy.multinpu_dit
    patcher, _ = _tiny_patcher()
    out = {}
    foreign = patcher.clone()
    foreign.set_model_patch_replace(lambda args, extra: extra["original_block"](args), "dit", "double_block", 1)
    for name, p in (("foreign_block", foreign),
                    ("not_h3", types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=torch.nn.Linear(2, 2))))):
        try:
            comfy.multinpu_dit.apply_sequence_parallel(p, ["cpu", "cpu"])
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    later = comfy.multinpu_dit.apply_sequence_parallel(patcher, ["cpu", "cpu"])
    later.set_model_patch_replace(lambda args, extra: extra["original_block"](args), "dit", "double_block", 2)
    try:
        _forward(later)
        out["overridden_later"] = None
    except RuntimeError as e:
        out["overridden_later"] = str(e)
    # what only the thread path once ran: a diffusion-model wrapper added after the node, another node's attention
    # override; the ranks cannot run either (they exist only in the server), on either transport
    import comfy.patcher_extension
    wrapped = comfy.multinpu_dit.apply_sequence_parallel(patcher, ["cpu", "cpu"])
    wrapped.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "later",
                                 lambda executor, *a, **k: executor(*a, **k))
    overridden = comfy.multinpu_dit.apply_sequence_parallel(patcher, ["cpu", "cpu"])
    overridden.model_options["transformer_options"]["optimized_attention_override"] = (
        lambda func, *a, **k: func(*a, **k))
    for name, p in (("wrapper_after", wrapped), ("attention_override", overridden)):
        try:
            _forward(p)
            out[name] = None
        except RuntimeError as e:
            out[name] = str(e)
    return out


def _sp_model(timeout):
    import comfy.multinpu_dit
    patcher, _ = _tiny_patcher()
    m = comfy.multinpu_dit.apply_sequence_parallel(patcher, ["cpu"] * 3, timeout=timeout)
    return m, comfy.multinpu_dit.get_wrapper(m)


@check
def inputs_copied_before_rank0_works():
    """The workers copy their inputs off rank 0's device before rank 0 queues its own work there (where their
    copies would wait behind it): the command's buffer reaches them in worker rank 0's broadcast, which returns on
    rank 0 once every rank copied it. Each worker's copy is slowed down, and rank 0's first op must come after."""
    import threading
    import torch
    import comfy.multinpu
    m, w = _sp_model(timeout=300.0)
    models = _rank_models(w)
    copied, started = [], []
    real = comfy.multinpu.ThreadComm._copy_in

    def slow_copy(comm, t):
        if threading.current_thread() is not threading.main_thread() and t.dtype == torch.uint8:
            time.sleep(0.3)  # a worker receiving the command's buffer
            out = real(comm, t)
            copied.append(time.monotonic())
            return out
        return real(comm, t)

    hook = models[0].diffusion_model.video_patch_proj.register_forward_pre_hook(
        lambda mod, args: started.append(time.monotonic()))
    comfy.multinpu.ThreadComm._copy_in = slow_copy
    try:
        _forward(m)
    finally:
        comfy.multinpu.ThreadComm._copy_in = real
        hook.remove()
    return {"copies": len(copied), "rank0_started_after": bool(started) and min(started) >= max(copied)}


@check
def thread_runtime():
    """comfy.multinpu_threads.ThreadRuntime on its own: the command path (the payload through the wire code, one copy
    per rank), the caller's modes on every rank, After after the closing barrier, a rank's exception with its type and
    rank, and a configuration whose digest differs refused as the process driver refuses it."""
    import torch
    import comfy.multinpu_dit
    import comfy.multinpu_group as group
    import comfy.multinpu_process
    import comfy.multinpu_threads
    import comfy.multinpu_wire as wire
    rt = comfy.multinpu_threads.ThreadRuntime(["cpu"] * 3, timeout=60.0)
    seen, after = {}, []

    def probe(context, comm, payload):
        t = payload["t"]
        seen[comm.rank] = {"device": str(context.device), "same_context": context is rt.contexts[comm.rank],
                           "inference": torch.is_inference_mode_enabled(), "grad": torch.is_grad_enabled(),
                           "own_copy": t.data_ptr(), "value": t.tolist(), "text": payload["text"]}
        total = comfy.multinpu.all_reduce(t, comm)
        if comm.rank == 1:
            return group.After(lambda: after.append((len(seen), torch.is_inference_mode_enabled(),
                                                     torch.is_grad_enabled())))
        return {"sum": total} if comm.rank == 0 else None

    def failing(context, comm, payload):
        if comm.rank == 2:
            raise ValueError("injected on rank 2")
        comm.barrier()

    group.PROGRAMS["h3kit_test_probe"], group.PROGRAMS["h3kit_test_fail"] = probe, failing
    try:
        x = torch.arange(4.0)
        with torch.inference_mode():
            out = rt.run("h3kit_test_probe", {"t": x, "text": "hello"})
        try:
            rt.run("h3kit_test_fail", None)
            failed = None
        except ValueError as e:
            failed = {"message": str(e), "notes": getattr(e, "__notes__", [])}
        try:
            rt.run("h3kit_no_such_program", None)
            unknown = None
        except wire.GroupError as e:
            unknown = str(e)
        patcher, _ = _tiny_patcher()
        m = comfy.multinpu_dit.apply_sequence_parallel(patcher, ["cpu"] * 3)
        good = comfy.multinpu_dit.get_wrapper(m).config
        bad = comfy.multinpu_process.RemoteConfig(good.program, good.payload, dict(good.digest, files="other"), good.what)
        try:
            rt.run("dit_empty_cache", None, configs=[bad])
            mismatch = None
        except wire.ConfigMismatch as e:
            mismatch = str(e)
        rt.run("dit_empty_cache", None, configs=[good])
        installed = dict(good.installed)
    finally:
        del group.PROGRAMS["h3kit_test_probe"], group.PROGRAMS["h3kit_test_fail"]
        rt.shutdown()
    wrong_rank0 = []  # rank 0 works with the component's own copy: it must be on that copy's device
    for devices in (["meta", "cpu"], []):
        try:
            comfy.multinpu_threads.THREADS.runtime_for(devices, torch.device("cpu"), "VAE", 5.0)
        except ValueError as e:
            wrong_rank0.append(str(e))
    return {"result": {"sum": out["sum"].tolist()}, "seen": {str(k): v for k, v in seen.items()},
            "copies": len({v["own_copy"] for v in seen.values()} | {x.data_ptr()}), "after": after,
            "failed": failed, "unknown": unknown, "mismatch": mismatch, "installed": sorted(installed),
            "wrong_rank0": wrong_rank0,
            "spec": {"backend": rt.spec.backend, "world_size": rt.world_size, "rank1": rt.spec.describe_rank(1)}}


@check
def free_reaches_thread_ranks():
    """ComfyUI's free (POST /free, the OOM handler: unload_all_models empties the model cache) reaches a thread
    runtime's ranks as it reaches the process group's workers: before the next command every rank lets go of its
    configuration, and that command installs it again; without a free, nothing is installed again."""
    import comfy.model_management
    import comfy.multinpu_dit
    with checks_runner.counted_programs(("dit_config",)) as counted:
        m, w = _sp_model(timeout=300.0)
        _forward(m)
        held_before = [len(c.configs) for c in w.runtime.contexts]
        _forward(m)
        installs_before_free = len(counted["calls"]["dit_config"])
        comfy.model_management.unload_all_models()
        pending = w.runtime._free_pending
        _forward(m)
        installs_after_free = len(counted["calls"]["dit_config"])
    w.runtime.shutdown()
    return {"held_before": held_before, "installs_before_free": installs_before_free, "pending": pending,
            "installs_after_free": installs_after_free}


@check
def same_programs():
    """The thread transport runs the worker programs the process workers run (comfy.multinpu_group.PROGRAMS, by
    name), each rank with its own context: every registered DiT program is counted per rank over a setup, a forward
    and the cache emptying after sampling. And multinpu_dit.py has one code path (no thread-only branch left)."""
    import inspect
    import comfy.multinpu_dit
    import comfy.multinpu_threads
    names = ("dit_config", "dit_forward", "dit_empty_cache")
    with checks_runner.counted_programs(names) as counted:
        m, w = _sp_model(timeout=300.0)
        patcher, _ = _tiny_patcher()
        equal = checks_runner.all_equal(_forward(m), _forward(patcher))
        w.empty_caches()
    registered, calls = counted["registered"], counted["calls"]
    source = inspect.getsource(comfy.multinpu_dit)
    return {"registered": registered, "runtime": type(w.runtime).__module__ + "." + type(w.runtime).__name__,
            "calls": {n: sorted(r for r, _ in c) for n, c in calls.items()},
            "contexts": {n: len({i for _, i in c}) for n, c in calls.items()}, "equal": equal,
            "runtime_is_none": source.count("runtime is None"),
            "thread_only": [s for s in ("ThreadGroup", "RankThreads", "replicas", "get_additional_models")
                            if s in source]}


@check
def rank_failure():
    import torch
    import comfy.multinpu
    m, w = _sp_model(timeout=30.0)
    real = comfy.multinpu.all_gather_v

    def failing(x, comm, sizes=None, dim=0):
        if comm.rank == 2:
            raise RuntimeError("injected failure on rank 2")
        return real(x, comm, sizes=sizes, dim=dim)

    comfy.multinpu.all_gather_v = failing
    t0 = time.monotonic()
    try:
        _forward(m)
        err = None
    except RuntimeError as e:
        err = {"type": type(e).__name__, "message": str(e), "notes": getattr(e, "__notes__", [])}
    finally:
        comfy.multinpu.all_gather_v = real
    elapsed = time.monotonic() - t0
    # the next forward on the same model is the one-device result, bit for bit
    patcher, _ = _tiny_patcher()
    recovered = checks_runner.all_equal(_forward(m), _forward(patcher))
    return {"error": err, "seconds": elapsed, "recovered": recovered}


@check
def stall():
    import torch
    import comfy.multinpu
    timeout = 1.0
    m, w = _sp_model(timeout=timeout)
    real = comfy.multinpu.all_gather_v

    def stalling(x, comm, sizes=None, dim=0):
        if comm.rank == 1:
            time.sleep(6.0)
        return real(x, comm, sizes=sizes, dim=dim)

    comfy.multinpu.all_gather_v = stalling
    t0 = time.monotonic()
    try:
        _forward(m)
        err = None
    except comfy.multinpu.CollectiveError as e:
        err = {"type": type(e).__name__, "message": str(e)}
    finally:
        comfy.multinpu.all_gather_v = real
    elapsed = time.monotonic() - t0
    old = w.runtime._threads
    patcher, _ = _tiny_patcher()
    recovered = checks_runner.all_equal(_forward(m), _forward(patcher))
    # the abandoned worker wakes up, hits the broken group and exits: it must not outlive the process
    old_exited = old.join(15.0)
    return {"error": err, "seconds": elapsed, "timeout": timeout, "pool_broken": old.broken, "recovered": recovered,
            "new_pool": w.runtime._threads is not old and not w.runtime._threads.broken, "old_workers_exited": old_exited}


def main(argv=None):
    args = checks_runner.boot_comfy(argv)
    return checks_runner.run_checks(CHECKS, args.only, args.out)


if __name__ == "__main__":
    checks_runner.exit_without_teardown(main())
