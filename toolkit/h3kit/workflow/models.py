"""--comfy-home checks: model files the loaders name, and node types the install provides.

Model folders follow folder_paths.py at the pin: models/<folder> per kind (diffusion_models also reads
models/unet, text_encoders also models/clip, controlnet also models/t2i_adapter), plus every path an
extra_model_paths.yaml adds (the upstream format of extra_model_paths.yaml.example: sections with an
optional base_path and is_default, and per kind one path or a block of paths, relative to base_path or to
the YAML file; "unet" and "clip" keys mean diffusion_models and text_encoders). The YAML files read are
<comfy-home>/extra_model_paths.yaml and any --extra-model-paths-config the running service was started with.

Node types come from the running service's /object_info when it answers (exact), else from a static scan
of the tree: the NODE_CLASS_MAPPINGS blocks and v3 `node_id="..."` schemas under nodes.py, comfy_extras/,
comfy_api_nodes/ and custom_nodes/ (a custom pack that builds its mappings in a loop is missed, which is
why this finding is a warning).
"""

from __future__ import annotations

import os
import re

from h3kit.errors import NotAComfyTree
from h3kit.workflow.catalog import VIRTUAL_NODES

FOLDERS = {
    "checkpoints": ["checkpoints"], "loras": ["loras"], "vae": ["vae"],
    "text_encoders": ["text_encoders", "clip"], "diffusion_models": ["unet", "diffusion_models"],
    "clip_vision": ["clip_vision"], "style_models": ["style_models"], "embeddings": ["embeddings"],
    "vae_approx": ["vae_approx"], "controlnet": ["controlnet", "t2i_adapter"], "gligen": ["gligen"],
    "upscale_models": ["upscale_models"], "latent_upscale_models": ["latent_upscale_models"],
    "hypernetworks": ["hypernetworks"], "model_patches": ["model_patches"], "audio_encoders": ["audio_encoders"],
    "configs": ["configs"], "frame_interpolation": ["frame_interpolation"], "detection": ["detection"],
    "geometry_estimation": ["geometry_estimation"],
}
LEGACY_KINDS = {"unet": "diffusion_models", "clip": "text_encoders"}

# loader class: [(input, model kind)] — nodes.py and comfy_extras at the pin
LOADER_INPUTS = {
    "CheckpointLoaderSimple": [("ckpt_name", "checkpoints")],
    "CheckpointLoader": [("config_name", "configs"), ("ckpt_name", "checkpoints")],
    "ImageOnlyCheckpointLoader": [("ckpt_name", "checkpoints")],
    "UNETLoader": [("unet_name", "diffusion_models")],
    "CLIPLoader": [("clip_name", "text_encoders")],
    "DualCLIPLoader": [("clip_name1", "text_encoders"), ("clip_name2", "text_encoders")],
    "TripleCLIPLoader": [(f"clip_name{i}", "text_encoders") for i in (1, 2, 3)],
    "QuadrupleCLIPLoader": [(f"clip_name{i}", "text_encoders") for i in (1, 2, 3, 4)],
    "VAELoader": [("vae_name", "vae")],
    "LoraLoader": [("lora_name", "loras")],
    "LoraLoaderModelOnly": [("lora_name", "loras")],
    "CLIPVisionLoader": [("clip_name", "clip_vision")],
    "ControlNetLoader": [("control_net_name", "controlnet")],
    "DiffControlNetLoader": [("control_net_name", "controlnet")],
    "StyleModelLoader": [("style_model_name", "style_models")],
    "UpscaleModelLoader": [("model_name", "upscale_models")],
    "LatentUpscaleModelLoader": [("model_name", "latent_upscale_models")],
    "GLIGENLoader": [("gligen_name", "gligen")],
    "HypernetworkLoader": [("hypernetwork_name", "hypernetworks")],
    "ModelPatchLoader": [("name", "model_patches")],
    "AudioEncoderLoader": [("audio_encoder_name", "audio_encoders")],
}
# VAELoader names that are not files in models/vae (nodes.py VAELoader.vae_list)
IMAGE_TAES = ("taesd", "taesdxl", "taesd3", "taef1", "taef2")
H3KIT_NODE_TYPES = frozenset({"MultiNPUParallelConfig"})

# v3 schemas (node_id="X") and the class attributes some modules key their mappings on (NodeId, NODE_ID)
_NODE_ID = re.compile(r"""(?:node_id|NodeId|NODE_ID)[ \t]*=[ \t]*["']([^"'\n]+)["']""")  # no \b: 4x slower
_MAPPING_BLOCK = re.compile(r"NODE_CLASS_MAPPINGS\s*(?::[^=\n]*)?=\s*\{(.*?)\n\s*\}", re.S)
_MAPPING_UPDATE = re.compile(r"NODE_CLASS_MAPPINGS\.update\(\s*\{(.*?)\}\s*\)", re.S)
_MAPPING_KEY = re.compile(r"""(?:^|[{,])\s*["']([^"'\n]+)["']\s*:""", re.M)
_MAPPING_ITEM = re.compile(r"""NODE_CLASS_MAPPINGS\[\s*["']([^"'\n]+)["']\s*\]\s*=""")
MAX_SCAN_FILES = 20000
MAX_SCAN_BYTES = 4 * 1024 * 1024


class Install:
    """A ComfyUI tree: where its models are and which node types it has."""

    def __init__(self, home: str, model_dirs: dict[str, list[str]], known_types: set[str] | None,
                 types_source: str, problems: list[str]):
        self.home = home
        self.model_dirs = model_dirs
        self.known_types = known_types
        self.types_source = types_source
        self.problems = problems

    def find_model(self, kind: str, name: str) -> str | None:
        rel = name.replace("\\", "/")
        if not rel or rel.startswith("/") or ".." in rel.split("/") or "\x00" in rel:
            return None
        for folder in self.model_dirs.get(kind, []):
            path = os.path.join(folder, *rel.split("/"))
            if os.path.isfile(path):
                return path
        return None

    def vae_exists(self, name: str) -> bool:
        if name == "pixel_space" or self.find_model("vae", name) or self.find_model("vae_approx", name):
            return True
        if name in IMAGE_TAES:
            files = set()
            for folder in self.model_dirs.get("vae_approx", []):
                try:
                    files.update(os.listdir(folder))
                except OSError:
                    continue
            return any(f.startswith(name + "_encoder.") for f in files) and \
                any(f.startswith(name + "_decoder.") for f in files)
        return False

    def check(self, graph, value, live: set) -> None:
        """Unknown node types anywhere (the server rejects the whole prompt); model files of live loaders."""
        for problem in self.problems:
            graph.add_finding("H3503", problem)
        self._check_types(graph)
        for node, input_name, kind, name in model_references(graph, value, live):
            if self.vae_exists(name) if kind == "vae" else self.find_model(kind, name):
                continue
            graph.add_finding("H3501", f"{node.class_type} {input_name} {name!r} is not in {self.folders(kind)}: "
                              f"{self.fetch_advice(graph, kind, name)}, or pick a file that is there", node)

    def fetch_advice(self, graph, kind: str, name: str) -> str:
        """How to get a missing file: `h3kit models fetch` with its source (the workflow's properties.models,
        else h3kit's manifest), or by hand into the folder when no source is known."""
        from h3kit.weights import sources

        found = sources.sources_for(kind, name, getattr(graph, "model_entries", None))
        by_hand = f"download it into models/{kind}/ (or a folder listed in extra_model_paths.yaml)"
        if not found:
            return f"no source is known for it: {by_hand}"
        where = getattr(graph, "file", None) or "WORKFLOW"
        return (f"fetch it with `h3kit models fetch {where} --comfy-home {self.home}` (source: "
                f"{sources.describe(found)}), or {by_hand}")

    def folders(self, kind: str) -> str:
        """The folders searched for `kind`, relative to the tree where they are inside it."""
        return ", ".join(self._show(d) for d in self.model_dirs.get(kind, [])) or "(no folder)"

    def _check_types(self, graph) -> None:
        if self.known_types is None:
            return
        first: dict[str, list] = {}
        for node in graph.nodes.values():
            kind = node.class_type
            if kind in self.known_types or kind in VIRTUAL_NODES or kind in H3KIT_NODE_TYPES:
                continue
            first.setdefault(kind, []).append(node)
        for kind, nodes in sorted(first.items()):
            graph.add_finding("H3502", f"node type {kind!r} ({len(nodes)} node(s)) is not known to the ComfyUI "
                              f"at {self.home} ({self.types_source}): install the custom node pack that provides "
                              "it or update ComfyUI, else the server rejects the prompt", nodes[0])

    def _show(self, path: str) -> str:
        try:
            rel = os.path.relpath(path, self.home)
        except ValueError:
            return path
        return path if rel.startswith("..") else rel + "/"


def model_references(graph, value, live=None):
    """(node, input name, model kind, file name) for every loader input that names a model file statically
    (only the nodes in `live` when given); `value` is h3kit.workflow.resolve.value."""
    for node in graph.nodes.values():
        if live is not None and node.id not in live:
            continue
        for input_name, kind in LOADER_INPUTS.get(node.class_type, ()):
            name = value(graph, node, input_name)
            if isinstance(name, str) and name:
                yield node, input_name, kind, name


def open_install(home: str, *, object_info: dict | None = None, service_args: list[str] | None = None) -> Install:
    if not os.path.isdir(home):
        raise NotAComfyTree(home, "not a folder")
    if not (os.path.isfile(os.path.join(home, "main.py")) or os.path.isdir(os.path.join(home, "models"))):
        raise NotAComfyTree(home, "no main.py, no models/")
    problems: list[str] = []
    args = service_args or []
    models_dir = _arg_value(args, "--models-directory") or os.path.join(
        _arg_value(args, "--base-directory") or home, "models")
    model_dirs = {kind: [os.path.join(models_dir, f) for f in folders] for kind, folders in FOLDERS.items()}
    configs = [os.path.join(home, "extra_model_paths.yaml")]
    configs += _arg_values(args, "--extra-model-paths-config")
    for config in configs:
        if os.path.isfile(config):
            _add_extra_paths(config, model_dirs, problems)
    if object_info is not None:
        known, source = set(object_info), "its running service's /object_info"
    elif os.path.isfile(os.path.join(home, "nodes.py")):
        known, source = scan_node_types(home, problems), "a static scan of its node sources"
    else:
        known, source = None, "none"
        problems.append(f"{home} has no nodes.py: node types were not checked; point --comfy-home at the "
                        "ComfyUI checkout, or start its service")
    return Install(os.path.abspath(home), model_dirs, known, source, problems)


def _arg_value(args: list[str], flag: str) -> str | None:
    values = _arg_values(args, flag)
    return values[-1] if values else None


def _arg_values(args: list[str], flag: str) -> list[str]:
    out = []
    for i, arg in enumerate(args):
        if arg == flag:
            for follow in args[i + 1:]:
                if follow.startswith("--"):
                    break
                out.append(follow)
        elif arg.startswith(flag + "="):
            out.append(arg.split("=", 1)[1])
    return out


def _add_extra_paths(config: str, model_dirs: dict, problems: list) -> None:
    """utils/extra_config.py load_extra_path_config at the pin, without touching folder_paths."""
    import yaml

    try:
        with open(config, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError, RecursionError, ValueError) as e:
        problems.append(f"{config} could not be read ({type(e).__name__}): model paths from it were not "
                        "checked; fix the YAML (see extra_model_paths.yaml.example)")
        return
    if data is None:
        return
    if not isinstance(data, dict):
        problems.append(f"{config} is not a mapping of sections: model paths from it were not checked")
        return
    yaml_dir = os.path.dirname(os.path.abspath(config))
    for section, conf in data.items():
        if conf is None:
            continue
        if not isinstance(conf, dict):
            problems.append(f"{config}: section {section!r} is not a mapping: its paths were not checked")
            continue
        conf = dict(conf)
        base = conf.pop("base_path", None)
        if isinstance(base, str):
            base = os.path.expandvars(os.path.expanduser(base))
            if not os.path.isabs(base):
                base = os.path.abspath(os.path.join(yaml_dir, base))
        else:
            base = None
        is_default = bool(conf.pop("is_default", False))
        for kind, paths in conf.items():
            if not isinstance(paths, str):
                continue
            kind = LEGACY_KINDS.get(str(kind), str(kind))
            for line in paths.split("\n"):
                if not line:
                    continue
                full = os.path.join(base, line) if base else (
                    line if os.path.isabs(line) else os.path.abspath(os.path.join(yaml_dir, line)))
                full = os.path.normpath(full)
                dirs = model_dirs.setdefault(kind, [])
                if full in dirs:
                    continue
                dirs.insert(0, full) if is_default else dirs.append(full)


def scan_node_types(home: str, problems: list | None = None) -> set[str]:
    """Node class names registered by the tree's sources (see the module docstring for the limits)."""
    names: set[str] = set()
    files = [os.path.join(home, "nodes.py")]
    for sub in ("comfy_extras", "comfy_api_nodes"):
        folder = os.path.join(home, sub)
        try:
            files += [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".py")]
        except OSError:
            continue
    custom = os.path.join(home, "custom_nodes")
    for root, dirs, fnames in os.walk(custom):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "node_modules")
                         and not d.endswith(".disabled"))
        if root == custom:
            fnames = [f for f in fnames if not f.endswith(".disabled")]
        files += [os.path.join(root, f) for f in sorted(fnames) if f.endswith(".py")]
        if len(files) > MAX_SCAN_FILES:
            if problems is not None:
                problems.append(f"{custom} has more than {MAX_SCAN_FILES} Python files: the node type scan "
                                "stopped early; start the service to check node types exactly")
            break
    for path in files:
        try:
            if os.path.getsize(path) > MAX_SCAN_BYTES:
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        if "node_id" in text or "NodeId" in text or "NODE_ID" in text:
            names.update(_NODE_ID.findall(text))
        if "NODE_CLASS_MAPPINGS" in text:
            for block in _MAPPING_BLOCK.findall(text) + _MAPPING_UPDATE.findall(text):
                names.update(_MAPPING_KEY.findall(block))
            names.update(_MAPPING_ITEM.findall(text))
    return names
