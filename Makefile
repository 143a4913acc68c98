# The two commands a new user needs (README): `make demo` and `make test`.
# H3KIT_COMFY_SOURCE points install at an offline mirror of ComfyUI holding the pin (else the public URL).
COMFY_HOME ?= $(CURDIR)/comfyui
PYTEST_ARGS ?=

.PHONY: demo test env
env:
	@tools/ensure-venv.sh >/dev/null

demo:
	@py=$$(tools/ensure-venv.sh) && "$$(dirname "$$py")/h3kit" demo --comfy-home "$(COMFY_HOME)"

test:
	@py=$$(tools/ensure-venv.sh) && H3KIT_TEMPLATES_DIR=$${H3KIT_TEMPLATES_DIR:-} "$$py" -m pytest $(PYTEST_ARGS)
