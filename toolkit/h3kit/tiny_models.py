"""Tiny random-weight H3 checkpoints built with the real upstream classes and key names.

Runs inside the ComfyUI interpreter with the ComfyUI tree on sys.path (it imports comfy.*), e.g.
`python -m h3kit.tiny_models dit OUT.safetensors --seed 1` from the tree. The DiT loader reads every
dimension from the weights (comfy/model_detection.py), so a few-hundred-KB file loads through the stock
UNETLoader and runs the real H3 forward.
"""

from __future__ import annotations

import argparse
import json
import math

# Small enough to run a forward in milliseconds on CPU, shaped so that every code path of the real model
# is used: 8 heads (so 2 and 4 devices split them), rotary dims 6 x rope_inv_freq_len inside head_dim 16.
TINY_DIT = dict(hidden_size=64, num_layers=2, token_refiner_num_layers=1, num_attention_heads=8,
                attention_head_dim=16, ffn_hidden_size=128, text_dim=48, timestep_input_dim=32,
                time_embed_hidden_size=64, time_embed_dim=32, rope_inv_freq_len=2)


def _cpu_comfy():
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # before comfy.model_management is imported, or it probes CUDA
    import comfy.model_management  # noqa: F401


def dit_state_dict(seed: int = 0, dims: dict | None = None) -> dict:
    """A random state dict for MiniMaxH3Model with `dims` (default TINY_DIT), deterministic in `seed`."""
    _cpu_comfy()
    import torch

    import comfy.ldm.minimax.model
    import comfy.ops

    cfg = dict(TINY_DIT, **(dims or {}))
    model = comfy.ldm.minimax.model.MiniMaxH3Model(**cfg, operations=comfy.ops.manual_cast, device="cpu",
                                                   dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for name, t in model.state_dict().items():
        if name.endswith("rope.inv_freq"):
            n = t.shape[0]
            sd[name] = 1.0 / (10000.0 ** (torch.arange(n, dtype=torch.float32) / n))
        elif "norm" in name and name.endswith("weight"):
            sd[name] = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
        else:
            fan_in = t.shape[-1] if t.dim() > 1 else 1
            sd[name] = torch.randn(t.shape, generator=gen) / math.sqrt(fan_in)
    return {k: v.contiguous() for k, v in sd.items()}


def write_dit(path: str, seed: int = 0, dims: dict | None = None) -> int:
    import safetensors.torch

    sd = dit_state_dict(seed, dims)
    safetensors.torch.save_file(sd, path, metadata={"h3kit_tiny": json.dumps({"component": "dit", "seed": seed})})
    return sum(v.numel() * v.element_size() for v in sd.values())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("component", choices=["dit"])
    ap.add_argument("out", nargs="+", help="one file per seed: --seed, --seed+1, ...")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for i, out in enumerate(args.out):
        size = write_dit(out, args.seed + i)
        print(json.dumps({"component": args.component, "path": out, "seed": args.seed + i, "bytes": size}))


if __name__ == "__main__":
    main()
