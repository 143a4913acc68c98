"""The stand-in's command-line options, written for h3kit's tests in the form ComfyUI's comfy/cli_args.py
has (NOT ComfyUI's file): tests copy it to `comfy/cli_args.py` in a fake ComfyUI home, where h3kit reads
its options to check the arguments after `start --`, and the stand-in server parses its own arguments with
it, so a bad one ends the server with argparse's usage and `main.py: error: ...`, as ComfyUI would.
"""

import argparse
import enum
import os


class PreviewMethod(enum.Enum):
    NoPreviews = "none"
    Auto = "auto"


class EnumAction(argparse.Action):
    """Values given as the enum's strings, stored as its members (the choices are the enum's values)."""

    def __init__(self, **kwargs):
        self.enum_type = kwargs.pop("type")
        kwargs.setdefault("choices", tuple(e.value for e in self.enum_type))
        super().__init__(**kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.enum_type(values))


def existing_folder(path: str) -> str:
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"The path '{path}' does not exist.")
    return path


parser = argparse.ArgumentParser()

parser.add_argument("--listen", type=str, default="127.0.0.1", metavar="IP", nargs="?", const="0.0.0.0,::")
parser.add_argument("--port", type=int, default=8188)
parser.add_argument("--tls-keyfile", type=str)
parser.add_argument("--cuda-device", type=str, default=None)
parser.add_argument("--directml", type=int, nargs="?", const=-1)
parser.add_argument("--preview-method", type=PreviewMethod, default=PreviewMethod.NoPreviews, action=EnumAction)
parser.add_argument("--preview-size", type=int, default=512)
parser.add_argument("--front-end-root", type=existing_folder, default=None)
parser.add_argument("--verbose", nargs="*", default=[])
parser.add_argument("--disable-smart-memory", action="store_true")
parser.add_argument("--output-directory", type=str, default=None)
parser.add_argument("--temp-directory", type=str, default=None)

vram_group = parser.add_mutually_exclusive_group()
vram_group.add_argument("--highvram", action="store_true")
vram_group.add_argument("--cpu", action="store_true")
