"""Test support, never shipped: a ComfyUI output node that saves the decoded frames and the audio waveform
exactly as VAEDecode and VAEDecodeAudio produced them (fp32 safetensors), and the sampled video and audio
latents they were decoded from, so the server-level parity test compares them, not an 8-bit PNG or a lossy
video of them. Loaded through --extra-model-paths-config (custom_nodes: this folder), see
tests/support/av_pipeline.py."""

import os

import torch

import comfy.utils
import folder_paths


class H3kitSaveTensors:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"images": ("IMAGE",), "audio": ("AUDIO",), "samples": ("LATENT",),
                             "filename_prefix": ("STRING", {"default": "h3kit_tensors/av"})}}

    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True
    CATEGORY = "h3kit/testing"

    def save(self, images, audio, samples, filename_prefix):
        folder, name, counter, subfolder, _ = folder_paths.get_save_image_path(filename_prefix,
                                                                               folder_paths.get_output_directory())
        file = f"{name}_{counter:05}_.safetensors"
        video_latent, audio_latent = samples["samples"].tensors  # H3's NestedTensor (video, audio)
        comfy.utils.save_torch_file({"frames": images.float().cpu().contiguous(),
                                     "waveform": audio["waveform"].float().cpu().contiguous(),
                                     "sample_rate": torch.tensor([int(audio["sample_rate"])]),
                                     "video_latent": video_latent.float().cpu().contiguous(),
                                     "audio_latent": audio_latent.float().cpu().contiguous()},
                                    os.path.join(folder, file))
        return {"ui": {"tensors": [{"filename": file, "subfolder": subfolder, "type": "output"}]}}


class H3kitSaveLatents(H3kitSaveTensors):
    """The sampled video and audio latents alone (fp32), for the node matrix: no decode spent on what it compares."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "filename_prefix": ("STRING", {"default": "h3kit_latents/av"})}}

    def save(self, samples, filename_prefix):
        folder, name, counter, subfolder, _ = folder_paths.get_save_image_path(filename_prefix,
                                                                               folder_paths.get_output_directory())
        file = f"{name}_{counter:05}_.safetensors"
        video_latent, audio_latent = samples["samples"].tensors
        comfy.utils.save_torch_file({"video_latent": video_latent.float().cpu().contiguous(),
                                     "audio_latent": audio_latent.float().cpu().contiguous()},
                                    os.path.join(folder, file))
        return {"ui": {"tensors": [{"filename": file, "subfolder": subfolder, "type": "output"}]}}


NODE_CLASS_MAPPINGS = {"H3kitSaveTensors": H3kitSaveTensors, "H3kitSaveLatents": H3kitSaveLatents}
