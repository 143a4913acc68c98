#!/usr/bin/env bash
# Build once, then reuse, the Python environment that runs the pinned ComfyUI, the toolkit and the tests.
# Prints the environment's python on stdout; everything else goes to stderr.
#
#   H3KIT_CACHE             where environments and test data live (default ~/.cache/h3kit)
#   H3KIT_BOOTSTRAP_PYTHON  the interpreter the environment is made from (default python3.11)
#
# The environment (about 7 GB) is keyed by the hash of comfy-runtime-cpu.txt alone, so a change to it builds a
# new one beside the old; test.txt (the toolkit's dependencies and the test tools) is a cheap layer installed on
# top, with its own completion marker keyed by its hash, so editing it adds packages in seconds instead of
# rebuilding the 7 GB. An interrupted build or layer is detected by a missing marker and redone. While it builds,
# it says which packages it is installing.
set -euo pipefail
install_toolkit=1
[ "${1:-}" = "--no-toolkit" ] && install_toolkit=0   # worktrees: use PYTHONPATH=<tree>/toolkit instead
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${H3KIT_CACHE:-$HOME/.cache/h3kit}
base_py=${H3KIT_BOOTSTRAP_PYTHON:-python3.11}
runtime_req=$root/toolkit/requirements/comfy-runtime-cpu.txt
test_req=$root/toolkit/requirements/test.txt
templates_version=0.1.123   # comfyui-workflow-templates-json: upstream H3 templates used as test data

key=$(sha256sum <"$runtime_req" | cut -c1-12)
test_key=$(sha256sum <"$test_req" | cut -c1-12)
venv=$cache/venv-$key
mkdir -p "$cache"
say() { printf 'ensure-venv: %s\n' "$*" >&2; }
# pip -r REQ into the environment, its full output in LOG, the packages it fetches and installs said on stderr
pip_layer() {
  local log=$1; shift
  set +e
  "$venv/bin/python" -m pip install --progress-bar off "$@" 2>&1 | tee -a "$log" \
    | grep --line-buffered -E '^(Collecting |Installing collected packages: |Successfully installed )' \
    | sed -u -e 's/ (from .*//' -e 's/^Collecting /  fetching /' -e 's/^Installing collected packages: /  unpacking: /' \
        -e 's/^/ensure-venv: /' >&2
  local rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

exec 9>"$cache/.venv-$key.lock"
flock 9   # a second caller (CI beside a session) waits for the first build instead of racing it

if [ ! -f "$venv/.h3kit-complete" ]; then
  command -v "$base_py" >/dev/null || { say "no $base_py on PATH: set H3KIT_BOOTSTRAP_PYTHON to a Python 3.10-3.12 interpreter"; exit 1; }
  say "building the ComfyUI environment in $venv (about 7 GB, a few minutes, once): torch, torchvision, torchaudio and ComfyUI's requirements from $runtime_req"
  rm -rf "$venv"
  "$base_py" -m venv "$venv"
  log=$cache/.venv-$key.build.log
  : >"$log"
  # --no-compile, then compileall on every core: pip byte-compiles the ~7 GB one file at a time (151 s against
  # 87 + 38 s on this 2-core machine, 2026-12-02); compileall reports the files that never compile (other Pythons'
  # syntax in test data) as pip silently skips them, so its status is not the build's
  { pip_layer "$log" -q --upgrade pip && pip_layer "$log" --no-compile --no-deps -r "$runtime_req"; } \
    || { tail -n 40 "$log" >&2; say "building the environment failed (log: $log)"; exit 1; }
  say "byte-compiling the environment"
  "$venv/bin/python" -m compileall -q -j 0 "$venv/lib" >>"$log" 2>&1 || true
  "$venv/bin/python" -c 'import torch, torchaudio, torchvision, comfy_kitchen' >&2
  touch "$venv/.h3kit-complete"
fi

if [ ! -f "$venv/.h3kit-test-$test_key" ]; then
  say "installing the toolkit's dependencies and the test tools from $test_req"
  log=$cache/.venv-$key.test-$test_key.log
  : >"$log"
  pip_layer "$log" -r "$test_req" || { tail -n 40 "$log" >&2; say "installing $test_req failed (log: $log)"; exit 1; }
  "$venv/bin/python" -c 'import click, psutil, yaml, websocket, packaging, pytest, xdist' >&2
  rm -f "$venv"/.h3kit-test-*
  touch "$venv/.h3kit-test-$test_key"
fi

templates=$cache/testdata/workflow-templates-json-$templates_version
if [ ! -f "$templates/.h3kit-complete" ]; then
  say "fetching the upstream H3 workflow templates (comfyui-workflow-templates-json==$templates_version)"
  rm -rf "$templates"
  "$venv/bin/python" -m pip install -q --no-deps --target "$templates" "comfyui-workflow-templates-json==$templates_version" \
    >"$cache/.templates.log" 2>&1 || { cat "$cache/.templates.log" >&2; exit 1; }
  touch "$templates/.h3kit-complete"
fi

# The toolkit itself, editable, pointing at this checkout (cheap; re-run on every call so a new clone takes over).
if [ "$install_toolkit" = 1 ]; then
  "$venv/bin/python" -m pip install -q --no-deps -e "$root" >"$cache/.pip-toolkit.log" 2>&1 \
    || { cat "$cache/.pip-toolkit.log" >&2; say "installing the toolkit failed"; exit 1; }
fi
echo "$venv/bin/python"
