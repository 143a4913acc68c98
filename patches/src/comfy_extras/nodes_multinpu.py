from __future__ import annotations

import logging
from inspect import cleandoc
from typing import TYPE_CHECKING
from typing_extensions import override

from comfy_api.latest import ComfyExtension, io

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher
    from comfy.sd import CLIP, VAE

import comfy.multidevice
import comfy.multinpu_dit
import comfy.multinpu_process
import comfy.multinpu_te
import comfy.multinpu_vae

NPU_COUNTS = [1, 2, 4, 8]
AUTO = "auto"                        # the server's own device count: one workflow for a 4-card and an 8-card server
NPU_CHOICES = [AUTO] + NPU_COUNTS
WEIGHTS = ["auto", "replicated", "sharded"]


def server_npu_count() -> int:
    """The devices this server runs on: the ranks of its process group, or the devices this process sees."""
    transport = comfy.multinpu_process.transport()
    ranks = getattr(transport, "world_size", None)  # a process group's; the thread transport has none
    return ranks if isinstance(ranks, int) else len(comfy.multidevice.get_devices())


def resolve_npu_count(npu_count):
    """npu_count with "auto" replaced by this server's device count."""
    return server_npu_count() if npu_count == AUTO else npu_count


def check_npu_count(npu_count) -> str | None:
    """None when this server can run `npu_count` devices, else the message naming both counts and the fix.

    npu_count 1 always runs (on the model's own device). 2, 4 and 8 must equal the ranks of the server's
    process group (one process per device, on one host or several) or, with the thread transport, the
    devices this process sees: the service exposes exactly the cards the workflow is meant for. "auto" is
    that count, which must itself be 1, 2, 4 or 8.
    """
    if npu_count == AUTO:
        n = server_npu_count()
        return None if n in NPU_COUNTS else (
            f"MultiNPU Parallel Config: npu_count auto is this server's device count, {n}, and H3 runs on 1, 2, 4 "
            "or 8 devices. Fix: restart the service on 1, 2, 4 or 8 devices, or set npu_count to 1.")
    if npu_count not in NPU_COUNTS:
        return f"MultiNPU Parallel Config: npu_count must be auto or one of {NPU_COUNTS}, got {npu_count!r}."
    problem = comfy.multinpu_process.transport().npu_count_error(npu_count)
    return f"MultiNPU Parallel Config: {problem}" if problem else None


def _spread(what, apply, obj, primary, npu_count):
    """apply(obj, devices) on the ranks of this server's runtime (comfy.multinpu_process.runtime_for: its process
    group, or threads of this process on npu_count devices, rank 0 on obj's own device); obj unchanged (logged)
    where it cannot be split."""
    if primary.type == "cpu" and comfy.multidevice.device_kind() != "cpu":
        logging.warning(f"MultiNPU Parallel Config: the {what} is set to run on the CPU; it stays there.")
        return obj
    try:
        return apply(obj, comfy.multidevice.devices_for(primary, npu_count))
    except ValueError as e:
        logging.warning(f"MultiNPU Parallel Config: {str(e).removeprefix('MultiNPU: ')}; the {what} runs on one device.")
        return obj


class MultiNPUParallelConfigNode(io.ComfyNode):
    """
    Run MiniMax H3 on 1, 2, 4 or 8 devices (Ascend NPUs; CUDA GPUs work the same way).

    - npu_count 1: everything passes through unchanged.
    - npu_count 2, 4 or 8:
      - model: the diffusion model runs sequence-parallel. Each device works on its share of the
        video/audio/text tokens; attention exchanges the shares between devices, so the result matches
        one device. `weights` says where the DiT's weights live:
        - replicated: each device holds the full DiT (66 GB at BF16 for H3).
        - sharded: each device keeps 1/npu_count of every DiT block's weights; a block's weights are
          gathered from all devices just before it runs and dropped after it (one all-gather per block
          and step, overlapped with the previous block on NPU and CUDA). The output is the same.
        - auto (default): sharded when a full replica would not fit the device's free memory, else
          replicated. A workflow saved before this input existed runs with auto.
      - clip: the text encoder runs tensor-parallel, each device holding its share of every layer
        (where the device count does not divide the attention heads, a range of layers instead).
      - vae: the video VAE decodes its temporal chunks on all devices and blends them in order; the
        video is identical to a one-device decode. Encoding stays on the first device.
      - audio_vae: stays on the first device, in fp32.
      Every device's weights come from the one copy the loaders read: nothing is read twice.

    npu_count must equal the number of devices this ComfyUI server runs on: the processes of its group
    (h3kit start --devices, on one host or several), or the devices it sees with the thread transport. On a
    server with a different count the prompt is rejected before any work, with the fix. npu_count auto takes
    that count, whatever it is: one workflow for a 4-card and an 8-card server.
    Put this node last in the model chain, after LoRA and model-sampling nodes, and use its outputs
    everywhere the workflow needs the model, text encoder and VAEs. A text encoder with a LoRA, or a
    VAE that is not the H3 video VAE, passes through on one device (logged).
    """

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MultiNPUParallelConfig",
            display_name="MultiNPU Parallel Config",
            category="advanced/multigpu",
            description=cleandoc(cls.__doc__),
            inputs=[
                io.Model.Input("model"),
                io.Clip.Input("clip", optional=True),
                io.Vae.Input("vae", optional=True),
                io.Vae.Input("audio_vae", optional=True),
                io.Combo.Input("npu_count", options=NPU_CHOICES, default=4,
                               tooltip="Devices to run on: 1, 2, 4 or 8, equal to the devices this server runs on; "
                                       "auto: the devices this server runs on."),
                io.Combo.Input("weights", options=WEIGHTS, default="auto", optional=True,
                               tooltip="Where the DiT weights live: replicated (the whole DiT on every device), "
                                       "sharded (1/npu_count of every block on each device, gathered per block), "
                                       "auto (sharded when a replica would not fit the device)."),
            ],
            outputs=[
                io.Model.Output(),
                io.Clip.Output(),
                io.Vae.Output(display_name="VAE"),
                io.Vae.Output(display_name="AUDIO_VAE"),
            ],
        )

    @classmethod
    def validate_inputs(cls, npu_count) -> bool | str:
        return check_npu_count(npu_count) or True

    @classmethod
    def execute(cls, model: ModelPatcher, npu_count: int | str, clip: CLIP = None, vae: VAE = None,
                audio_vae: VAE = None, weights: str = "auto") -> io.NodeOutput:
        problem = check_npu_count(npu_count)
        if problem is not None:
            raise ValueError(problem)
        npu_count = resolve_npu_count(npu_count)
        if npu_count > 1:
            # on the ranks of this server's runtime (comfy.multinpu_process.runtime_for)
            model = comfy.multinpu_dit.apply_sequence_parallel(
                model, comfy.multidevice.devices_for(model.load_device, npu_count), weights=weights)
            if clip is not None:
                clip = _spread("text encoder", comfy.multinpu_te.apply_tensor_parallel, clip, clip.patcher.load_device, npu_count)
            if vae is not None:
                vae = _spread("VAE", comfy.multinpu_vae.apply_decode_parallel, vae, vae.device, npu_count)
            if audio_vae is not None:
                logging.info("MultiNPU Parallel Config: the audio VAE stays on one device, in fp32.")
        else:
            logging.info("MultiNPU Parallel Config: npu_count 1, the model runs on one device.")
        return io.NodeOutput(model, clip, vae, audio_vae)


class MultiNPUExtension(ComfyExtension):
    @override
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [
            MultiNPUParallelConfigNode,
        ]


async def comfy_entrypoint() -> MultiNPUExtension:
    return MultiNPUExtension()
