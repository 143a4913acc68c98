"""The checks. Each takes the executed graph and a Context and appends Findings; none raises on bad data.

Facts behind them (the H3 traps users report, listed in docs/check-workflow.md, and the pinned source):
- comfy_extras/nodes_minimax_h3.py: EmptyMiniMaxH3LatentAV, MiniMaxH3ImageToVideo and
  MiniMaxH3ReferenceToVideo take width and height (INT, 32..MAX_RESOLUTION=16384, step 32) and length
  (INT, 5..3600, step 17). Width and height must be multiples of 32 (patchify fails otherwise), the
  canvas is capped at 768*1344 pixels, and `align_frame_count` snaps length up to the 17k+5 grid.
- Turbo LoRAs bind AdaLN adapters that pruned bases do not have; ancestral and SDE samplers and
  SageAttention degrade H3's audio; the audio VAE must stay fp32; one device at BF16 768p/15 s is not a
  supported setting.
- MultiNPUParallelConfig (h3kit patch series): npu_count must be 1, 2, 4 or 8 and equal the devices the
  service exposes, or auto (the service's own count, which must itself be 1, 2, 4 or 8); exactly one may be active and its MODEL output must reach a sampler. Its weights input
  (auto, replicated, sharded; a workflow saved before it existed runs with auto) says where the DiT's
  weights live, and with the card memory known the tier (devices, BF16 or INT8 weights, replicated or
  sharded, the geometry) must fit a card (h3kit.runtime.costmodel, the model `h3kit plan` prints).
"""

from __future__ import annotations

import math
import re

from h3kit.runtime import costmodel
from h3kit.workflow import catalog as catalog_mod, resolve
from h3kit.workflow.graph import Graph, Link, Node
from h3kit.workflow.resolve import UNKNOWN, as_int, value

CONFIG = "MultiNPUParallelConfig"
NPU_COUNTS = (1, 2, 4, 8)  # the node's npu_count choices (8: an 8-card service or a group of hosts)
AUTO = "auto"              # npu_count auto: the server's own device count (issue 46)
WEIGHTS_CHOICES = ("auto", "replicated", "sharded")  # the node's weights choices (a missing value is auto)
GEOMETRY_NODES = ("EmptyMiniMaxH3LatentAV", "MiniMaxH3ImageToVideo", "MiniMaxH3ReferenceToVideo")
GUIDE = "MiniMaxH3AddGuide"  # upstream since 0.33.0: anchors an image, a clip and/or audio at frame_idx
H3_NODES = frozenset({*GEOMETRY_NODES, "MiniMaxH3SigmaShift", CONFIG})
SAMPLING_NODES = frozenset({"KSampler", "KSamplerAdvanced", "SamplerCustom", "SamplerCustomAdvanced"})
MODEL_FLOW_TYPES = frozenset({"MODEL", "GUIDER", "*", "COMFY_MATCHTYPE_V3"})
# Nodes that add a WrappersMP.DIFFUSION_MODEL wrapper (the pin's comfy_extras: nodes_easycache.py EasyCache,
# nodes_hidream_o1.py). After MultiNPUParallelConfig such a wrapper would run in the server only, where no
# forward runs, so the node's own wrapper fails the prompt at sampling (npu_count 2 and up; at 1 the node passes
# the model through); placed before the node it is kept. LazyCache wraps PREDICT_NOISE (outside the DiT's
# forward) and works on either side (benchmarks/step_cache.py).
DIFFUSION_MODEL_WRAPPER_NODES = frozenset({"EasyCache", "HiDreamO1PatchSeamSmoothing"})
LORA_NODES = frozenset({"LoraLoader", "LoraLoaderModelOnly"})
BASE_LOADER_INPUTS = {"UNETLoader": "unet_name", "CheckpointLoaderSimple": "ckpt_name",
                      "UnetLoaderGGUF": "unet_name"}
SAMPLER_NAME_NODES = ("KSampler", "KSamplerAdvanced", "KSamplerSelect")
# Sampler nodes (comfy_extras/nodes_custom_sampler.py) that re-inject noise at every step
STOCHASTIC_SAMPLER_NODES = frozenset({
    "SamplerEulerAncestral", "SamplerEulerAncestralCFGPP", "SamplerDPMPP_2S_Ancestral", "SamplerDPMPP_SDE",
    "SamplerDPMPP_2M_SDE", "SamplerDPMPP_3M_SDE", "SamplerER_SDE", "SamplerSASolver", "SamplerSEEDS2"})
# KSAMPLER_NAMES (comfy/samplers.py) that are stochastic without "ancestral" or "sde" in the name
STOCHASTIC_SAMPLER_NAMES = frozenset({"ddpm", "lcm", "seeds_2", "seeds_3", "sa_solver", "sa_solver_pece"})
# (node type, input) pairs whose VAE decodes or encodes H3 audio
AUDIO_VAE_INPUTS = (("VAEDecodeAudio", "vae"), ("VAEDecodeAudioTiled", "vae"), ("VAEEncodeAudio", "vae"),
                    ("MiniMaxH3ReferenceToVideo", "audio_vae"), (CONFIG, "audio_vae"))
LOW_PRECISION_TAGS = ("fp16", "bf16", "fp8", "int8", "nvfp4", "fp4", "int4", "gguf", "q8_", "q4_", "q5_", "q6_")
QUANTIZED_TAGS = ("int8", "fp8", "nvfp4", "fp4", "int4", "gguf", "q8_", "q4_", "q5_", "q6_", "awq")
# Published full (not pruned) bases in Comfy-Org/MiniMax-H3 diffusion_models/
FULL_BASES = frozenset({"minimax_h3_fl2va_bf16.safetensors", "minimax_h3_fl2va_int8_convrot.safetensors",
                        "minimax_h3_ref2va_bf16.safetensors", "minimax_h3_ref2va_int8_convrot.safetensors"})

# input types the frontend draws as widgets even when a saved file lists them without a "widget" key
UI_WIDGET_TYPES = frozenset({*catalog_mod.WIDGET_TYPES, *catalog_mod.OPAQUE_TYPES, "IMAGEUPLOAD", "CUSTOM"})

MIN_SIDE, MAX_SIDE = 32, 16384       # nodes.MAX_RESOLUTION at the pin
MIN_LENGTH, MAX_LENGTH = 5, 3600
MAX_PIXELS = 768 * 1344
FPS = 24


class Context:
    """What the checks know besides the graph: exposed devices and, with --comfy-home, the install."""

    def __init__(self, catalog, devices: list[int] | None = None, device_source: str | None = None,
                 install=None, service_args: list[str] | None = None, device_memory: float | None = None,
                 memory_source: str | None = None):
        self.catalog = catalog
        self.devices = devices
        self.device_source = device_source
        self.install = install            # models.Install or None
        self.service_args = service_args or []
        self.device_memory = device_memory  # GB of one card, or None when unknown
        self.memory_source = memory_source


def run_checks(graph: Graph, ctx: Context) -> list:
    index = _Index(graph, ctx)
    for check in (check_structure, check_parallel_config, check_geometry, check_guides, check_turbo_lora,
                  check_samplers, check_audio_vae, check_single_device_load, check_tier_fits, check_install):
        check(graph, ctx, index)
    return graph.findings


class _Index:
    """Consumers of each node's outputs, and whether the graph is an H3 graph at all."""

    def __init__(self, graph: Graph, ctx: Context):
        self.consumers: dict[str, list] = {nid: [] for nid in graph.nodes}
        for node in graph.nodes.values():
            for name, v in node.inputs.items():
                if isinstance(v, Link) and v.node in self.consumers:
                    self.consumers[v.node].append((node, name, v.slot))
        self.is_h3 = any(_is_h3_node(graph, n) for n in graph.nodes.values())
        self.ctx = ctx
        self.live = self._live(graph, ctx)

    def _live(self, graph: Graph, ctx: Context) -> set:
        """Output nodes and everything they depend on: what the server validates and runs.

        A node type the catalogue does not know counts as an output when nothing consumes it (a custom
        save node, most likely), so its inputs are still checked.
        """
        stack = []
        for node in graph.nodes.values():
            nd = ctx.catalog.get(node.class_type)
            if (nd is not None and nd.output_node) or (nd is None and not self.consumers[node.id]):
                stack.append(node.id)
        live = set(stack)
        while stack:
            node = graph.nodes[stack.pop()]
            for v in node.inputs.values():
                if isinstance(v, Link) and v.node in graph.nodes and v.node not in live:
                    live.add(v.node)
                    stack.append(v.node)
        return live


def _is_h3_node(graph: Graph, node: Node) -> bool:
    # not CLIPLoader type "minimax": MiniMax Music 3 uses that text encoder type too
    if node.class_type in H3_NODES:
        return True
    name = value(graph, node, "unet_name")
    return isinstance(name, str) and bool(re.search(r"minimax[_-]?h3|fasth3", name, re.I))


def _add(graph: Graph, code: str, node: Node | None, message: str):
    graph.add_finding(code, message, node)


def _show(v) -> str:
    text = repr(v) if isinstance(v, str) else str(v)
    return text if len(text) <= 40 else text[:37] + "..."


# ------------------------------------------------------------------------------------ graph structure

# Node types whose widget values the checks read: a value list that does not fit their definition is noted
VALUE_NODES = frozenset({*GEOMETRY_NODES, CONFIG, *LORA_NODES, *BASE_LOADER_INPUTS, *SAMPLER_NAME_NODES,
                         *STOCHASTIC_SAMPLER_NODES, "VAELoader", "ModelAttentionBackend", *resolve.PRIMITIVES,
                         *resolve.SWITCHES, "ComfyMathExpression", "CLIPLoader"})


def check_structure(graph: Graph, ctx: Context, index: _Index):
    for node in graph.nodes.values():
        if not node.widgets_mapped and node.class_type in VALUE_NODES:
            nd = ctx.catalog.get(node.class_type)
            _add(graph, "H3406", node, f"its widget values do not fit {node.class_type} as this ComfyUI defines it "
                 f"({len(nd.widget_slots()) if nd else '?'} widget slots): it was saved by another version, so "
                 "its values were not checked; re-save the workflow from this ComfyUI")
        if node.id in index.live:  # a dangling branch is never validated or run by the server
            _check_required_inputs(graph, ctx, node)
    _check_cycles(graph)


def _check_required_inputs(graph: Graph, ctx: Context, node: Node):
    nd = ctx.catalog.get(node.class_type)
    if nd is None:
        # A custom node this ComfyUI's definitions do not describe: which inputs it requires is unknown
        # (older frontends did not mark optional inputs), so it is checked only when a running service's
        # /object_info supplies its definition.
        return
    missing = []
    if node.ui_inputs is not None:
        listed = set()
        for name, ui_type, optional, is_widget, state, detail in node.ui_inputs:
            listed.add(name)
            if state in ("linked", "value", "broken"):
                continue
            if is_widget or str(ui_type).upper() in UI_WIDGET_TYPES:
                continue  # a widget keeps its own value when nothing is linked
            spec = nd.input(name)
            # an input this ComfyUI does not define was saved by another version: not judged
            required = spec is not None and spec[2] and catalog_mod.is_socket(spec)
            if required:
                missing.append((name, state, detail))
        # Newer frontends drop unlinked widget slots from the saved list, and draw some types no node
        # produces (bounding boxes, colour palettes) as widgets: only a type some node outputs is a socket
        # that must have been listed.
        for name in nd.socket_inputs(required_only=True):
            kind = nd.input(name)[1]
            if name not in listed and name not in node.inputs and ctx.catalog.is_produced(kind):
                missing.append((name, "unlinked", ""))
    else:
        for spec in nd.inputs:
            name, kind, required, _opts = spec
            if required and kind not in catalog_mod.GROUP_TYPES and name not in node.inputs \
                    and (catalog_mod.is_socket(spec) or kind in catalog_mod.WIDGET_TYPES):
                missing.append((name, "absent", ""))
    for name, state, detail in missing:
        if state == "muted":
            why = f"its source is muted ({detail}): unmute that node or connect another source"
        elif state == "bypassed":
            why = f"{detail}: connect a source of that type or un-bypass the node"
        elif state == "absent":
            why = "it is missing from the prompt: add it (export the prompt again from ComfyUI)"
        else:
            why = "connect a source to it"
        _add(graph, "H3402", node, f"required input {name!r} of {node.class_type} is not connected; {why}")


def _check_cycles(graph: Graph):
    """One finding per strongly connected component with a cycle (iterative Tarjan)."""
    succ = {nid: [] for nid in graph.nodes}
    for node in graph.nodes.values():
        for v in node.inputs.values():
            if isinstance(v, Link) and v.node in succ:
                succ[v.node].append(node.id)
    index_of, low, on_stack, stack, counter = {}, {}, set(), [], [0]
    for root in graph.nodes:
        if root in index_of:
            continue
        work = [(root, 0)]
        while work:
            nid, i = work.pop()
            if i == 0:
                index_of[nid] = low[nid] = counter[0]
                counter[0] += 1
                stack.append(nid)
                on_stack.add(nid)
            children = succ[nid]
            if i < len(children):
                work.append((nid, i + 1))
                child = children[i]
                if child not in index_of:
                    work.append((child, 0))
                elif child in on_stack:
                    low[nid] = min(low[nid], index_of[child])
                continue
            if low[nid] == index_of[nid]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == nid:
                        break
                if len(comp) > 1 or nid in succ[nid]:
                    comp.sort(key=_natural)
                    first = graph.nodes[comp[0]]
                    _add(graph, "H3403", first, f"nodes {', '.join(comp)} form a cycle; ComfyUI cannot order "
                         "them: remove one of the links that closes the loop")
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[nid])


def _natural(eid: str):
    return [int(p) if p.isdigit() else 0 for p in eid.split(":")], eid


# ------------------------------------------------------------------------- MultiNPUParallelConfig

def check_parallel_config(graph: Graph, ctx: Context, index: _Index):
    configs = sorted((n for n in graph.nodes.values() if n.class_type == CONFIG), key=lambda n: _natural(n.id))
    devices = ctx.devices
    if not configs:
        if index.is_h3 and devices is not None and len(devices) > 1:
            _add(graph, "H3107", None, f"no MultiNPUParallelConfig: H3 will run on one of the {len(devices)} "
                 f"exposed devices ({ctx.device_source}); add one with npu_count {len(devices)} on the model "
                 "path to use them all")
        return
    if len(configs) > 1:
        for extra in configs[1:]:
            _add(graph, "H3103", extra, f"{len(configs)} active MultiNPUParallelConfig nodes "
                 f"({', '.join(c.id for c in configs)}); the runtime needs exactly one: delete or bypass all "
                 "but the one on the model path")
    if devices is None:
        _add(graph, "H3105", configs[0], "no device list (no --devices, no ASCEND_RT_VISIBLE_DEVICES, no "
             "running service for --comfy-home): npu_count was not compared with the devices; pass "
             "--devices to check it")
    for cfg in configs:
        npu = _check_npu_count(graph, cfg, ctx)
        weights = value(graph, cfg, "weights")
        if weights is not UNKNOWN and weights is not None and weights not in WEIGHTS_CHOICES:
            _add(graph, "H3110", cfg, f"weights is {_show(weights)}; MultiNPUParallelConfig takes "
                 f"{', '.join(WEIGHTS_CHOICES)}: set it to auto (sharded where a replica would not fit a card)")
        for wrapper in _model_path_after(graph, index, cfg, 0) if npu != 1 else ():  # 1: the node passes through
            if wrapper.class_type in DIFFUSION_MODEL_WRAPPER_NODES and wrapper.id in index.live:
                _add(graph, "H3111", wrapper, f"{wrapper.class_type} takes the MODEL of MultiNPUParallelConfig "
                     f"{cfg.id}: the diffusion-model wrapper it adds would run in the server only, and the prompt "
                     f"fails at sampling ('wrappers added after MultiNPUParallelConfig'); move {wrapper.class_type} "
                     f"before MultiNPUParallelConfig (between the model loader or LoRA and the node's model input)")
        if not _reaches_sampler(graph, index, cfg, 0):
            _add(graph, "H3104", cfg, "the MODEL output of MultiNPUParallelConfig reaches no sampler "
                 "(KSampler, SamplerCustom, or a guider into SamplerCustomAdvanced), so it configures nothing: "
                 "connect its MODEL output on the path to the sampler")


def _check_npu_count(graph: Graph, cfg: Node, ctx: Context):
    """The findings of one MultiNPUParallelConfig's npu_count; the count it runs with (auto: the exposed devices',
    None when unknown)."""
    raw = value(graph, cfg, "npu_count")
    devices = ctx.devices
    npu = _npu_count(raw, devices)
    if raw is UNKNOWN:
        _add(graph, "H3106", cfg, "npu_count comes from a node whose value is only known at run time: "
             "it was not checked; set it on the node to have it checked")
    elif raw == AUTO:
        if devices is None:
            _add(graph, "H3112", cfg, "npu_count is auto: the prompt runs on every device of the server that takes "
                 "it; pass --devices, or --comfy-home (and --port) of that server, to see how many")
        elif npu not in NPU_COUNTS:
            _add(graph, "H3101", cfg, f"npu_count is auto, which is {npu} on {ctx.device_source}; H3 runs on 1, 2, 4 "
                 f"or 8 NPUs: expose 1, 2, 4 or 8 devices, or set npu_count to {_fit(npu)}")
        else:
            _add(graph, "H3112", cfg, f"npu_count is auto: {npu} on {ctx.device_source}")
    elif npu not in NPU_COUNTS:
        _add(graph, "H3101", cfg, f"npu_count is {_show(raw)}; H3 runs on 1, 2, 4 or 8 NPUs: "
             f"set it to {_fit(len(devices)) if devices else 4}, or auto (the server's own count)")
    elif npu == 8 and devices is None:
        # 8 ranks exist only on an 8-card server or a group of hosts: never assume them
        _add(graph, "H3108", cfg, "npu_count is 8, which needs 8 exposed devices (one 8-card service, or a "
             "process group of several hosts), and no device list says so: pass --devices with 8 ids, or "
             "--comfy-home of the running 8-rank service")
    elif devices is not None and npu != len(devices):
        fix = (f"set npu_count to {len(devices)} (or auto)" if len(devices) in NPU_COUNTS
               else "expose 1, 2, 4 or 8 devices")
        _add(graph, "H3102", cfg, f"npu_count is {npu} but {len(devices)} device(s) are exposed "
             f"({ctx.device_source}): {fix}, or expose {npu} device(s) (h3kit start --devices ...)")
    return npu


def _npu_count(raw, devices):
    """The count npu_count `raw` runs with: auto is the exposed devices' (None when they are unknown)."""
    if raw == AUTO:
        return len(devices) if devices is not None else None
    return _count(raw)


def _count(raw):
    if isinstance(raw, str) and raw.strip().isdigit():
        return int(raw.strip())
    return as_int(raw)


def _fit(n: int) -> int:
    return max((c for c in NPU_COUNTS if c <= n), default=1)


def _is_sampler(node: Node, ctx: Context) -> bool:
    if node.class_type in SAMPLING_NODES:
        return True
    # a custom sampler the catalogue does not know: trust its name rather than report a false error
    return node.class_type not in ctx.catalog and "sampler" in node.class_type.lower() \
        and node.class_type != "KSamplerSelect"


def _reaches_sampler(graph: Graph, index: _Index, start: Node, slot: int) -> bool:
    """Follow MODEL (and GUIDER) outputs downstream, through switches that can pick them."""
    frontier = [(start, slot)]
    seen = set()
    while frontier:
        node, out_slot = frontier.pop()
        for consumer, in_name, src_slot in index.consumers.get(node.id, ()):
            if src_slot != out_slot:
                continue
            if consumer.class_type in resolve.SWITCHES and in_name in ("on_true", "on_false"):
                if resolve.switch_branch(graph, consumer) not in (None, in_name):
                    continue
            if _is_sampler(consumer, index.ctx):
                return True
            for i, kind in enumerate(_output_types(consumer, index)):
                if (kind is None or kind in MODEL_FLOW_TYPES) and (consumer.id, i) not in seen:
                    seen.add((consumer.id, i))
                    frontier.append((consumer, i))
    return False


def _model_path_after(graph: Graph, index: _Index, start: Node, slot: int) -> list:
    """The nodes a MODEL (or GUIDER) output flows through downstream, in the order met, samplers excluded."""
    frontier, seen, out = [(start, slot)], set(), []
    while frontier:
        node, out_slot = frontier.pop()
        for consumer, _in_name, src_slot in index.consumers.get(node.id, ()):
            if src_slot != out_slot or _is_sampler(consumer, index.ctx):
                continue
            if consumer not in out:
                out.append(consumer)
            for i, kind in enumerate(_output_types(consumer, index)):
                if (kind is None or kind in MODEL_FLOW_TYPES) and (consumer.id, i) not in seen:
                    seen.add((consumer.id, i))
                    frontier.append((consumer, i))
    return out


def _output_types(node: Node, index: _Index) -> list:
    if node.output_types is not None:
        return node.output_types
    # an API-format node the catalogue does not know: follow whichever outputs are used
    used = {slot for _c, _n, slot in index.consumers.get(node.id, ())}
    return [None] * (max(used) + 1 if used else 0)


# ----------------------------------------------------------------------------------------- geometry

def align_frame_count(n: int) -> int:
    """comfy_extras/nodes_minimax_h3.py align_frame_count: the next 17k+5 at or above n."""
    return n + (5 - n % 17) % 17


def adapt_canvas(width: int, height: int) -> tuple[int, int]:
    """comfy_extras/nodes_minimax_h3.py adapt_canvas: 768 short edge, 768*1344 cap, multiples of 32."""
    ratio = width / height
    nom_w, nom_h = (768 * ratio, 768) if ratio >= 1.0 else (768, 768 / ratio)
    if nom_w * nom_h > MAX_PIXELS:
        s = math.sqrt(MAX_PIXELS / (nom_w * nom_h))
        nom_w, nom_h = nom_w * s, nom_h * s
    return max(32, round(nom_w / 32) * 32), max(32, round(nom_h / 32) * 32)


def check_geometry(graph: Graph, ctx: Context, index: _Index):
    for node in graph.nodes.values():
        if node.class_type not in GEOMETRY_NODES or node.id not in index.live:
            continue
        sides = {}
        for name in ("width", "height"):
            raw = value(graph, node, name)
            if raw is UNKNOWN:
                continue
            v = as_int(raw)
            if v is None or not MIN_SIDE <= v <= MAX_SIDE:
                _add(graph, "H3204", node, f"{name} is {_show(raw)}; it must be an integer from {MIN_SIDE} to "
                     f"{MAX_SIDE}: use a multiple of 32 such as 1344 or 768")
                continue
            sides[name] = v
            if v % 32:
                low, high = v // 32 * 32, v // 32 * 32 + 32
                choices = f"{low} or {high}" if low >= MIN_SIDE else str(high)
                _add(graph, "H3201", node, f"{name} {v} is not a multiple of 32, which H3's patchify needs: "
                     f"set it to {choices}")
        if len(sides) == 2 and sides["width"] * sides["height"] > MAX_PIXELS:
            w, h = sides["width"], sides["height"]
            fw, fh = adapt_canvas(w, h)
            _add(graph, "H3202", node, f"{w}x{h} is {w * h} pixels, above H3's 768x1344 cap ({MAX_PIXELS}): "
                 f"use {fw}x{fh} for this aspect ratio (1344x768 is the official 768p canvas)")
        raw = value(graph, node, "length")
        if raw is UNKNOWN:
            continue
        length = as_int(raw)
        if length is None or not MIN_LENGTH <= length <= MAX_LENGTH:
            _add(graph, "H3204", node, f"length is {_show(raw)}; it must be an integer from {MIN_LENGTH} to "
                 f"{MAX_LENGTH} frames: use 17k+5, e.g. 124 (5 s at 24 fps)")
            continue
        if length % 17 != 5:
            snapped = align_frame_count(max(MIN_LENGTH, length))
            lower = snapped - 17 if snapped - 17 >= MIN_LENGTH else None
            alt = f" (or {lower})" if lower else ""
            _add(graph, "H3203", node, f"length {length} is off H3's 17k+5 frame grid; the node snaps it up to "
                 f"{snapped} ({snapped / FPS:.1f} s at {FPS} fps): set {snapped}{alt} to get what you ask for")


def _guide_video(graph: Graph, node: Node):
    """(the geometry node whose latent a MiniMaxH3AddGuide anchors into, its frame count), or (None, None)."""
    link = resolve.link_source(graph, node.inputs.get("latent"))
    src = graph.nodes.get(link.node) if link is not None else None
    if src is None or src.class_type not in GEOMETRY_NODES:
        return None, None
    length = as_int(value(graph, src, "length"))
    if length is None or not MIN_LENGTH <= length <= MAX_LENGTH:
        return src, None
    return src, align_frame_count(length)


def _guide_index(graph: Graph, node: Node, frames: int | None):
    """frame_idx resolved as the node does (negative: from the end), or None when unknown."""
    idx = as_int(value(graph, node, "frame_idx"))
    if idx is None or frames is None:
        return None
    return idx if idx >= 0 else frames + idx


def check_guides(graph: Graph, ctx: Context, index: _Index):
    """MiniMaxH3AddGuide raises at run time, after the models loaded, on what is visible here: nothing to anchor,
    an image or audio without its VAE, a frame outside the video."""
    for node in graph.nodes.values():
        if node.class_type != GUIDE or node.id not in index.live:
            continue
        has = {k: isinstance(node.inputs.get(k), Link) for k in ("image", "audio", "vae", "audio_vae")}
        if not has["image"] and not has["audio"]:
            _add(graph, "H3205", node, "MiniMaxH3AddGuide has neither an image nor an audio connected; the node "
                 "fails with 'needs an image or an audio to anchor': connect one, or bypass the node")
        for what, vae in (("image", "vae"), ("audio", "audio_vae")):
            if has[what] and not has[vae]:
                _add(graph, "H3206", node, f"MiniMaxH3AddGuide has an {what} but no {vae}: the node needs the "
                     f"{'video' if vae == 'vae' else 'audio'} VAE to encode it: connect {vae} (from the VAE loader "
                     "or MultiNPUParallelConfig's output)")
        _, frames = _guide_video(graph, node)
        resolved = _guide_index(graph, node, frames)
        if resolved is not None and not 0 <= resolved < frames:
            raw = value(graph, node, "frame_idx")
            _add(graph, "H3207", node, f"frame_idx {raw} is outside the video's {frames} frames (it counts from "
                 f"0, negative from the end): set it from {-frames} to {frames - 1}")


def guides_of(graph: Graph, geometry: Node, index: _Index, frames: int) -> tuple:
    """What the live MiniMaxH3AddGuide nodes on `geometry`'s latent add to the sequence, as costmodel.packed_sequence's
    guides: (frames, audio_seconds) each. An image counts as one frame (a clip's length is not known here); audio
    as the rest of the track from its frame (what the node keeps at most)."""
    out = []
    for node in graph.nodes.values():
        if node.class_type != GUIDE or node.id not in index.live or _guide_video(graph, node)[0] is not geometry:
            continue
        start = _guide_index(graph, node, frames) or 0
        audio = (frames - min(max(start, 0), frames)) / FPS if isinstance(node.inputs.get("audio"), Link) else 0
        out.append((1 if isinstance(node.inputs.get("image"), Link) else 0, audio))
    return tuple(g for g in out if g[0] or g[1])


# ------------------------------------------------------------------------------------- model traps

def check_turbo_lora(graph: Graph, ctx: Context, index: _Index):
    for node in graph.nodes.values():
        if node.class_type not in LORA_NODES:
            continue
        name = value(graph, node, "lora_name")
        if not isinstance(name, str) or "turbo" not in name.lower():
            continue
        strength = value(graph, node, "strength_model")
        if isinstance(strength, (int, float)) and not isinstance(strength, bool) and strength == 0:
            continue
        if not _reaches_sampler(graph, index, node, 0):
            continue  # its branch is switched off or leads nowhere: the LoRA never runs
        for base_node, base in _base_models(graph, node.inputs.get("model")):
            if "pruned" not in base.lower():
                continue
            full = base.replace("_pruned", "")
            hint = f" such as {full}" if full in FULL_BASES else ""
            _add(graph, "H3301", node, f"Turbo LoRA {name!r} is applied to the pruned base {base!r} (node "
                 f"{base_node.id}); a pruned model has none of the AdaLN adapters the LoRA binds, so it runs "
                 f"untuned: load the full model{hint}, or switch the LoRA off")


def _base_models(graph: Graph, start, _seen=None):
    """(loader node, file name) of every base model that can reach `start` (a Link), honouring switches."""
    seen = _seen if _seen is not None else set()
    out = []
    stack = [start]
    while stack:
        link = stack.pop()
        if not isinstance(link, Link) or link.node in seen:
            continue
        seen.add(link.node)
        src = graph.nodes.get(link.node)
        if src is None:
            continue
        if src.class_type in BASE_LOADER_INPUTS:
            name = value(graph, src, BASE_LOADER_INPUTS[src.class_type])
            if isinstance(name, str):
                out.append((src, name))
            continue
        if src.class_type in resolve.SWITCHES:
            branch = resolve.switch_branch(graph, src)
            for b in ([branch] if branch else ["on_false", "on_true"]):
                stack.append(src.inputs.get(b))
            continue
        for name, v in src.inputs.items():
            if isinstance(v, Link):
                feeder = graph.nodes.get(v.node)
                kinds = feeder.output_types if feeder is not None else None
                kind = kinds[v.slot] if kinds and 0 <= v.slot < len(kinds) else None
                if kind in (None, "MODEL", "*", "COMFY_MATCHTYPE_V3"):
                    stack.append(v)
    return out


def _is_stochastic(name: str) -> bool:
    low = name.lower()
    return "ancestral" in low or "sde" in low or low in STOCHASTIC_SAMPLER_NAMES


def check_samplers(graph: Graph, ctx: Context, index: _Index):
    if not index.is_h3:
        return
    advice = ("which injects fresh noise at every step and degrades H3's audio: use a deterministic sampler "
              "such as res_multistep (the upstream H3 templates' choice) or euler")
    for node in graph.nodes.values():
        if node.id not in index.live:
            continue
        if node.class_type in SAMPLER_NAME_NODES:
            name = value(graph, node, "sampler_name")
            if isinstance(name, str) and _is_stochastic(name):
                _add(graph, "H3302", node, f"sampler {name!r} is ancestral/SDE, {advice}")
        elif node.class_type in STOCHASTIC_SAMPLER_NODES:
            eta = value(graph, node, "eta")
            if isinstance(eta, (int, float)) and not isinstance(eta, bool) and eta == 0:
                continue  # eta 0 turns the ancestral step off
            _add(graph, "H3302", node, f"{node.class_type} is an ancestral/SDE sampler, {advice}")
        elif node.class_type == "ModelAttentionBackend":
            backend = value(graph, node, "attention")
            if isinstance(backend, str) and "sage" in backend.lower():
                _add(graph, "H3305", node, f"attention backend {backend!r} is SageAttention, which degrades H3's "
                     "audio and video: pick the default (pytorch) or comfy kitchen attention")
    if "--use-sage-attention" in ctx.service_args:
        _add(graph, "H3305", None, "the running service was started with --use-sage-attention, which degrades "
             "H3's audio and video: restart it without that flag")


def check_audio_vae(graph: Graph, ctx: Context, index: _Index):
    if not index.is_h3:
        return
    reported = set()
    for node in graph.nodes.values():
        if node.id not in index.live:
            continue
        for kind, input_name in AUDIO_VAE_INPUTS:
            if node.class_type != kind:
                continue
            for loader, name in _vae_sources(graph, node.inputs.get(input_name)):
                low = name.lower()
                if loader.id in reported or "fp32" in low or not any(t in low for t in LOW_PRECISION_TAGS):
                    continue
                reported.add(loader.id)
                _add(graph, "H3303", loader, f"the audio VAE {name!r} (used by {node.class_type} {node.id}) is "
                     "not fp32; H3's audio VAE must stay fp32: load minimax_h3_audio_vae_fp32.safetensors")


def _vae_sources(graph: Graph, link, depth: int = 0):
    """VAELoader nodes feeding `link`, through switches and MultiNPUParallelConfig's VAE pass-through."""
    link = resolve.link_source(graph, link)
    if link is None or depth > 16:
        return []
    src = graph.nodes.get(link.node)
    if src is None:
        return []
    if src.class_type == "VAELoader":
        name = value(graph, src, "vae_name")
        return [(src, name)] if isinstance(name, str) else []
    if src.class_type == CONFIG and link.slot in (2, 3):
        return _vae_sources(graph, src.inputs.get("vae" if link.slot == 2 else "audio_vae"), depth + 1)
    return []


def check_single_device_load(graph: Graph, ctx: Context, index: _Index):
    if not index.is_h3:
        return
    configs = [n for n in graph.nodes.values() if n.class_type == CONFIG]
    if configs:
        count = _npu_count(value(graph, configs[0], "npu_count"), ctx.devices)
        if count != 1:
            return
    bf16 = None
    for node in graph.nodes.values():
        if node.class_type != "UNETLoader":
            continue
        name = value(graph, node, "unet_name")
        dtype = value(graph, node, "weight_dtype")
        if isinstance(name, str) and ("bf16" in name.lower() or "fp16" in name.lower()) \
                and not any(t in name.lower() for t in QUANTIZED_TAGS) and dtype in ("default", UNKNOWN):
            if _reaches_sampler(graph, index, node, 0):
                bf16 = (node, name)
                break
    if bf16 is None:
        return
    for node in graph.nodes.values():
        if node.class_type not in GEOMETRY_NODES or node.id not in index.live:
            continue
        w, h, length = (as_int(value(graph, node, k)) for k in ("width", "height", "length"))
        if None in (w, h, length) or min(w, h) < 768 or align_frame_count(max(MIN_LENGTH, length)) < 15 * FPS:
            continue
        frames = align_frame_count(length)
        _add(graph, "H3304", node, f"one device with BF16 weights ({bf16[1]!r}) at {w}x{h} and {frames} frames "
             f"({frames / FPS:.0f} s) is not a supported setting (it does not fit): use the INT8 model "
             "(minimax_h3_*_int8_convrot) at 480p, or 2 or 4 NPUs with MultiNPUParallelConfig")


# ------------------------------------------------------------------------------ the tier and the cards

def _dit_weights(graph: Graph, index: _Index):
    """("int8" or "bf16", the UNETLoader file) of the diffusion model that reaches a sampler; None when unknown."""
    for node in graph.nodes.values():
        if node.class_type != "UNETLoader" or node.id not in index.live:
            continue
        name = value(graph, node, "unet_name")
        if isinstance(name, str) and _reaches_sampler(graph, index, node, 0):
            low = name.lower()
            if "int8" in low:
                return "int8", name
            if "bf16" in low or "fp16" in low or not any(t in low for t in QUANTIZED_TAGS):
                return "bf16", name
    return None


def check_tier_fits(graph: Graph, ctx: Context, index: _Index):
    """With the card memory known: the workflow's tier must fit one card, weights and activations (else ComfyUI
    streams weights from the host every step). The fix names the first tier that fits."""
    if not index.is_h3 or ctx.device_memory is None:
        return
    configs = sorted((n for n in graph.nodes.values() if n.class_type == CONFIG), key=lambda n: _natural(n.id))
    cfg = configs[0] if configs else None
    npu = _npu_count(value(graph, cfg, "npu_count"), ctx.devices) if cfg is not None else 1
    mode = value(graph, cfg, "weights") if cfg is not None else "replicated"
    if cfg is not None and mode in (None, UNKNOWN):
        mode = "auto"  # a workflow saved before the input existed, or one whose value is set at run time
    found = _dit_weights(graph, index)
    if npu not in NPU_COUNTS or mode not in WEIGHTS_CHOICES or found is None:
        return
    weights, file = found
    for node in graph.nodes.values():
        if node.class_type not in GEOMETRY_NODES or node.id not in index.live:
            continue
        w, h, length = (as_int(value(graph, node, k)) for k in ("width", "height", "length"))
        if None in (w, h, length) or w % 32 or h % 32 or not MIN_LENGTH <= length <= MAX_LENGTH:
            continue  # unknown, or already reported by the geometry checks
        guides = guides_of(graph, node, index, align_frame_count(length))
        need = {m: costmodel.plan(w, h, length, npu, weights=weights, sharding=m, guides=guides)
                ["memory_per_device"]["total"] for m in costmodel.SHARDINGS}
        card = ctx.device_memory * 1e9
        # auto: the node shards when a replica does not fit (one device has nothing to shard)
        chosen = ("sharded" if need["replicated"] > card and npu > 1 else "replicated") if mode == "auto" else mode
        chosen = chosen if npu > 1 else "replicated"
        if need[chosen] <= card:
            continue
        frames = align_frame_count(length)
        fix = _tier_fix(w, h, frames, npu, weights, chosen, mode, card, guides)
        _add(graph, "H3109", cfg or node, f"{npu} device(s) with {weights.upper()} weights ({file!r}), {chosen}"
             f"{' (auto)' if mode == 'auto' else ''}, at {w}x{h} and {frames} frames need "
             f"{need[chosen] / 1e9:.1f} GB per device and the cards have {ctx.device_memory:g} GB "
             f"({ctx.memory_source}): ComfyUI would stream weights from the host every step. Fix: {fix}")


def _tier_fix(w: int, h: int, frames: int, npu: int, weights: str, chosen: str, mode: str, card: float,
              guides: tuple = ()) -> str:
    """The cheapest change that fits, in this order: shard the weights, INT8 weights (replicated, then sharded),
    more devices; else a smaller or shorter video."""
    options = [(npu, weights, "sharded", "set weights to sharded (or auto) on MultiNPUParallelConfig")] \
        if npu > 1 and chosen != "sharded" else []
    if weights != "int8":
        options += [(npu, "int8", s, f"use the INT8 DiT (minimax_h3_*_int8_convrot){' with weights sharded' if s == 'sharded' else ''}")
                    for s in (("replicated", "sharded") if npu > 1 else ("replicated",))]
    options += [(n, wt, "sharded", f"run on {n} devices with weights sharded{' and the INT8 DiT' if wt != weights else ''}"
                 f" (h3kit start --devices {','.join(map(str, range(n)))}, npu_count {n})")
                for n in NPU_COUNTS if n > npu for wt in dict.fromkeys((weights, "int8"))]
    for n, wt, s, text in options:
        need = costmodel.plan(w, h, frames, n, weights=wt, sharding=s, guides=guides)["memory_per_device"]["total"]
        if need <= card:
            return f"{text} ({need / 1e9:.1f} GB per device; h3kit plan --device-memory shows every tier)"
    return "a smaller or shorter video (h3kit plan --tiers --device-memory shows what fits)"


# --------------------------------------------------------------------------------------- install

def check_install(graph: Graph, ctx: Context, index: _Index):
    if ctx.install is None:
        return
    ctx.install.check(graph, value, index.live)
