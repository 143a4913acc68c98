"""Checks of INT8 H3 weights inside a patched tree: the pin's layout, the NPU arm's dispatch and arithmetic, the
host anchors.

    H3KIT_SIM_DEVICES=4 python int8_checks.py --comfy-home TREE --out FILE [--only a,b]

Runs in the ComfyUI interpreter on CPU with 4 simulated devices, where comfy/npu_quant.py runs the reference
of the NPU kernels (ReferenceOps) in their place. The tiny INT8 DiT comes from h3kit's tiny_models
(dit_int8: its block linears int8_tensorwise with ConvRot, as the published H3 INT8 files). Each check records
what it observed; tests/test_int8.py asserts on the values.
"""

from __future__ import annotations

import os

import checks_runner  # tests/support, beside this script (its folder is on sys.path)
from h3kit.runtime import int8_probe

CHECKS = {}
_CACHE = {}
SEED = 3


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _int8_file():
    from h3kit import tiny_models
    path = os.path.join(os.environ["H3KIT_CHECK_TMP"], "h3kit_tiny_dit_int8.safetensors")
    if not os.path.exists(path):
        tiny_models.write("dit_int8", path, SEED)
    return path


def _load():
    """The tiny INT8 DiT through the stock UNETLoader node (a fresh ModelPatcher each call)."""
    import folder_paths
    import nodes
    folder_paths.add_model_folder_path("diffusion_models", os.path.dirname(_int8_file()), is_default=True)
    return nodes.UNETLoader().load_unet(os.path.basename(_int8_file()), "default")[0]


def _forward(dm, dtype=None):
    """One DiT forward on fixed random inputs (a t2va layout: 7 text tokens, 2x8x8 video latents, 5 audio)."""
    import torch
    g = torch.Generator().manual_seed(SEED)
    ctx = torch.randn(1, 7, 16, generator=g)
    ctx = dm.preprocess_text_embeds(ctx if dtype is None else ctx.to(dtype))
    x = [torch.randn(1, 24, 2, 8, 8, generator=g), torch.randn(1, 32, 2, 5, generator=g)]
    return dm(x, torch.tensor([500.0]), ctx, transformer_options={}, minimax_payload={})


def _captured_calls():
    """Every call the NPU arm served in one forward of the tiny INT8 DiT: (dm, [(layer name, kwargs, output)])."""
    if "calls" not in _CACHE:
        dm = _load().model.diffusion_model
        _CACHE["calls"] = (dm, int8_probe.record_calls(dm, lambda: _forward(dm)))
    return _CACHE["calls"]


@check
def layout():
    """The tiny INT8 file loads through UNETLoader as the pin loads INT8: detected, mixed-precision ops, the
    TensorWiseINT8Layout with ConvRot; upstream's own state_dict() gives the file's INT8 entries back."""
    import torch
    import comfy.utils
    patcher = _load()
    dm = patcher.model.diffusion_model
    q = int8_probe.quantized_layers(dm)
    layer = next(iter(q.values()))
    p = layer.weight._params
    sd = comfy.utils.load_torch_file(_int8_file())
    mine = dm.state_dict()
    int8_keys = [k for k in sd if k.rsplit(".", 1)[0] in q]
    return {"model": type(dm).__name__, "ops": type(layer).__qualname__, "quant_config": patcher.model.model_config.quant_config,
            "layers": sorted(q), "layout": layer.weight._layout_cls, "qdata": str(layer.weight._qdata.dtype),
            "convrot": p.convrot, "groupsize": p.convrot_groupsize, "scale": [str(p.scale.dtype), list(p.scale.shape)],
            "orig_dtype": str(p.orig_dtype), "float_layers": [type(dm.video_patch_proj.weight).__name__,
                                                             type(dm.blocks[0].adaln_proj.linear.weight).__name__],
            "keys_per_layer": sorted({k.rsplit(".", 1)[1] for k in int8_keys}),
            "state_dict_round_trip": all(torch.equal(mine[k], sd[k]) for k in int8_keys), "int8_keys": len(int8_keys)}


@check
def dispatch():
    """Both of the pin's INT8 entry points reach the NPU arm on a CPU that simulates devices; H3KIT_NPU_INT8=off,
    or no simulation, leaves them to upstream's eager backend."""
    import torch
    import comfy.npu_quant as nq
    import comfy.ops
    import comfy.quant_ops
    registry = comfy.quant_ops.ck.registry
    dm = _load().model.diffusion_model
    qkv, fc1, fc2 = dm.blocks[0].attn.qkv_proj, dm.blocks[0].mlp.fc1, dm.blocks[0].mlp.fc2
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    probe = {"x": x, "weight": qkv.weight._qdata, "weight_scale": qkv.weight._params.scale, "bias": None,
             "out_dtype": torch.float32, "convrot": True, "convrot_groupsize": 64}

    def run():
        before = nq.stats()
        with torch.no_grad():
            qkv(x)
            comfy.ops.linear_input_act(fc2, fc1(x), "swiglu")
        return {k: v - before.get(k, 0) for k, v in nq.stats().items() if v != before.get(k, 0)}

    out = {"priority": list(registry._priority), "backend": registry.get_capable_backend("int8_linear", probe),
           "kernels": nq.kernels_for(torch.device("cpu")).__name__, "calls": run()}
    env = dict(os.environ)
    try:
        os.environ[nq.MODE_ENV] = "off"
        out["off"] = {"backend": registry.get_capable_backend("int8_linear", probe), "calls": run()}
        os.environ[nq.MODE_ENV] = "npu"  # torch_npu's kernels required: none here
        out["npu_without_torch_npu"] = registry.get_capable_backend("int8_linear", probe)
        os.environ.pop(nq.MODE_ENV)
        os.environ.pop("H3KIT_SIM_DEVICES")
        out["no_simulation"] = registry.get_capable_backend("int8_linear", probe)
    finally:
        os.environ.clear()
        os.environ.update(env)
    return out


@check
def policy():
    """linear_mode per call, and the measurement behind its one content rule: without ConvRot an MLP down
    projection (the SwiGLU product, heavy-tailed) loses much more to per-token int8 than the other linears."""
    import torch
    import comfy.npu_quant as nq
    import comfy.quant_ops
    table = {f"{rows}/{act}/{rot}": nq.linear_mode(rows, act, rot, environ={})
             for rows in (7, 16, 17, 4096) for act in (None, "swiglu") for rot in (False, True)}
    forced = [nq.linear_mode(4096, environ={nq.LINEAR_ENV: "w8a16"}), nq.linear_mode(3, environ={nq.LINEAR_ENV: "w8a8"})]
    dm, calls = _captured_calls()
    fc1_in = next(kw["x"] for name, kw, _ in calls if name == "blocks.0.mlp.fc1")
    fc1, fc2 = dm.blocks[0].mlp.fc1, dm.blocks[0].mlp.fc2
    h = torch.nn.functional.linear(fc1_in.float(), fc1.weight.dequantize().float())
    err = {}
    env = dict(os.environ)
    try:
        os.environ[nq.LINEAR_ENV] = nq.W8A8
        for rot in (True, False):
            for name, layer, x, act in (("fc1", fc1, fc1_in, None), ("fc2", fc2, h, "swiglu")):
                w = layer.weight.dequantize().float()
                qt = comfy.quant_ops.QuantizedTensor.from_float(w, "TensorWiseINT8Layout", per_channel=True,
                                                                convrot=rot, convrot_groupsize=64)
                out = nq.int8_linear(x, qt._qdata, qt._params.scale, None, torch.float32, rot, 64, act)
                ref = int8_probe.dequantized(qt, x, act)
                err[f"{name}/{'convrot' if rot else 'plain'}"] = int8_probe.errors(out, ref)["rel_rms"]
    finally:
        os.environ.clear()
        os.environ.update(env)
    x = h.chunk(2, -1)
    act = torch.nn.functional.silu(x[0]) * x[1]
    kurt = lambda t: (((t - t.mean()) ** 4).mean() / t.var() ** 2).item()  # noqa: E731
    return {"table": table, "forced": forced, "w8a8_rel_rms": err, "kurtosis": {"fc1_in": kurt(fc1_in), "fc2_in": kurt(act)}}


@check
def versus_upstream():
    """Every INT8 linear of one tiny DiT forward, the NPU arm (reference kernels) against upstream's own
    dequantized result; also the pin's eager int8_linear, for scale, and the bf16 kernel path."""
    dm, calls = _captured_calls()
    return int8_probe.layer_errors(dm, calls)


@check
def faults():
    """Subtle faults in the arm, each measured against upstream's dequantized result as versus_upstream is:
    the activations not rotated, one weight scale for every channel, truncation instead of rounding."""
    import torch
    import comfy.npu_quant as nq
    import comfy_kitchen.backends.eager as eager
    dm, calls = _captured_calls()
    name, kwargs, _ = next(c for c in calls if c[0] == "blocks.1.attn.qkv_proj")
    ref = int8_probe.dequantized(dm.get_submodule(name).weight, kwargs["x"])
    out = {}
    real_quant = nq.ReferenceOps.npu_dynamic_quant

    def truncating(x, **kw):
        xf = x.float()
        scale = xf.abs().amax(dim=-1) / 127.0
        return torch.trunc(xf / scale.unsqueeze(-1)).clamp(-128, 127).to(torch.int8), scale

    out["not_rotated"] = int8_probe.errors(nq.int8_linear(**dict(kwargs, convrot=False)), ref)
    scale = kwargs["weight_scale"]
    out["per_tensor_scale"] = int8_probe.errors(nq.int8_linear(**dict(kwargs, weight_scale=scale.max().reshape(1))), ref)
    nq.ReferenceOps.npu_dynamic_quant = staticmethod(truncating)
    try:
        out["truncating"] = int8_probe.errors(nq.int8_linear(**kwargs), ref)
    finally:
        nq.ReferenceOps.npu_dynamic_quant = staticmethod(real_quant)
    out["sound"] = int8_probe.errors(nq.int8_linear(**kwargs), ref)
    out["pin_eager"] = int8_probe.errors(eager.int8_linear(**kwargs), ref)
    return out


@check
def exact_w8a8():
    """The reference W8A8 is the pin's W8A8 with fp32 division: the same int8 activations and scales as
    comfy-kitchen's quantize_int8_rowwise of the widened activations, the outputs within one bf16 rounding of
    its int8_linear's fp32 result; the pin's own bf16 path divides in bf16 and quantizes some values apart."""
    import torch
    import comfy.npu_quant as nq
    import comfy_kitchen.backends.eager as eager
    from comfy_kitchen.tensor.int8_utils import _build_hadamard, _rotate_activation
    _, calls = _captured_calls()
    name, kwargs, _ = next(c for c in calls if c[0] == "blocks.0.mlp.fc1")
    x = kwargs["x"]
    xr = _rotate_activation(x, _build_hadamard(64, dtype=x.dtype), 64).to(torch.bfloat16)
    q_ref, s_ref = nq.ReferenceOps.npu_dynamic_quant(xr)
    q_pin, s_pin = eager.quantize_int8_rowwise(xr.float())
    q_pin16, _ = eager.quantize_int8_rowwise(xr)
    w, ws = kwargs["weight"], kwargs["weight_scale"]
    arm = nq.ReferenceOps.npu_quant_matmul(q_ref, w.t(), ws.float().reshape(-1), pertoken_scale=s_ref,
                                           output_dtype=torch.bfloat16)
    pin = eager.int8_linear(xr.float(), w, ws, None, torch.float32, False).to(torch.bfloat16)
    ulps = (arm.view(torch.int16).int() - pin.view(torch.int16).int()).abs()
    return {"int8_equal": torch.equal(q_ref, q_pin), "scales_equal": torch.equal(s_ref, s_pin.reshape(-1)),
            "max_ulp": int(ulps.max()), "outputs_differing": float((ulps > 0).float().mean()),
            "bf16_division_differs": float((q_pin16 != q_ref).float().mean()),
            "bf16_division_max_step": int((q_pin16.int() - q_ref.int()).abs().max()), "elements": q_ref.numel()}


@check
def shards():
    """Per-token scales make sequence sharding exact: rows computed in shards equal the full call bit for bit,
    in both modes; a per-tensor activation scale (the fault) would not be."""
    import torch
    import comfy.npu_quant as nq
    _, calls = _captured_calls()
    _, kwargs, _ = next(c for c in calls if c[0] == "blocks.0.attn.out_proj")
    x = kwargs["x"]
    cuts = [0, 13, 30, x.shape[0]]  # uneven shards

    def sharded(**kw):
        return torch.cat([nq.int8_linear(**dict(kw, x=x[a:b])) for a, b in zip(cuts, cuts[1:])])

    out = {}
    env = dict(os.environ)
    real_quant = nq.ReferenceOps.npu_dynamic_quant
    try:
        for mode in (nq.W8A8, nq.W8A16):
            os.environ[nq.LINEAR_ENV] = mode
            out[mode] = torch.equal(nq.int8_linear(**kwargs), sharded(**kwargs))

        def per_tensor(x, **kw):  # one scale for the whole call: it depends on which rows the call holds
            xf = x.float()
            scale = xf.abs().amax().expand(x.shape[0]) / 127.0
            return torch.round(xf / scale.unsqueeze(-1)).clamp(-128, 127).to(torch.int8), scale.contiguous()

        os.environ[nq.LINEAR_ENV] = nq.W8A8
        nq.ReferenceOps.npu_dynamic_quant = staticmethod(per_tensor)
        full = nq.int8_linear(**kwargs)
        out["per_tensor_max_rel"] = ((full - sharded(**kwargs)).abs().max() / full.abs().max()).item()
    finally:
        nq.ReferenceOps.npu_dynamic_quant = staticmethod(real_quant)
        os.environ.clear()
        os.environ.update(env)
    return out


@check
def anchors():
    """The INT8 DiT made sequence-parallel on 4 devices: each of ranks 1-3's copies (replicas) loaded onto a stand-in device ("meta":
    nothing can come back by copying) and unloaded 3 times, through ModelPatcher; afterwards every INT8 weight
    of the source and the 3 replicas is back in one host copy. The control, an unanchored copy, cannot come back."""
    import torch
    import comfy.model_patcher
    import comfy.multinpu_dit as mdit
    import comfy.multinpu_weights as weights
    import comfy.sd
    import comfy.utils
    patcher = _load()
    dm = patcher.model.diffusion_model
    source = {n: m.weight._qdata.untyped_storage().data_ptr() for n, m in int8_probe.quantized_layers(dm).items()}
    par = mdit.apply_sequence_parallel(patcher, [torch.device("cpu")] * 4)
    w = mdit.get_wrapper(par)
    w.runtime.run("dit_empty_cache", None, configs=[w.config])  # every rank sets up its own copy (a real command)
    replicas = [c.configs[w.config.id].patcher.model for c in w.runtime.contexts[1:]]
    cycles = 0
    for _ in range(3):
        for r in replicas:
            p = comfy.model_patcher.ModelPatcher(r, load_device=torch.device("meta"), offload_device=torch.device("cpu"))
            p.load(torch.device("meta"), full_load=True)
            assert all(m.weight.device.type == "meta" for m in int8_probe.quantized_layers(r.diffusion_model).values())
            p.detach()
            cycles += 1
    back = [{n: m.weight._qdata.untyped_storage().data_ptr() for n, m in int8_probe.quantized_layers(r.diffusion_model).items()}
            for r in replicas]
    storages = {ptr for b in back for ptr in b.values()} | set(source.values())
    # the control: the same file loaded apart from the loaders (whose global cache hands back the model above,
    # anchored by now), never anchored
    control = comfy.sd.load_diffusion_model_state_dict(comfy.utils.load_torch_file(_int8_file())).model.diffusion_model
    control.to("meta")
    try:
        control.to("cpu")
        unanchored = "copied"
    except NotImplementedError:
        unanchored = "fails"
    return {"replicas": len(replicas), "cycles": cycles, "int8_weights": len(source),
            "all_back_to_source": all(b == source for b in back), "host_copies": len(storages) / len(source),
            "anchored_storages_equal": weights.host_storages(dm) >= set(source.values()),
            "unanchored_back_from_meta": unanchored}


def _same(a, b) -> bool:
    """Bit-identical outputs (a DiT forward returns [video, audio])."""
    import torch
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def _private_model():
    """The tiny INT8 DiT's ModelPatcher, loaded apart from the loaders' global cache (a model this check may change)."""
    import comfy.sd
    import comfy.utils
    return comfy.sd.load_diffusion_model_state_dict(comfy.utils.load_torch_file(_int8_file()))


@check
def nz_precast():
    """INT8 weights cast once to [K, N] FRACTAL_NZ where they land on an NPU, on the CPU twin (ReferenceLayout under
    simulate_layout: the cpu stands for the NPU; a load or unload is Module._apply with a copying function, the copy
    .to(npu) and .to(cpu) make, which reaches comfy.ops._quantized_apply as ComfyUI's moves do). Counted: casts per
    load and over forwards, the ND device copies released, the bytes held, how the kernels received the weight,
    outputs against the ND path; then an unload, a reload, the off switch, the CPU simulation without the twin, and
    two faults (the ND copy kept, a cast per forward)."""
    import gc
    import weakref

    import torch

    import comfy.npu_quant as nq
    import comfy.utils
    out = {}

    def move(dm, record=None):
        def fn(t):
            c = t.clone()
            if record is not None and hasattr(c, "_qdata"):
                record.append(weakref.ref(c._qdata))
            return c
        with torch.no_grad():
            dm._apply(fn)
        gc.collect()

    def state(dm):
        layers = int8_probe.quantized_layers(dm)
        return {"layouts": sorted({m.weight._layout_cls for m in layers.values()}),
                "formats": sorted({nq.npu_format(m.weight._qdata) for m in layers.values()}),
                "storage_shapes": all(tuple(m.weight._qdata.shape) == tuple(m.weight.shape[::-1])
                                      for m in layers.values()),
                "held_bytes": sum(m.weight._qdata.untyped_storage().nbytes() for m in layers.values()),
                "one_copy_bytes": sum(m.weight.shape[0] * m.weight.shape[1] for m in layers.values())}

    def forwards(dm, n, ref):
        before = nq.layout_stats()["x2"]
        outs = [_forward(dm) for _ in range(n)]
        after = nq.layout_stats()["x2"]
        return {"equal": all(_same(o, ref) for o in outs),
                "x2": {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}}

    patcher = _private_model()
    dm = patcher.model.diffusion_model
    layers = int8_probe.quantized_layers(dm)
    out["layers"] = len(layers)
    host = {n: m.weight.dequantize() for n, m in layers.items()}
    ref = _forward(dm)  # the unmodified ND path (the CPU simulation's reference kernels)
    # a weight cast to NZ runs W8A8 at any row count (W8A16 takes no NZ weight in eager mode): its reference is the
    # ND path with every layer W8A8
    env = dict(os.environ)
    try:
        os.environ[nq.LINEAR_ENV] = "w8a8"
        ref_w8a8 = _forward(dm)
    finally:
        os.environ.clear()
        os.environ.update(env)
    out["w8a8_differs_from_auto"] = not _same(ref, ref_w8a8)

    # the CPU simulation itself never casts: a ModelPatcher load on cpu, forwards
    casts0 = nq.layout_stats()["casts"]
    patcher.load(torch.device("cpu"), full_load=True)
    sim = forwards(dm, 1, ref)
    out["simulation"] = {"ops": nq.layout_ops_for(torch.device("cpu")) is None,
                         "casts": nq.layout_stats()["casts"] - casts0, "equal": sim["equal"], "x2": sim["x2"],
                         "layouts": state(dm)["layouts"]}
    patcher.detach()

    twin = nq.ReferenceLayout()
    with nq.simulate_layout(twin):
        nd_copies = []
        move(dm, nd_copies)  # load
        out["load"] = dict(state(dm), casts=twin.casts, nd_copies=len(nd_copies),
                           nd_released=sum(r() is None for r in nd_copies))
        seen = []
        real = nq.ReferenceOps.npu_quant_matmul

        def spy(x1, x2, *a, **k):
            seen.append(x2.untyped_storage().data_ptr())
            return real(x1, x2, *a, **k)
        nq.ReferenceOps.npu_quant_matmul = staticmethod(spy)
        try:
            f = forwards(dm, 3, ref_w8a8)
        finally:
            nq.ReferenceOps.npu_quant_matmul = staticmethod(real)
        held = {m.weight._qdata.untyped_storage().data_ptr() for m in layers.values()}
        out["forwards"] = dict(f, casts=twin.casts, weights_passed_are_held=bool(seen) and set(seen) <= held)
    casts = twin.casts
    move(dm)  # unload: to a device that is not an NPU (the copy back to the host, ND)
    out["unload"] = dict(state(dm), casts=twin.casts - casts,
                         dequantize_equal=all(torch.equal(m.weight.dequantize(), host[n]) for n, m in layers.items()))
    sd, mine = comfy.utils.load_torch_file(_int8_file()), dm.state_dict()
    out["unload"]["state_dict_equal"] = all(torch.equal(mine[k], sd[k]) for k in sd
                                            if k.rsplit(".", 1)[0] in layers and not k.endswith("comfy_quant"))
    out["unload"].update(forwards(dm, 1, ref))
    with nq.simulate_layout(twin):
        casts = twin.casts
        move(dm)  # reload
        out["reload"] = dict(state(dm), casts=twin.casts - casts, **forwards(dm, 2, ref_w8a8))

    # the off switch, on a fresh copy
    dm2 = _private_model().model.diffusion_model
    env = dict(os.environ)
    try:
        os.environ[nq.NZ_ENV] = "0"
        with nq.simulate_layout(nq.ReferenceLayout()) as off:
            move(dm2)
            out["off"] = dict(state(dm2), casts=off.casts, **forwards(dm2, 1, ref))
    finally:
        os.environ.clear()
        os.environ.update(env)

    # faults: the ND copy kept beside the cast one; a cast on every forward
    kept, real_landed = [], nq.landed

    def keeping(p):
        kept.append(p)
        return real_landed(p)
    dm3 = _private_model().model.diffusion_model
    nq.landed = keeping
    try:
        with nq.simulate_layout(nq.ReferenceLayout()):
            nd_copies = []
            move(dm3, nd_copies)
    finally:
        nq.landed = real_landed
    out["fault_keep_nd"] = {"nd_released": sum(r() is None for r in nd_copies), "nd_copies": len(nd_copies)}
    del kept
    real_linear = nq.int8_linear

    def casting(x, weight, *a, weight_kn=False, **k):
        if weight_kn:
            weight = fault_twin.npu_format_cast(weight.clone(), nq.ACL_FORMAT_FRACTAL_NZ)
        return real_linear(x, weight, *a, weight_kn=weight_kn, **k)
    with nq.simulate_layout(nq.ReferenceLayout()) as fault_twin:
        move(dm3)
        nq.int8_linear = casting
        try:
            f = forwards(dm3, 3, ref)
        finally:
            nq.int8_linear = real_linear
        out["fault_cast_per_forward"] = dict(f, casts=fault_twin.casts)
    return out


def main(argv=None):
    args = checks_runner.boot_comfy(argv)
    return checks_runner.run_checks(CHECKS, args.only, args.out)


if __name__ == "__main__":
    checks_runner.exit_without_teardown(main())
