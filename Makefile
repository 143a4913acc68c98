# The two commands a new user needs (README): `make demo` and `make test`.
# H3KIT_COMFY_SOURCE points install at an offline mirror of ComfyUI holding the pin (else the public URL).
COMFY_HOME ?= $(CURDIR)/comfyui
NPU_COUNT ?= 2
DEVICE_TYPE ?= auto
PYTEST_ARGS ?=

.PHONY: demo test env
env:
	@tools/ensure-venv.sh >/dev/null

demo:
	@py=$$(tools/ensure-venv.sh) && "$$(dirname "$$py")/h3kit" demo --comfy-home "$(COMFY_HOME)" \
	  --python "$$py" --device-type "$(DEVICE_TYPE)" --npu-count "$(NPU_COUNT)"

test:
	@py=$$(tools/ensure-venv.sh) && "$$py" -m pytest $(PYTEST_ARGS)
