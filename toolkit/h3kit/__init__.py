"""h3kit: install, patch, run and check a pinned ComfyUI for MiniMax H3 on 1, 2, 4 or 8 Ascend NPUs.

The library modules never import click; `h3kit.cli` is the thin command layer over them.
"""

__version__ = "0.1.0"
