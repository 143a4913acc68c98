"""Count the bytes an operation writes, as torch executes it: how many full copies of its input it makes.

Used by the Ulysses exchange's copy test (tests/test_multinpu_collectives.py) and by
benchmarks/multinpu_memory.py. Run in the ComfyUI interpreter (it needs torch, imported here lazily).

Every aten operator that runs inside `WriteCounter` is seen through a TorchDispatchMode: a view writes nothing;
an uninitialised allocation (empty, new_empty, empty_like...) writes nothing, a filled one (zeros, full...)
writes its bytes; an in-place or out= operator writes the
tensors its schema marks as written (copy_'s destination, a collective's receive buffer); any other operator
writes its outputs. So `copies(fn, nbytes)` measures what a function materialises, not what its code says.
"""

from __future__ import annotations

# operators that write no tensor bytes: allocations left uninitialised, and aliases (names with "_" stripped)
_NO_WRITE = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "detach", "lift_fresh",
             "alias", "set", "unsafe_view"}


def _nbytes(t) -> int:
    import torch
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def WriteCounter():
    """A context manager; its `written` is the bytes written inside it and `ops` the operators that wrote them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.written = 0
            self.ops = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func.overloadpacket.__name__.strip("_") in _NO_WRITE or getattr(func, "is_view", False):
                return out
            schema = func._schema
            written = 0
            mutated = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            if mutated:
                values = dict(zip([a.name for a in schema.arguments], args))
                values.update(kwargs)
                written = sum(_nbytes(values.get(a.name)) for a in mutated)
            else:
                written = _nbytes(out)
            if written:
                self.written += written
                self.ops[str(func)] = self.ops.get(str(func), 0) + written
            return out

    return _Counter()


def copies(fn, nbytes: int):
    """(fn's result, the bytes it wrote / nbytes, {operator: bytes})."""
    with WriteCounter() as counter:
        result = fn()
    return result, counter.written / nbytes, counter.ops
