"""Checks of the sharded DiT weights (comfy/multinpu_shard.py) inside a patched tree, run in the ComfyUI interpreter
with 2 simulated devices (H3KIT_SIM_DEVICES=2); tests/test_multinpu_shard.py asserts on the report.

The tiny parity DiT with a random LoRA is sampled on one device and through the node with sharded weights when
ComfyUI could not load the slices (a partial load: each block's slice built on the fly, and a LowVramPatch on
every LoRA'd block module that would apply the LoRA a second time), the node's weights auto against a simulated
card size, an unload and reload, and the host copies the sharded ranks keep.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

from checks_runner import boot_comfy, exit_without_teardown, run_checks

ARGS = boot_comfy()

import torch  # noqa: E402

import comfy.model_management  # noqa: E402
import comfy.multinpu_dit  # noqa: E402
import comfy.multinpu_shard  # noqa: E402
import comfy.multinpu_weights  # noqa: E402
import comfy.sd  # noqa: E402
import comfy_extras.nodes_multinpu as nodes_multinpu  # noqa: E402
from h3kit.runtime import parity_common, parity_dit as pw  # noqa: E402

NODE = nodes_multinpu.MultiNPUParallelConfigNode
TMP = os.environ["H3KIT_CHECK_TMP"]
CKPT = os.path.join(TMP, "tiny.safetensors")
pw._tiny_checkpoint(CKPT, 0)
BASE = comfy.sd.load_diffusion_model(CKPT)
LORA = pw._apply_lora(BASE, parity_common.lora_state_dict(BASE.model.diffusion_model.state_dict(), "blocks.",
                                                       "diffusion_model.", 0))[0]


def _sample(patcher, weights=None, npu_count=2):
    m, capture, inputs = pw._prepare(patcher, "t2va", 0)
    if weights is not None:
        m = NODE.execute(model=m, npu_count=npu_count, weights=weights).args[0]
    # the ranks keep their copies until `m` goes away (its thread runtime then lets go of them at the next command)
    return m, pw._run(m, capture, inputs, 1, 0)


def _ranks(m):
    """Every rank's own copy of the DiT (its ModelPatcher), as the rank threads hold them after a forward; the
    server's copy `m` stays on the host and computes nothing."""
    w = comfy.multinpu_dit.get_wrapper(m)
    return [c.configs[w.config.id].patcher for c in w.runtime.contexts]


@contextlib.contextmanager
def _short_of_memory():
    """ComfyUI on a 2 MB card: the model loads partially (the cpu, which always loads fully, passes for a device)."""
    mm = comfy.model_management
    saved = (mm.is_device_cpu, mm.get_free_memory, mm.vram_state, mm.lowvram_available)
    mm.is_device_cpu = lambda device: False
    mm.get_free_memory = lambda dev=None, torch_free_too=False: (2 << 20, 0) if torch_free_too else 2 << 20
    mm.vram_state, mm.lowvram_available = mm.VRAMState.NORMAL_VRAM, True
    try:
        yield
    finally:
        mm.is_device_cpu, mm.get_free_memory, mm.vram_state, mm.lowvram_available = saved


def check_partial_load():
    """Slices ComfyUI did not load are built per block on use, and the LoRA is not applied twice."""
    _, single = _sample(LORA)
    comfy.model_management.unload_all_models()
    out = {}
    for guard in (True, False):
        real = comfy.multinpu_shard._drop_lowvram_patch
        if not guard:
            comfy.multinpu_shard._drop_lowvram_patch = lambda slot: None
        try:
            with _short_of_memory():
                m, sharded = _sample(LORA, "sharded")
            rank0 = _ranks(m)[0]
            shards = comfy.multinpu_shard.of(rank0.model.diffusion_model)
            lowvram = sum(1 for mod in rank0.model.diffusion_model.blocks.modules()
                          if any(getattr(f, "is_lowvram_patch", False) for f in getattr(mod, "weight_function", [])))
            out["guard" if guard else "no_guard"] = {
                "max_abs": pw._dit_metrics(single, sharded)[1]["max_abs"], "built": shards.built,
                "rebuilt": shards.rebuilt, "lowvram_patches_left": lowvram,
                "model_lowvram": bool(rank0.model.model_lowvram)}
        finally:
            comfy.multinpu_shard._drop_lowvram_patch = real
            comfy.model_management.unload_all_models()
    return out


@contextlib.contextmanager
def _card_budget(nbytes: int):
    """ComfyUI's loader given `nbytes` for a model's weights (the lowvram budget load_models_gpu computes from a
    card's free memory, less what the model already holds there, as it does; the cpu, which always loads fully,
    passes for a short device). Every rank loads its model before each forward."""
    lm = comfy.model_management.LoadedModel
    real = lm.model_load
    lm.model_load = lambda self, lowvram_model_memory=0, force_patch_weights=False: real(
        self, max(0.1, nbytes - self.model_loaded_memory()), force_patch_weights)
    try:
        yield
    finally:
        lm.model_load = real


def check_per_block_slope():
    """A card that holds only some slices: ComfyUI's loader places each block's slice on its own, the rest are built
    per block on use from this rank's bytes alone (nothing of the block beyond its slice moves to the device)."""
    _, single = _sample(BASE)
    comfy.model_management.unload_all_models()
    probe = NODE.execute(model=BASE.clone(), npu_count=2, weights="sharded").args[0]
    shards = comfy.multinpu_shard.of(probe.model.diffusion_model)
    slice_bytes = [lay.shard for lay in shards.layouts]
    block_bytes = [lay.nbytes for lay in shards.layouts]
    # a budget of the whole rank model less one and a half slices: room for every module but the last slices
    budget = probe.model_size() - slice_bytes[0] * 3 // 2
    with _card_budget(budget):
        m, sharded = _sample(BASE, "sharded")
    ranks = _ranks(m)
    per_rank = []
    for p in ranks:
        sh = comfy.multinpu_shard.of(p.model.diffusion_model)
        per_rank.append({"loaded": [b.built_for is not None for b in sh.slices()], "rebuilt": sh.rebuilt,
                         "h2d_bytes": sh.h2d_bytes})
    wrapper = comfy.multinpu_dit.get_wrapper(m)
    comfy.model_management.unload_all_models()
    return {"max_abs": pw._dit_metrics(single, sharded)[1]["max_abs"], "forwards": wrapper.forwards,
            "slice_bytes": slice_bytes, "block_bytes": block_bytes, "ranks": per_rank, "budget": budget}


def check_auto():
    """weights auto against the free memory of a simulated card (H3KIT_SIM_DEVICE_MEMORY, GB)."""
    size = BASE.model_size()
    chosen = {}
    for gb in ("0.0005", "100"):
        os.environ["H3KIT_SIM_DEVICE_MEMORY"] = gb
        try:
            m = NODE.execute(model=BASE.clone(), npu_count=2).args[0]  # no weights: a workflow saved before it
            chosen[gb] = comfy.multinpu_dit.get_wrapper(m).weights
        finally:
            os.environ.pop("H3KIT_SIM_DEVICE_MEMORY")
    return {"model_bytes": size, "min_inference": comfy.model_management.minimum_inference_memory(), "chosen": chosen}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def check_short_card_warns():
    """The node's sampling wrapper names the rank, the shortfall and the fix when a tier does not fit a card."""
    records = _Records()
    logging.getLogger().addHandler(records)
    os.environ["H3KIT_SIM_DEVICE_MEMORY"] = "0.001"  # 1 MB cards: neither tier fits
    try:
        _sample(BASE, "replicated")
        _sample(BASE, "sharded")
    finally:
        os.environ.pop("H3KIT_SIM_DEVICE_MEMORY")
        logging.getLogger().removeHandler(records)
        comfy.model_management.unload_all_models()
    return [m for m in records.messages if "MultiNPU: cpu (rank" in m]


def check_unload_and_host_copies():
    """An unload frees every rank's slices (they come back on the next load); the sharded ranks read from the one
    host copy: no weight of theirs lives outside the loaded model's storage."""
    m, _ = _sample(BASE, "sharded")
    ranks = _ranks(m)
    shards = [comfy.multinpu_shard.of(p.model.diffusion_model) for p in ranks]
    loaded = [s.built for s in shards]
    resident = [comfy.multinpu_shard.resident_bytes(p.model.diffusion_model) for p in ranks]
    comfy.model_management.unload_all_models()
    unloaded = [s.built for s in shards]
    after = [comfy.multinpu_shard.resident_bytes(p.model.diffusion_model) for p in ranks]
    source = {t.untyped_storage().data_ptr() for t in BASE.model.diffusion_model.parameters()}
    hosts = set()
    for s in shards:
        for lay in s.layouts:
            hosts.update(slot.host.untyped_storage().data_ptr() for slot in lay.slots)
    comfy.model_management.load_models_gpu(ranks)
    reloaded = [s.built for s in shards]
    comfy.model_management.unload_all_models()
    return {"loaded": loaded, "unloaded": unloaded, "reloaded": reloaded, "resident": resident, "after_unload": after,
            "hosts_in_source": hosts <= source, "host_tensors": len(hosts)}


def check_reapply():
    """A sharded model's blocks hold one rank's slices: the node applied to it again refuses, naming the fix."""
    m = NODE.execute(model=BASE.clone(), npu_count=2, weights="sharded").args[0]
    try:
        NODE.execute(model=m, npu_count=2, weights="sharded")
    except ValueError as e:
        return str(e)
    return None


CHECKS = {"per_block_slope": check_per_block_slope, "reapply": check_reapply, "partial_load": check_partial_load, "auto": check_auto, "short_card_warns": check_short_card_warns,
          "unload_and_host_copies": check_unload_and_host_copies}

if __name__ == "__main__":
    sys.exit(exit_without_teardown(run_checks(CHECKS, ARGS.only, ARGS.out)))
