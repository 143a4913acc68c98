#!/usr/bin/env bash
# Start ComfyUI on four Ascend NPUs and return once it answers /system_stats with all four devices.
# `h3kit install` puts this script in the runtime root (<comfy-home>/.h3kit/run/). A thin wrapper over
# `h3kit start`; extra arguments are passed on (e.g. `-- --preview-method auto` for ComfyUI itself).
#
#   NPU_DEVICES         device ids, ascending, no spaces (default 0,1,2,3)
#   COMFYUI_PORT        port (default 8189); the server listens on 127.0.0.1 unless --listen is given
#   H3KIT_RUNTIME_ROOT  runtime root (default: the directory holding this script)
#   H3KIT_COMFY_HOME    the ComfyUI tree (default: two levels above the runtime root)
#   H3KIT_DEVICE_TYPE   npu (default), cuda or cpu
#   H3KIT_TRANSPORT     process (one process per NPU, HCCL; the default on npu), threads or auto
#   H3KIT               the h3kit command (default: h3kit on PATH)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=${H3KIT_RUNTIME_ROOT:-$here}
home=${H3KIT_COMFY_HOME:-$(cd "$root/../.." && pwd)}
read -r -a h3kit <<< "${H3KIT:-h3kit}"
exec "${h3kit[@]}" start --comfy-home "$home" --runtime-root "$root" \
    --devices "${NPU_DEVICES:-0,1,2,3}" --device-type "${H3KIT_DEVICE_TYPE:-npu}" \
    --port "${COMFYUI_PORT:-8189}" --transport "${H3KIT_TRANSPORT:-auto}" "$@"
