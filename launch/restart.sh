#!/usr/bin/env bash
# Restart ComfyUI with the settings it was started with: refuses while prompts run or wait (pass --force
# to drop them), shows the first error of the previous run (an OOM says so), stops the server, waits for
# the port, starts it and waits until it is healthy. When nothing was ever started here, starts it with
# NPU_DEVICES and COMFYUI_PORT instead (see start-4npu.sh for the variables).
# `h3kit install` puts this script in the runtime root. A thin wrapper over `h3kit restart`.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=${H3KIT_RUNTIME_ROOT:-$here}
home=${H3KIT_COMFY_HOME:-$(cd "$root/../.." && pwd)}
read -r -a h3kit <<< "${H3KIT:-h3kit}"
if [ ! -e "$root/server.json" ]; then
    exec "$here/start-4npu.sh"
fi
exec "${h3kit[@]}" restart --comfy-home "$home" --runtime-root "$root" "$@"
