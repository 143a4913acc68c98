# The two commands a new user needs (README): `make demo` and `make test`.
# H3KIT_COMFY_SOURCE points install at an offline mirror of ComfyUI holding the pin (else the public URL).
COMFY_HOME ?= $(CURDIR)/comfyui
PYTEST_ARGS ?=

.PHONY: demo test env
env:
	@tools/ensure-venv.sh >/dev/null

demo:
	@py=$$(tools/ensure-venv.sh) && bin=$$(dirname "$$py") && \
	  "$$bin/h3kit" install --comfy-home "$(COMFY_HOME)" --python "$$py" && \
	  "$$bin/h3kit" verify --comfy-home "$(COMFY_HOME)"

test:
	@py=$$(tools/ensure-venv.sh) && "$$py" -m pytest $(PYTEST_ARGS)
