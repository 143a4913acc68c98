"""Builds the shipped workflows in workflows/ (maintainers: `python tests/support/check_workflow_build.py`).

The graphs follow the upstream H3 templates (comfyui-workflow-templates-json 0.1.123,
video_minimax_h3_t2v.json and video_minimax_h3_r2v.json): UNETLoader -> LoraLoaderModelOnly (Turbo) ->
BasicGuider/BasicScheduler -> SamplerCustomAdvanced (res_multistep, simple, 8 steps) -> VAEDecode +
VAEDecodeAudio -> CreateVideo -> SaveVideo, flattened out of the template subgraph and with h3kit's
MultiNPUParallelConfig (npu_count 4, weights auto) on the model path; CLIP and both VAEs pass through it too. Node
inputs and outputs come from the pinned ComfyUI's node definitions (h3kit/workflow/pin_nodes.json), so
the files have the widget shapes the pin's frontend expects. The UI files can be edited in ComfyUI and
saved back; this script is only the reproducible starting point.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "toolkit"))

from h3kit.workflow.catalog import load_catalog  # noqa: E402

FULL_FL2VA = "minimax_h3_fl2va_bf16.safetensors"
FULL_REF2VA = "minimax_h3_ref2va_bf16.safetensors"
TURBO_FL2V = "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors"
TURBO_REF2V = "minimax_h3_ref2v_turbo_8step_v1.0_768p_comfyui_bf16.safetensors"
TEXT_ENCODER = "qwen3vl_32b_minimax_h3_int8_convrot.safetensors"
VIDEO_VAE = "minimax_h3_video_vae_fp16.safetensors"
AUDIO_VAE = "minimax_h3_audio_vae_fp32.safetensors"

OUTPUT_NAMES = {"MiniMaxH3ImageToVideo": ["positive", "LATENT"], "MiniMaxH3ReferenceToVideo": ["positive", "LATENT"],
                "SamplerCustomAdvanced": ["output", "denoised_output"], "LoadImage": ["IMAGE", "MASK"],
                "MultiNPUParallelConfig": ["MODEL", "CLIP", "VAE", "audio_vae"]}


class Builder:
    def __init__(self, catalog, uid):
        self.catalog = catalog
        self.uid = uid
        self.nodes = []
        self.links = []

    def node(self, kind, widgets, pos, size=(320, 120), title=None, extra_inputs=()):
        nd = self.catalog.get(kind)
        assert nd is not None, kind
        slots = nd.widget_slots()
        assert len(widgets) == len(slots) or (not nd.widget_slots_complete and len(widgets) > len(slots)), \
            (kind, widgets, slots)
        nid = len(self.nodes) + 1
        inputs = [{"name": name, "type": t, "link": None, **({} if required else {"shape": 7})}
                  for name, t, required, _o in nd.inputs if name in nd.socket_inputs()]
        inputs += [dict(e) for e in extra_inputs]
        names = OUTPUT_NAMES.get(kind, nd.outputs)
        node = {"id": nid, "type": kind, "pos": list(pos), "size": list(size), "flags": {}, "order": nid - 1,
                "mode": 0, "inputs": inputs,
                "outputs": [{"name": n, "type": t, "links": []} for n, t in zip(names, nd.outputs)],
                "properties": {"Node name for S&R": kind},
                "widgets_values": list(widgets)}
        if title:
            node["title"] = title
        self.nodes.append(node)
        return nid

    def link(self, src, slot, dst, input_name):
        lid = len(self.links) + 1
        target = self.nodes[dst - 1]
        index = next(i for i, inp in enumerate(target["inputs"]) if inp["name"] == input_name)
        target["inputs"][index]["link"] = lid
        source = self.nodes[src - 1]["outputs"][slot]
        source["links"].append(lid)
        self.links.append([lid, src, slot, dst, index, source["type"]])

    def document(self):
        return {"id": self.uid, "revision": 0, "last_node_id": len(self.nodes), "last_link_id": len(self.links),
                "nodes": self.nodes, "links": self.links, "groups": [], "config": {},
                "extra": {"ds": {"scale": 0.6, "offset": [0, 0]},
                          "h3kit": "MultiNPUParallelConfig npu_count must equal the devices `h3kit start "
                                   "--devices` exposes: 1, 2, 4 or 8"},
                "version": 0.4}


def _common(b, unet, lora, cond_kind, cond_widgets, cond_extra=()):
    unet_id = b.node("UNETLoader", [unet, "default"], (0, 0), title="Load full base (not pruned)")
    lora_id = b.node("LoraLoaderModelOnly", [lora, 1.0], (0, 160), title="Turbo LoRA (8 steps)")
    clip_id = b.node("CLIPLoader", [TEXT_ENCODER, "minimax", "default"], (0, 320))
    vae_id = b.node("VAELoader", [VIDEO_VAE], (0, 480), title="Video VAE")
    avae_id = b.node("VAELoader", [AUDIO_VAE], (0, 600), title="Audio VAE (fp32)")
    cfg_id = b.node("MultiNPUParallelConfig", [4, "auto"], (380, 160), size=(320, 160),
                    title="MultiNPUParallelConfig (npu_count = devices: 1, 2, 4 or 8)")
    b.link(unet_id, 0, lora_id, "model")
    b.link(lora_id, 0, cfg_id, "model")
    b.link(clip_id, 0, cfg_id, "clip")
    b.link(vae_id, 0, cfg_id, "vae")
    b.link(avae_id, 0, cfg_id, "audio_vae")
    cond_id = b.node(cond_kind, cond_widgets, (760, 160), size=(420, 420), extra_inputs=cond_extra)
    b.link(cfg_id, 1, cond_id, "clip")
    b.link(cfg_id, 2, cond_id, "vae")
    if cond_kind == "MiniMaxH3ReferenceToVideo":
        b.link(cfg_id, 3, cond_id, "audio_vae")
    guider = b.node("BasicGuider", [], (1240, 0))
    b.link(cfg_id, 0, guider, "model")
    b.link(cond_id, 0, guider, "conditioning")
    sched = b.node("BasicScheduler", ["simple", 8, 1.0], (1240, 140))
    b.link(cfg_id, 0, sched, "model")
    sampler = b.node("KSamplerSelect", ["res_multistep"], (1240, 300))
    noise = b.node("RandomNoise", [42, "fixed"], (1240, 420))
    sca = b.node("SamplerCustomAdvanced", [], (1600, 160), size=(300, 200))
    b.link(noise, 0, sca, "noise")
    b.link(guider, 0, sca, "guider")
    b.link(sampler, 0, sca, "sampler")
    b.link(sched, 0, sca, "sigmas")
    b.link(cond_id, 1, sca, "latent_image")
    dec = b.node("VAEDecode", [], (1960, 100))
    b.link(sca, 0, dec, "samples")
    b.link(cfg_id, 2, dec, "vae")
    adec = b.node("VAEDecodeAudio", [], (1960, 240))
    b.link(sca, 0, adec, "samples")
    b.link(cfg_id, 3, adec, "vae")
    video = b.node("CreateVideo", [24, 8], (2240, 160))
    b.link(dec, 0, video, "images")
    b.link(adec, 0, video, "audio")
    return cond_id, video


def _save(b, video, prefix):
    save = b.node("SaveVideo", [prefix, "auto", "auto"], (2560, 160), size=(640, 480))
    b.link(video, 0, save, "video")


T2VA_PROMPT = ("A lighthouse keeper climbs a spiral staircase at dusk, lantern in hand; wind rattles the windows and "
               "waves crash below. Camera follows from behind, then turns to the sea as the beam sweeps out.\n\n"
               "Audio: wind, creaking stairs, distant surf, a low foghorn on the last beat.")
FL2VA_PROMPT = ("The scene moves from the first frame to the last in one continuous shot, with natural motion and "
                "matching ambient sound.")
REF2VA_PROMPT = ("<Subject 1> is the person in <Picture 1>. <Subject 1> walks through a rainy night market, stops at "
                 "a noodle stall and smiles at the cook. Audio: rain on awnings, sizzling woks, distant chatter.")


# Fixed graph ids (the frontend wants a UUID or none), so regenerating gives the same files
def build_t2va(catalog):
    b = Builder(catalog, "6f3d2b0e-43a1-4c8e-9b7a-3e1f0c5d2a01")
    _cond, video = _common(b, FULL_FL2VA, TURBO_FL2V, "MiniMaxH3ImageToVideo", [T2VA_PROMPT, 1344, 768, 124])
    _save(b, video, "video/h3kit_t2va")
    return b.document()


def build_fl2va(catalog):
    b = Builder(catalog, "6f3d2b0e-43a1-4c8e-9b7a-3e1f0c5d2a02")
    cond, video = _common(b, FULL_FL2VA, TURBO_FL2V, "MiniMaxH3ImageToVideo", [FL2VA_PROMPT, 1344, 768, 124])
    first = b.node("LoadImage", ["example.png", "image"], (380, 420), size=(300, 320), title="First frame")
    last = b.node("LoadImage", ["example.png", "image"], (380, 780), size=(300, 320), title="Last frame")
    b.link(first, 0, cond, "first_frame")
    b.link(last, 0, cond, "last_frame")
    _save(b, video, "video/h3kit_fl2va")
    return b.document()


def build_ref2va(catalog):
    b = Builder(catalog, "6f3d2b0e-43a1-4c8e-9b7a-3e1f0c5d2a03")
    refs = [{"label": "ref_image_0", "name": "ref_images.ref_image_0", "shape": 7, "type": "IMAGE", "link": None},
            {"label": "ref_image_1", "name": "ref_images.ref_image_1", "shape": 7, "type": "IMAGE", "link": None}]
    cond, video = _common(b, FULL_REF2VA, TURBO_REF2V, "MiniMaxH3ReferenceToVideo",
                          [REF2VA_PROMPT, 1344, 768, 124, "match"], cond_extra=refs)
    ref = b.node("LoadImage", ["example.png", "image"], (380, 420), size=(300, 320), title="Picture 1")
    b.link(ref, 0, cond, "ref_images.ref_image_0")
    _save(b, video, "video/h3kit_ref2va")
    return b.document()


SHIPPED = {"t2va_8steps_lora.json": build_t2va, "fl2va_8steps_lora.json": build_fl2va,
           "ref2va_8steps_lora.json": build_ref2va}


def main():
    catalog = load_catalog()
    for name, build in SHIPPED.items():
        path = ROOT / "workflows" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(build(catalog), indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
