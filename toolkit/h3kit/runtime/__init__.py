"""The multi-device runtime's toolkit side: the parity driver (run in the ComfyUI interpreter) and the cost model."""
