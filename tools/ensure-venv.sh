#!/usr/bin/env bash
# Build once, then reuse, the Python environment that runs the pinned ComfyUI, the toolkit and the tests.
# Prints the environment's python on stdout; everything else goes to stderr.
#
#   H3KIT_CACHE             where environments and test data live (default ~/.cache/h3kit)
#   H3KIT_BOOTSTRAP_PYTHON  the interpreter the environment is made from (default python3.11)
#
# The environment (about 7 GB) is keyed by the hash of its requirement files, so a change to them builds a
# new one beside the old; an interrupted build is detected by a missing completion marker and redone.
set -euo pipefail
install_toolkit=1
[ "${1:-}" = "--no-toolkit" ] && install_toolkit=0   # worktrees: use PYTHONPATH=<tree>/toolkit instead
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${H3KIT_CACHE:-$HOME/.cache/h3kit}
base_py=${H3KIT_BOOTSTRAP_PYTHON:-python3.11}
runtime_req=$root/toolkit/requirements/comfy-runtime-cpu.txt
test_req=$root/toolkit/requirements/test.txt
templates_version=0.1.123   # comfyui-workflow-templates-json: upstream H3 templates used as test data

key=$(cat "$runtime_req" "$test_req" | sha256sum | cut -c1-12)
venv=$cache/venv-$key
mkdir -p "$cache"
say() { printf 'ensure-venv: %s\n' "$*" >&2; }

exec 9>"$cache/.venv-$key.lock"
flock 9   # a second caller (CI beside a session) waits for the first build instead of racing it

if [ ! -f "$venv/.h3kit-complete" ]; then
  command -v "$base_py" >/dev/null || { say "no $base_py on PATH: set H3KIT_BOOTSTRAP_PYTHON to a Python 3.10-3.12 interpreter"; exit 1; }
  say "building the ComfyUI environment in $venv (about 7 GB, a few minutes, once)"
  rm -rf "$venv"
  "$base_py" -m venv "$venv"
  log=$cache/.venv-$key.build.log
  { "$venv/bin/python" -m pip install -q --upgrade pip \
    && "$venv/bin/python" -m pip install -q --no-deps -r "$runtime_req" \
    && "$venv/bin/python" -m pip install -q -r "$test_req"; } >"$log" 2>&1 \
    || { tail -n 40 "$log" >&2; say "building the environment failed (log: $log)"; exit 1; }
  "$venv/bin/python" -c 'import torch, torchaudio, torchvision, comfy_kitchen, git' >&2
  touch "$venv/.h3kit-complete"
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
