"""Devices a multi-device run uses, and per-device helpers that also work on Ascend NPU.

The device questions themselves stay in comfy.model_management (which this series patches with the
NPU arms of set_torch_device, synchronize, current_stream and the device context); this module
answers the multi-device ones: which kind of device the process computes on, which devices rank 0..N-1
use, and how many devices a CPU-only host simulates.

Simulation: the environment variable H3KIT_SIM_DEVICES (a count, "4") makes the process report that
many devices of its kind. With --cpu (`h3kit start --device-type cpu` sets it) they are "cpu" devices,
so every multi-device path runs (threads, collectives, the MultiNPUParallelConfig checks) on a host
without an accelerator. On CUDA or NPU they are the process's one device repeated: N ranks share one
card, so the same paths run with the accelerator's real kernels and streams (parity on a one-GPU host).
"""

from __future__ import annotations

import logging
import os

import torch

import comfy.model_management

SIM_DEVICES_ENV = "H3KIT_SIM_DEVICES"
SIM_MEMORY_ENV = "H3KIT_SIM_DEVICE_MEMORY"  # GB per simulated cpu device (unset: the host's free memory)


def device_kind() -> str:
    """"npu", "cuda" or "cpu": the kind of device this process computes on (another backend's type otherwise)."""
    if comfy.model_management.cpu_mode():
        return "cpu"
    if comfy.model_management.is_ascend_npu():
        return "npu"
    return comfy.model_management.get_torch_device().type


def sim_device_count(environ=None) -> int:
    """The device count H3KIT_SIM_DEVICES asks for (h3kit start sets it); 0 when unset.

    A value that is not a positive integer is logged and counts as 1, so a typo degrades to one device
    instead of stopping the server.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(SIM_DEVICES_ENV, "").strip()
    if not value:
        return 0
    if value.isascii() and value.isdigit() and int(value) > 0:
        return int(value)
    logging.warning(f"MultiDevice: ignoring {SIM_DEVICES_ENV}={value!r}: expected a positive device count such as 4")
    return 1


_sim_logged = set()


def get_devices() -> list[torch.device]:
    """Every device this process can put a rank on, in index order.

    NPU and CUDA: the devices torch sees (ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES already
    applied), or with H3KIT_SIM_DEVICES=N the process's device N times. CPU: one "cpu" entry per
    simulated device, at least one.
    """
    sim = sim_device_count()
    if device_kind() == "cpu":
        return [torch.device("cpu")] * max(1, sim)
    if sim:
        device = comfy.model_management.get_torch_device()
        if (device, sim) not in _sim_logged:
            _sim_logged.add((device, sim))
            logging.warning(f"MultiDevice: {SIM_DEVICES_ENV}={sim}: {sim} ranks share {device} (a simulation; "
                            f"unset {SIM_DEVICES_ENV} to use every visible device)")
        return [device] * sim
    return comfy.model_management.get_all_torch_devices()


def devices_for(primary: torch.device, count: int) -> list[torch.device]:
    """The devices ranks 0..count-1 use: the primary (where the model already loads) first, then the
    others in index order. Returns None when the process sees fewer than `count` devices."""
    devices = get_devices()
    if len(devices) < count:
        return None
    if primary.type == "cpu" or sim_device_count():
        return devices[:count]
    others = [d for d in devices if d != primary]
    return ([primary] + others)[:count]


def describe_devices(devices=None) -> str:
    """Human wording for a device list, used in error messages: "2 npu devices (npu:0, npu:1)"."""
    devices = get_devices() if devices is None else devices
    kind = devices[0].type if devices else device_kind()
    noun = "device" if len(devices) == 1 else "devices"
    sim = sim_device_count()
    if kind == "cpu":
        how = f"{SIM_DEVICES_ENV}={os.environ.get(SIM_DEVICES_ENV)}" if sim else f"{SIM_DEVICES_ENV} unset"
        return f"{len(devices)} simulated cpu {noun} ({how})"
    if sim:
        return f"{len(devices)} simulated {kind} {noun} on {devices[0]} ({SIM_DEVICES_ENV}={sim})"
    return f"{len(devices)} {kind} {noun} ({', '.join(str(d) for d in devices)})"


def set_device(device: torch.device):
    """Make `device` current for this thread (kernels launched from it go there). No-op on CPU."""
    comfy.model_management.set_torch_device(device)


def synchronize(device: torch.device):
    """Wait until every kernel queued on `device` has finished. No-op on CPU."""
    if device.type != "cpu":
        torch.get_device_module(device).synchronize(device)


def current_stream(device: torch.device):
    """The stream this thread queues work on for `device`; None on CPU."""
    if device.type == "cpu":
        return None
    return torch.get_device_module(device).current_stream(device)


def free_memory(device: torch.device) -> int:
    """Bytes free on `device` for a model and its activations: comfy.model_management.get_free_memory, except
    for a simulated cpu device with H3KIT_SIM_DEVICE_MEMORY=GB set, which is an empty card of that size (so
    the memory decisions of a multi-device run can be exercised on a host without accelerators)."""
    value = os.environ.get(SIM_MEMORY_ENV, "").strip()
    if device.type == "cpu" and value:
        try:
            return int(float(value) * 1e9)
        except ValueError:
            logging.warning(f"MultiDevice: ignoring {SIM_MEMORY_ENV}={value!r}: expected GB such as 64")
    return comfy.model_management.get_free_memory(device)


def device_context(device: torch.device):
    """Context manager making `device` current inside it (CUDA and NPU), restoring the previous one after."""
    return comfy.model_management.cuda_device_context(device)
