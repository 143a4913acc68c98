"""Tiny H3 checkpoints (h3kit.tiny_models) load through the stock loader nodes of the patched tree, and
h3-checkpoint-declared-dimensions.patch changes nothing for checkpoints that declare no dimensions."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.support.comfy_server import SUPPORT

pytestmark = pytest.mark.upstream

SCRIPT = r"""
import json, sys
import comfy.cli_args
comfy.cli_args.args.cpu = True
import comfy.model_management, comfy.sd, folder_paths, nodes, torch
from h3kit import tiny_models
models = sys.argv[1]
for kind, comp in (("diffusion_models", "dit"), ("text_encoders", "te"), ("vae", "video_vae"), ("vae", "audio_vae")):
    folder_paths.add_model_folder_path(kind, models, is_default=True)
    tiny_models.write(comp, f"{models}/h3kit_tiny_{comp}.safetensors", seed=5)
out = {}
model = nodes.UNETLoader().load_unet("h3kit_tiny_dit.safetensors", "default")[0]
out["dit"] = type(model.model.diffusion_model).__name__
clip = nodes.CLIPLoader().load_clip("h3kit_tiny_te.safetensors", "minimax", "default")[0]
cond = clip.encode_from_tokens_scheduled(clip.tokenize("a red fox"))
out["te"] = [type(clip.cond_stage_model).__name__, list(cond[0][0].shape)]
vae = nodes.VAELoader().load_vae("h3kit_tiny_video_vae.safetensors")[0]
out["video_vae"] = [type(vae.first_stage_model).__name__, list(vae.decode(torch.randn(1, 24, 2, 2, 2)).shape)]
avae = nodes.VAELoader().load_vae("h3kit_tiny_audio_vae.safetensors")[0]
out["audio_vae"] = [type(avae.first_stage_model).__name__, list(avae.decode(torch.randn(1, 32, 2, 3)).shape)]
out["no_config"] = [comfy.sd.metadata_model_config(None, "minimax_h3_video_vae"),
                    comfy.sd.metadata_model_config({"config": json.dumps({"vae": {"ch": 1}})}, "minimax_h3_video_vae"),
                    comfy.sd.metadata_model_config({"config": "not json"}, "minimax_h3_video_vae")]
print("RESULT " + json.dumps(out))
"""


def test_tiny_components_load_through_the_stock_loader_nodes(installed_tree, comfy_python, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(installed_tree), str(SUPPORT.parents[1] / "toolkit")]))
    proc = subprocess.run([comfy_python, "-c", SCRIPT, str(tmp_path)], cwd=installed_tree, env=env,
                          capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(line[7:])
    assert out["dit"] == "MiniMaxH3Model"
    assert out["te"] == ["MiniMaxH3TEModel_", [1, 3, 16]]  # "a red fox": 3 Qwen tokens of width 16 (the DiT's text_dim)
    assert out["video_vae"] == ["MiniMaxH3VideoVAE", [1, 5, 32, 32, 3]]  # 2 latent frames -> 5 frames, 16x
    assert out["audio_vae"] == ["MiniMaxH3AudioVAE", [1, 2400, 2]]  # 3 latents x 800 samples, stereo
    assert out["no_config"] == [{}, {}, {}]  # no declared dimensions: nothing to pass
    sizes = {p.name: p.stat().st_size for p in tmp_path.glob("h3kit_tiny_*.safetensors")}
    assert max(sizes.values()) < 16 * 1024 * 1024, sizes


FULL_SIZE = r"""
import json, sys
import comfy.cli_args
comfy.cli_args.args.cpu = True
import torch, comfy.model_management, comfy.ops, comfy.sd
import comfy.ldm.minimax.vae, comfy.ldm.minimax.audio_vae, comfy.text_encoders.minimax
declared = getattr(comfy.sd, "metadata_model_config", lambda metadata, key: {})
with torch.device("meta"):
    models = {
        "video_vae": comfy.ldm.minimax.vae.MiniMaxH3VideoVAE(**declared({}, "minimax_h3_video_vae")),
        "audio_vae": comfy.ldm.minimax.audio_vae.MiniMaxH3AudioVAE(**declared({}, "minimax_h3_audio_vae")),
        "te": comfy.text_encoders.minimax.MiniMaxQwen3VL({}, torch.bfloat16, "meta", comfy.ops.manual_cast),
    }
print("RESULT " + json.dumps({k: {n: list(t.shape) for n, t in m.state_dict().items()} for k, m in models.items()}))
"""


def _shapes(tree, python):
    proc = subprocess.run([python, "-c", FULL_SIZE], cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)),
                          capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(line[7:])


def test_real_checkpoints_build_exactly_as_at_the_pin(installed_tree, pin_tree, comfy_python):
    """A checkpoint that declares no dimensions (every real one) builds the same full-size text encoder and
    VAEs as the unpatched pin: every parameter name and shape, compared on the meta device."""
    patched, pin = _shapes(installed_tree, comfy_python), _shapes(pin_tree, comfy_python)
    assert patched == pin
    assert len(pin["te"]) > 500 and pin["te"]["model.embed_tokens.weight"] == [151936, 5120]
    assert pin["video_vae"]["decoder.x_embedder.weight"] == [2048, 24]  # 32 heads x 64: the ViT decoder
