"""Every weight-file read of a ComfyUI process, counted: upstream's loaders all read through
comfy.utils.load_torch_file, so wrapping it counts the same reads on the unpatched pin and the patched tree.

One counter for the parity worker and the test support's scripts (tests/support: count_loads.py, the check
scripts, the model-cache wiring), in the ComfyUI interpreter; imports nothing (the caller hands over its
comfy.utils module).
"""

from __future__ import annotations

import collections
import os


def count(utils, on_read=None) -> collections.Counter:
    """Wrap utils.load_torch_file (utils: the comfy.utils module) so that every read from now on adds one to the
    returned Counter under the file's real path, and calls on_read(path as given) when set."""
    counts = collections.Counter()
    real = utils.load_torch_file

    def counted(ckpt, *args, **kwargs):
        counts[os.path.realpath(ckpt)] += 1
        if on_read is not None:
            on_read(ckpt)
        return real(ckpt, *args, **kwargs)

    utils.load_torch_file = counted
    return counts
