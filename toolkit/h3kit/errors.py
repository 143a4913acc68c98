"""Exception types the library raises; the CLI maps each to a message and an exit code.

Every error carries a stable machine `code` (for scripts reading `--json`), a human message, and where
possible a `hint` naming the fix. `exit_code` is 1 for a failed operation and 2 for bad input.
"""

from __future__ import annotations


class H3kitError(Exception):
    code = "error"
    exit_code = 1

    def __init__(self, message: str, *, code: str | None = None, hint: str | None = None,
                 details: dict | list | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.hint = hint
        self.details = details

    def to_dict(self) -> dict:
        """The "error" object of the --json document: code, message, fix (the hint, or None), details."""
        out = {"code": self.code, "message": self.message, "fix": self.hint}
        if self.details is not None:
            out["details"] = self.details
        return out


class UsageError(H3kitError):
    """Bad input on the command line or in a file the user gave: nothing was changed."""
    code = "bad_input"
    exit_code = 2


class DeviceListError(UsageError):
    code = "bad_device_list"


class NotAComfyTree(UsageError):
    """A --comfy-home that holds no ComfyUI tree: one code and one exit status (2) whichever command finds it."""
    code = "no_comfy_tree"

    def __init__(self, home, why: str = "no main.py", hint: str | None = None):
        super().__init__(f"{home} is not a ComfyUI tree ({why})",
                         hint=hint or "pass the --comfy-home that h3kit install created (h3kit install --comfy-home "
                                      "DIR makes one)")
