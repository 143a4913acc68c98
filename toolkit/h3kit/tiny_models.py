"""Tiny random-weight H3 checkpoints built with the real upstream classes and key names.

Runs inside the ComfyUI interpreter with the ComfyUI tree on sys.path (it imports comfy.*), e.g.
`python -m h3kit.tiny_models dit OUT.safetensors --seed 1` from the tree.

- dit: the DiT loader reads every dimension from the weights (comfy/model_detection.py).
- te, video_vae, audio_vae: the loaders build these at full size unless the checkpoint declares its
  dimensions in the "config" metadata entry, which h3-checkpoint-declared-dimensions.patch adds. The text
  encoder keeps all 50 layers (upstream detects the H3 encoder by its layer 49) at width 16.

Everything is fp32 so that multi-device runs can be compared with one device at the fp32 gates, except
dit_int8: the same DiT with its transformer blocks' linears quantized as the published H3 INT8 DiTs are
(int8_tensorwise with ConvRot), by the pin's own TensorWiseINT8Layout.
"""

from __future__ import annotations

import argparse
import json
import math

# Small enough to run a forward in milliseconds on CPU, shaped so that every code path of the real model
# is used: 8 heads (so 2 and 4 devices split them), rotary dims 6 x rope_inv_freq_len inside head_dim 16.
TINY_DIT = dict(hidden_size=64, num_layers=2, token_refiner_num_layers=1, num_attention_heads=8,
                attention_head_dim=16, ffn_hidden_size=128, text_dim=16, timestep_input_dim=32,
                time_embed_hidden_size=64, time_embed_dim=32, rope_inv_freq_len=2)
# Qwen3-VL at width 16 (= the tiny DiT's text_dim): 4 query heads over 2 key/value heads of upstream's fixed
# head_dim 128, so 2 and 4 devices split the queries and 4 must share key/value heads.
TINY_TE = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=50, num_attention_heads=4,
               num_key_value_heads=2,
               vision=dict(hidden_size=16, intermediate_size=32, depth=2, num_heads=2,
                           deepstack_visual_indexes=[0, 1], num_position_embeddings=64))
# Video VAE: GroupNorm needs multiples of 32 channels, the six levels keep upstream's 16x / 4x strides.
TINY_VIDEO_VAE = dict(ch=32, ch_mult=[1, 1, 1, 1, 1, 1], num_res_blocks=1, decoder_layers=1,
                      decoder_heads=2, decoder_dim_head=16)
# Audio VAE: the projection has 8 heads, BigVGAN halves its width seven times (so 128 is the floor).
TINY_AUDIO_VAE = dict(encoder_dim=2, latent_dim=16, decoder_dim=128)


def _cpu_comfy():
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # before comfy.model_management is imported, or it probes CUDA
    import comfy.model_management  # noqa: F401


def dit_state_dict(seed: int = 0, dims: dict | None = None, rope_base: float = 10000.0) -> dict:
    """A random state dict for MiniMaxH3Model with `dims` (default TINY_DIT), deterministic in `seed`.

    Weights are scaled by 1/sqrt(fan-in) and biases kept small so activations stay O(1) through the blocks;
    `rope_base` sets the rotary frequencies (a small base makes every rotary dimension turn within a tiny
    sequence, which the parity worker wants).
    """
    _cpu_comfy()
    import torch

    import comfy.ldm.minimax.model
    import comfy.ops

    cfg = dict(TINY_DIT, **(dims or {}))
    model = comfy.ldm.minimax.model.MiniMaxH3Model(**cfg, operations=comfy.ops.manual_cast, device="cpu",
                                                   dtype=torch.float32)
    sd = _randomize(model, seed)
    n = sd["rope.inv_freq"].shape[0]
    sd["rope.inv_freq"] = 1.0 / (rope_base ** (torch.arange(n, dtype=torch.float32) / n))
    return sd


# The published H3 INT8 DiTs (minimax_h3_*_int8_convrot) store the transformer blocks' linears as int8_tensorwise
# with ConvRot; the tiny INT8 DiT quantizes those four linears of every block and of the text refiner's blocks,
# the layers that hold nearly all the weights, and keeps the fp32 islands and the adaLN path in float.
INT8_LAYERS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
# ConvRot rotates K in Hadamard groups (a power of 4): 64 fits the tiny widths (64 and 128); the published use 256
INT8_CONVROT_GROUPSIZE = 64


def int8_state_dict(sd: dict, convrot_groupsize: int = INT8_CONVROT_GROUPSIZE, layers=INT8_LAYERS) -> dict:
    """`sd` with the blocks' `layers` quantized as the pin stores INT8 weights and loads them back.

    Per layer, as upstream's MixedPrecisionOps.Linear.state_dict() writes it: `weight` (int8 [N, K], ConvRot-
    rotated), `weight_scale` (float32 [N, 1], per output channel) and `comfy_quant` (the JSON
    {"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": G} as uint8 bytes), made by the pin's
    TensorWiseINT8Layout (comfy-kitchen). comfy.utils.detect_layer_quantization finds the comfy_quant entries
    and the loader builds the model with mixed_precision_ops.
    """
    import torch

    import comfy.quant_ops

    conf = json.dumps({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": convrot_groupsize})
    out = {}
    for key, value in sd.items():
        layer = key[:-len(".weight")] if key.endswith(".weight") else ""
        if "blocks." in layer and layer.endswith(tuple(layers)):
            qt = comfy.quant_ops.QuantizedTensor.from_float(value, "TensorWiseINT8Layout", per_channel=True,
                                                            convrot=True, convrot_groupsize=convrot_groupsize)
            out.update(qt.state_dict(key))
            out[f"{layer}.comfy_quant"] = torch.tensor(list(conf.encode("utf-8")), dtype=torch.uint8)
        else:
            out[key] = value
    return {k: v.contiguous() for k, v in out.items()}


def dit_int8_state_dict(seed: int = 0, dims: dict | None = None, rope_base: float = 10000.0) -> dict:
    """dit_state_dict(seed, dims, rope_base) with its block linears quantized (int8_state_dict)."""
    return int8_state_dict(dit_state_dict(seed, dims, rope_base))


def _randomize(module, seed: int, keep=()) -> dict:
    """The module's state dict with parameters drawn deterministically (buffers kept unless listed)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    params = dict(module.named_parameters())
    sd = {}
    for name, t in module.state_dict().items():
        if name in params and name not in keep:
            if "norm" in name and name.endswith("weight"):
                sd[name] = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
            elif t.dim() == 1:  # biases and per-channel scales: small
                sd[name] = 0.1 * torch.randn(t.shape, generator=gen)
            else:  # fan-in scaling keeps activations O(1)
                sd[name] = torch.randn(t.shape, generator=gen) / math.sqrt(max(1, t[0].numel()))
        else:
            sd[name] = t.detach().clone().float()
    return {k: v.contiguous().float() for k, v in sd.items()}


def te_state_dict(seed: int = 0, dims: dict | None = None) -> dict:
    _cpu_comfy()
    import torch

    import comfy.ops
    import comfy.text_encoders.minimax

    cfg = dict(TINY_TE, **(dims or {}))
    model = comfy.text_encoders.minimax.MiniMaxQwen3VL(cfg, torch.float32, "cpu", comfy.ops.manual_cast)
    return _randomize(model, seed)


def video_vae_state_dict(seed: int = 0, dims: dict | None = None) -> dict:
    _cpu_comfy()
    import comfy.ldm.minimax.vae

    model = comfy.ldm.minimax.vae.MiniMaxH3VideoVAE(**dict(TINY_VIDEO_VAE, **(dims or {})))
    return _randomize(model, seed)


def audio_vae_state_dict(seed: int = 0, dims: dict | None = None) -> dict:
    _cpu_comfy()
    import torch

    import comfy.ldm.minimax.audio_vae

    model = comfy.ldm.minimax.audio_vae.MiniMaxH3AudioVAE(**dict(TINY_AUDIO_VAE, **(dims or {})))
    sd = _randomize(model, seed)
    sd["latents_mean"] = torch.zeros_like(sd["latents_mean"])
    sd["latents_std"] = torch.ones_like(sd["latents_std"])
    return sd


# component: (state dict builder, the metadata key its loader reads, default dims)
COMPONENTS = {
    "dit": (dit_state_dict, "transformer", TINY_DIT),
    "dit_int8": (dit_int8_state_dict, "transformer", TINY_DIT),
    "te": (te_state_dict, "minimax_h3_text_encoder", TINY_TE),
    "video_vae": (video_vae_state_dict, "minimax_h3_video_vae", TINY_VIDEO_VAE),
    "audio_vae": (audio_vae_state_dict, "minimax_h3_audio_vae", TINY_AUDIO_VAE),
}


def save_aligned(sd: dict, path: str, align: int = 64) -> None:
    """A safetensors file whose every tensor starts at a multiple of `align` bytes (the header padded with spaces,
    tensors of whole multiples first). On a CPU that simulates devices only such weights are mapped (the CPU
    kernels round misaligned data differently: comfy.multinpu_models.ALIGNMENT); an accelerator maps any."""
    import json
    import struct
    import torch
    names = sorted(sd, key=lambda k: (sd[k].numel() * sd[k].element_size() % align != 0, k))
    dtypes = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    header, offset = {}, 0
    for k in names:
        n = sd[k].numel() * sd[k].element_size()
        header[k] = {"dtype": dtypes[sd[k].dtype], "shape": list(sd[k].shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % align)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for k in names:
            f.write(sd[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def write(component: str, path: str, seed: int = 0, dims: dict | None = None) -> int:
    """Write one tiny checkpoint; returns its size in bytes. dims override the default dimensions (te,
    video_vae, audio_vae: they are declared in the metadata, so the loaders build the same model)."""
    import safetensors.torch

    build, key, dims0 = COMPONENTS[component]
    dit = component in ("dit", "dit_int8")
    if dims and dit:
        raise ValueError("the DiT loader reads its dimensions from the weights: use dit_state_dict(dims=...)")
    dims = dict(dims0, **(dims or {}))
    sd = build(seed, dims)
    config = {"minimax_h3_text_encoder": {"qwen3vl_32b_model_config": dims}} if component == "te" else {key: dims}
    metadata = {"config": json.dumps(config) if not dit else json.dumps({}),
                "h3kit_tiny": json.dumps({"component": component, "seed": seed})}
    safetensors.torch.save_file(sd, path, metadata=metadata)
    return sum(v.numel() * v.element_size() for v in sd.values())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("component", choices=sorted(COMPONENTS))
    ap.add_argument("out", nargs="+", help="one file per seed: --seed, --seed+1, ...")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for i, out in enumerate(args.out):
        size = write(args.component, out, args.seed + i)
        print(json.dumps({"component": args.component, "path": out, "seed": args.seed + i, "bytes": size}))


if __name__ == "__main__":
    main()
