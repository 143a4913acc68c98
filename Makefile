# The two commands a new user needs (README): `make demo` and `make test`.
# H3KIT_COMFY_SOURCE points install at an offline mirror of ComfyUI holding the pin (else the public URL).
COMFY_HOME ?= $(CURDIR)/comfyui
NPU_COUNT ?= 2
DEVICE_TYPE ?= auto
PYTEST_ARGS ?=
# the other supported Pythons that run the torch-free tests beside the main run (empty: none)
TEST_PYTHONS ?= 3.10 3.13

.PHONY: demo test env
env:
	@tools/ensure-venv.sh >/dev/null

# On an NPU or NVIDIA host the CPU environment ensure-venv builds cannot drive the cards: h3kit.demohost decides
# first, building nothing, with doctor's device detection. COMFY_PYTHON: an interpreter with the device's torch and
# h3kit (on NPU, CANN's wrapper), used as it is; DEVICE_TYPE=cpu: the CPU simulation on any host.
COMFY_PYTHON ?=
BOOT_PYTHON := $(or $(H3KIT_BOOTSTRAP_PYTHON),$(shell command -v python3.11 || command -v python3))
demo:
	@what=$$(PYTHONPATH="$(CURDIR)/toolkit" "$(BOOT_PYTHON)" -m h3kit.demohost "$(DEVICE_TYPE)" "$(COMFY_PYTHON)") || exit 2; \
	if [ "$$what" = python ]; then \
	  "$(COMFY_PYTHON)" -m h3kit demo --comfy-home "$(COMFY_HOME)" --python "$(COMFY_PYTHON)" --device-type "$(DEVICE_TYPE)" \
	    --npu-count "$(NPU_COUNT)"; \
	else \
	  py=$$(tools/ensure-venv.sh) && "$$(dirname "$$py")/h3kit" demo --comfy-home "$(COMFY_HOME)" \
	    --python "$$py" --device-type "$(DEVICE_TYPE)" --npu-count "$(NPU_COUNT)"; \
	fi

test:
	@py=$$(tools/ensure-venv.sh) && H3KIT_TEST_PYTHONS="$(TEST_PYTHONS)" tools/run-tests.sh "$$py" $(PYTEST_ARGS)

# Follow upstream: rebase, install, verify, parity gates, upstream's unit tests on both trees, the node matrix at 2
# devices, one table (tools/follow_upstream.py; docs/upstream.md). REV: a branch, tag or commit of the source.
REV ?= master
.PHONY: follow-upstream
follow-upstream:
	@py=$$(tools/ensure-venv.sh) && "$$py" tools/follow_upstream.py --onto "$(REV)"
