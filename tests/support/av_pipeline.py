"""The tiny H3 text+image-to-video-and-audio pipeline the server-level tests send (test support).

One prompt, parametrised by npu_count: UNETLoader / CLIPLoader / two VAELoaders into MultiNPUParallelConfig,
MiniMaxH3ImageToVideo with a first frame, BasicGuider + SamplerCustomAdvanced, VAEDecode and VAEDecodeAudio
into PreviewImage, PreviewAudio and H3kitSaveTensors (tests/support/custom_nodes), which keeps the decoded
frames and waveform in fp32 for the comparison across device counts.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TOOLKIT = SUPPORT.parents[1] / "toolkit"
FOLDERS = {"dit": "diffusion_models", "te": "text_encoders", "video_vae": "vae", "audio_vae": "vae"}
# max_rel per output, fp32. Latents and frames: the DiT parity gate, carried through the whole pipeline. The
# waveform: the tiny audio VAE (BigVGAN, one device, fp32, the same model on both paths, peak-normalised output)
# amplifies a latent difference about 1000x in max_rel (one device, measured 2026-12-01: 1e-7 relative noise on
# the latent moves the waveform by max_rel 1.5e-4, rel_rms 8.7e-6). The latents here differ by about 2e-7 (the
# tensor-parallel text encoder sums in another order) and the waveforms by 1.4e-4 (2 devices) and 1.9e-4 (4):
# 1e-3 leaves 5x room; the same decode in bf16 moves it by 1.75.
GATES = {"video_latent": 1e-5, "audio_latent": 1e-5, "frames": 1e-5, "waveform": 1e-3}


def write_models(python: str, tree: Path, dest: Path) -> dict:
    """The four tiny checkpoints (h3kit.tiny_models, seed 0), written once into dest: {component: path}."""
    paths = {c: str(dest / f"h3kit_tiny_{c}.safetensors") for c in FOLDERS}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TOOLKIT), os.environ.get("PYTHONPATH", "")]))
    write = ("import sys, json; from h3kit import tiny_models; "
             "[tiny_models.write(c, p) for c, p in json.loads(sys.argv[1]).items()]")  # one interpreter for all four
    subprocess.run([python, "-c", write, json.dumps(paths)], cwd=tree, env=env, check=True, capture_output=True,
                   timeout=300)
    return paths


def install_models(models: Path, tiny: dict) -> None:
    """Link the tiny checkpoints into a server's models folder under the names the prompt uses."""
    for component, path in tiny.items():
        folder = models / FOLDERS[component]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / Path(path).name).symlink_to(path)


def server_args(workdir: Path) -> tuple:
    """The ComfyUI arguments that load H3kitSaveTensors from tests/support/custom_nodes."""
    config = Path(workdir) / "h3kit_test_paths.yaml"
    config.write_text(f"h3kit_tests:\n  custom_nodes: {SUPPORT / 'custom_nodes'}\n")
    return ("--extra-model-paths-config", str(config))


def loaders(npu_count: int) -> dict:
    """Nodes 1-5: the four tiny checkpoints' loaders into MultiNPUParallelConfig (MODEL, CLIP, VAE, audio VAE)."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "h3kit_tiny_dit.safetensors", "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": "h3kit_tiny_te.safetensors", "type": "minimax",
                                                     "device": "default"}},
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": "h3kit_tiny_video_vae.safetensors"}},
        "4": {"class_type": "VAELoader", "inputs": {"vae_name": "h3kit_tiny_audio_vae.safetensors"}},
        "5": {"class_type": "MultiNPUParallelConfig", "inputs": {"npu_count": npu_count, "model": ["1", 0],
                                                                 "clip": ["2", 0], "vae": ["3", 0], "audio_vae": ["4", 0]}},
    }


def prompt(npu_count: int, seed: int, tag: str) -> dict:
    return {
        **loaders(npu_count),
        "6": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0x8040c0}},
        "7": {"class_type": "MiniMaxH3ImageToVideo", "inputs": {"clip": ["5", 1], "vae": ["5", 2], "width": 64, "height": 64,
                                                                "prompt": "A red fox trots through fresh snow.",
                                                                "length": 39, "first_frame": ["6", 0]}},
        "8": {"class_type": "BasicGuider", "inputs": {"model": ["5", 0], "conditioning": ["7", 0]}},
        "9": {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}},
        "10": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "11": {"class_type": "BasicScheduler", "inputs": {"model": ["5", 0], "scheduler": "simple", "steps": 2, "denoise": 1.0}},
        "12": {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["9", 0], "guider": ["8", 0], "sampler": ["10", 0],
                                                                 "sigmas": ["11", 0], "latent_image": ["7", 1]}},
        "13": {"class_type": "VAEDecode", "inputs": {"samples": ["12", 0], "vae": ["5", 2]}},
        "14": {"class_type": "VAEDecodeAudio", "inputs": {"samples": ["12", 0], "vae": ["5", 3]}},
        "15": {"class_type": "PreviewImage", "inputs": {"images": ["13", 0]}},
        "16": {"class_type": "PreviewAudio", "inputs": {"audio": ["14", 0]}},
        "17": {"class_type": "H3kitSaveTensors", "inputs": {"images": ["13", 0], "audio": ["14", 0], "samples": ["12", 0],
                                                            "filename_prefix": f"h3kit_tensors/{tag}"}},
    }


def decoded(server, entry: dict) -> dict:
    """The fp32 frames [T, H, W, 3] and waveform [B, C, N] a finished prompt saved (node 17)."""
    import safetensors.numpy
    item = entry["outputs"]["17"]["tensors"][0]
    return safetensors.numpy.load_file(str(server.output / item["subfolder"] / item["filename"]))


def compare(reference: dict, other: dict) -> dict:
    """{"frames" | "waveform": {"max_abs", "max_rel", "shape"}} of `other` against `reference` (numpy, float64)."""
    out = {}
    for key in ("video_latent", "audio_latent", "frames", "waveform"):
        a, b = reference[key].astype("float64"), other[key].astype("float64")
        if a.shape != b.shape:
            out[key] = {"max_abs": float("inf"), "max_rel": float("inf"), "rel_rms": float("inf"),
                        "shape": [list(a.shape), list(b.shape)]}
            continue
        diff = abs(a - b)
        peak, rms = float(abs(a).max()), float((a ** 2).mean() ** 0.5)
        out[key] = {"max_abs": float(diff.max()), "max_rel": float(diff.max()) / peak if peak else float("inf"),
                    "rel_rms": float((diff ** 2).mean() ** 0.5) / rms if rms else float("inf"), "shape": list(a.shape)}
    return out


def within_gate(result: dict) -> bool:
    return all(result[k]["max_rel"] <= gate for k, gate in GATES.items())  # False for NaN as for a figure over it
