"""Run ComfyUI's main.py with every weight-file read logged (test support, not shipped).

    python count_loads.py main.py --cpu --listen 127.0.0.1 --port P ...

Wraps comfy.utils.load_torch_file, the one function every upstream loader reads weights through, so the
same count works on the unpatched pin and on the patched tree. Each read prints `H3KIT-LOAD <path>` on
stderr (the server log). The wrap happens when main.py itself first imports comfy.utils: importing it
earlier would parse the command line before main.py enables argument parsing.
"""

import importlib.abc
import importlib.util
import os
import runpy
import sys


def _log(ckpt):
    sys.stderr.write(f"H3KIT-LOAD {ckpt}\n")
    sys.stderr.flush()


def _wrap(module):
    from h3kit.runtime import reads  # the one read counter (the tests put h3kit's toolkit on PYTHONPATH)
    reads.count(module, on_read=_log)


class _WrapOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "comfy.utils":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            _wrap(module)

        spec.loader.exec_module = exec_and_wrap
        return spec


sys.path.insert(0, os.getcwd())
sys.argv = sys.argv[1:]
sys.meta_path.insert(0, _WrapOnImport())
runpy.run_path(sys.argv[0], run_name="__main__")
