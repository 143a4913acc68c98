"""What one gc.collect() of the server costs before and after server-gc-freeze-after-start.patch: the server's start
(ComfyUI's modules, torch, the nodes) done in this process, then gc.collect() timed with every object of the start
tracked (upstream: what the prompt worker's collect after each prompt walks, holding the GIL) and after gc.freeze()
(the patch), alternately, in one run.

    PYTHONPATH=TREE python benchmarks/gc_freeze.py --comfy-home TREE [--repeats 5]

TREE: an installed tree (`h3kit install`); run with the interpreter that runs ComfyUI, from any folder.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import time


def collect_ms() -> float:
    t0 = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t0) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfy-home", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    os.chdir(args.comfy_home)
    sys.path.insert(0, os.path.abspath(args.comfy_home))
    sys.argv = ["main.py", "--cpu"]
    t0 = time.perf_counter()
    import comfy.options
    comfy.options.enable_args_parsing()
    import execution  # noqa: F401  (the modules main.py imports before it serves)
    import nodes
    import server  # noqa: F401
    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True))
    print(f"the start: {time.perf_counter() - t0:.1f} s, {len(gc.get_objects())} objects tracked; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    tracked, frozen = [], []
    for _ in range(args.repeats):  # alternately: the host's load drifts
        tracked.append(collect_ms())
        gc.freeze()
        frozen.append(collect_ms())
        gc.unfreeze()
    for name, ms in (("every object of the start tracked (upstream)", tracked),
                     ("the start's objects frozen (the patch)", frozen)):
        print(f"gc.collect(), {name}: median {statistics.median(ms):.1f} ms "
              f"({', '.join(f'{x:.1f}' for x in ms)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
