"""Loads that map the weight file (comfy.multinpu_models.mapped_loads, run by every cached loader), inside a
patched tree, in the ComfyUI interpreter on cpu; tests/test_mapped_loads.py asserts on the report.

A tiny DiT written with 64-byte aligned tensors and the same one written by safetensors (8-byte aligned) are loaded
through comfy.sd.load_diffusion_model, as UNETLoader and every worker do. Where each weight's data lives is read
from /proc/self/maps: inside the file's mapping, or in private memory. A forward of each is compared with the
same file loaded by upstream's own path (the cache's load context switched off).
"""

from __future__ import annotations

import os
import sys

from checks_runner import boot_comfy, exit_without_teardown, run_checks

ARGS = boot_comfy()

import torch  # noqa: E402

import comfy.model_cache  # noqa: E402
import comfy.model_management  # noqa: E402
import comfy.multinpu_models  # noqa: E402
import comfy.sd  # noqa: E402
import comfy.utils  # noqa: E402
from h3kit import tiny_models  # noqa: E402

TMP = os.environ["H3KIT_CHECK_TMP"]


def _mappings(path: str) -> list:
    """[(start, end)] of this process's mappings of `path`."""
    real = os.path.realpath(path)
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == real:
                a, b = parts[0].split("-")
                out.append((int(a, 16), int(b, 16)))
    return out


def _where(model, path) -> dict:
    spans = _mappings(path)
    mapped = private = 0
    for t in model.diffusion_model.state_dict().values():
        n = t.numel() * t.element_size()
        if any(a <= t.data_ptr() < b for a, b in spans):
            mapped += n
        else:
            private += n
    return {"mapped": mapped, "private": private}


def _forward(patcher):
    g = torch.Generator().manual_seed(0)
    x = [torch.randn((1, 24, 3, 8, 8), generator=g), torch.randn((1, 32, 2, 5), generator=g)]
    ctx = patcher.model.diffusion_model.preprocess_text_embeds(torch.randn(1, 7, tiny_models.TINY_DIT["text_dim"],
                                                                           generator=g))
    with torch.inference_mode():
        return patcher.model.diffusion_model(x, torch.tensor([500.0]), ctx, transformer_options={}, minimax_payload={})


def check_mapped():
    sd = tiny_models.dit_state_dict(0)
    aligned, plain = os.path.join(TMP, "aligned.safetensors"), os.path.join(TMP, "plain.safetensors")
    tiny_models.save_aligned(sd, aligned)
    comfy.utils.save_torch_file(sd, plain)
    out = {}
    for name, path in (("aligned", aligned), ("plain", plain)):
        m = comfy.sd.load_diffusion_model(path, model_options={"dtype": torch.float32})
        got = _forward(m)
        # upstream's own load of the same file: a private copy of every weight
        real = comfy.model_cache.load_context
        comfy.model_cache.load_context = lambda: __import__("contextlib").nullcontext()
        try:
            comfy.model_cache.clear()
            ref = comfy.sd.load_diffusion_model(path, model_options={"dtype": torch.float32})
        finally:
            comfy.model_cache.load_context = real
        out[name] = dict(_where(m.model, path), upstream=_where(ref.model, path),
                         equal=all(torch.equal(a, b) for a, b in zip(got, _forward(ref))) and len(got) == 2)
        comfy.model_cache.clear()
    return out


CHECKS = {"mapped": check_mapped}

if __name__ == "__main__":
    sys.exit(exit_without_teardown(run_checks(CHECKS, ARGS.only, ARGS.out)))
