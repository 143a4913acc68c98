"""The torch the project pairs with each device kind (source_deps_info.json) as the pip line that installs it.

Its own module so that doctor (which prints it as a fix) and the service (whose start refuses an interpreter without
torch, naming it) both import it without importing each other (tests/test_import_cycles.py).
"""

from __future__ import annotations

import shlex


def torch_install_line(data: dict, kind: str, python: str, only_audio: bool = False) -> str:
    """The exact pip command that puts source_deps_info.json's pairing for `kind` into `python` (the commands
    of docs/deployment.md, section 0). torchaudio goes in with --no-deps: the newest on the registry declares
    an older torch but imports and resamples fine with the paired one."""
    cpu = data["torch"]["cpu"]
    py = shlex.quote(str(python))
    audio = f"{py} -m pip install --no-deps torchaudio=={cpu['torchaudio']}"
    if only_audio:
        return audio
    index = "--index-url https://download.pytorch.org/whl/cpu"
    if kind == "npu":
        entry = data["torch"]["npu"][0]
        return (f"{py} -m pip install torch=={entry['torch']} {index} && {py} -m pip install "
                f"torch-npu=={entry['torch_npu']} && {audio}; then install CANN {entry['cann']} and pass --python a "
                "wrapper that sources its set_env.sh (docs/deployment.md, 'A new machine')")
    if kind == "cuda":
        return (f"{py} -m pip install torch=={cpu['torch']} torchvision=={cpu['torchvision']} (the CUDA build "
                f"for this driver: https://pytorch.org/get-started/locally/) && {audio}")
    return f"{py} -m pip install torch=={cpu['torch']} torchvision=={cpu['torchvision']} {index} && {audio}"
