"""Checks that the package states the device of every tensor it creates.

A factory call without a device (``torch.empty(shape)``, ``torch.randn(shape, generator=g)``) makes its tensor on
the *ambient* device: the CPU in a plain process, the GPU inside Lightning's init context (``with
torch.device("cuda")``). A CPU generator then meets a CUDA tensor -- the crash the reference GPT had on its first
GPU -- and a tensor meant for the CPU lands on the GPU, or the reverse. CPU-only tests cannot see it: on the CPU
the ambient device and every generator agree. Two checks can:

* `scan_source`: every call of a torch factory in the package's source names its ``device`` (statically, every
  code path);
* `AmbientDeviceAudit`: while it is active, every factory call made directly from the package's code with no
  device (or ``device=None``, which a helper may pass on) is recorded with its file and line (at run time).

``*_like`` and ``Tensor.new_*`` calls take their device from a tensor and are not factories here.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

PACKAGE_ROOT = Path(__file__).resolve().parent

#: torch functions that create a tensor whose device is the ambient one unless ``device=`` is given.
FACTORY_NAMES = frozenset({
    "arange", "as_tensor", "asarray", "empty", "empty_permuted", "empty_strided", "eye", "full", "linspace",
    "logspace", "normal", "ones", "rand", "randint", "randn", "randperm", "range", "scalar_tensor", "tensor",
    "tril_indices", "triu_indices", "zeros",
})
_FACTORIES = frozenset(getattr(torch, name) for name in FACTORY_NAMES)
_TORCH_ROOT = Path(torch.__file__).resolve().parent


def scan_source(paths: Iterable[Path]) -> list[str]:
    """``file:line: call`` of every ``torch.<factory>(...)`` and ``torch.Generator(...)`` call in ``paths`` (Python
    files) that names no device (a ``device=`` keyword; ``torch.Generator``'s device may also be positional)."""
    found = []
    for path in paths:
        tree = ast.parse(Path(path).read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner, name = node.func.value, node.func.attr
            if not (isinstance(owner, ast.Name) and owner.id == "torch"):
                continue
            keywords = {k.arg for k in node.keywords}
            if name in FACTORY_NAMES and "device" not in keywords and None not in keywords:
                found.append(f"{path}:{node.lineno}: torch.{name}(...) names no device")
            elif name == "Generator" and "device" not in keywords and not node.args:
                found.append(f"{path}:{node.lineno}: torch.Generator() names no device")
    return found


def package_sources() -> list[Path]:
    """The package's Python files."""
    return sorted(PACKAGE_ROOT.rglob("*.py"))


class AmbientDeviceAudit(TorchFunctionMode):
    """Records the factory calls made from code under ``roots`` (default: this package) that leave the device
    to the ambient one: ``calls`` lists ``"file:line: torch.<name>"``. Enter it innermost (after any
    ``torch.device(...)`` context), since such a context fills the device in before an outer mode sees the call."""

    def __init__(self, roots: Optional[Iterable[Path]] = None) -> None:
        super().__init__()
        self.roots = [Path(r).resolve() for r in (roots or [PACKAGE_ROOT])]
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None:
            where = self._caller()
            if where is not None and where not in self.calls:
                self.calls.append(where)
        return func(*args, **kwargs)

    def _caller(self) -> Optional[str]:
        """The frame that called the factory, if it is under one of ``roots``. Only direct calls count: a module
        constructor (``nn.Linear(...)``) builds its parameters on the ambient device by design -- that is how
        Lightning's init context and the meta device place a model."""
        frame: Any = sys._getframe(2)
        # Past torch's dispatch and the other modes that pass the call on (another mode's __torch_function__: the
        # package's probes forward the calls they watch).
        while frame is not None and (Path(frame.f_code.co_filename).resolve() in _DISPATCH_FILES
                                     or frame.f_code.co_name == "__torch_function__"):
            frame = frame.f_back
        if frame is None:
            return None
        path = Path(frame.f_code.co_filename).resolve()
        if any(root == path or root in path.parents for root in self.roots):
            return f"{path}:{frame.f_lineno}: a torch factory in {frame.f_code.co_name}() names no device"
        return None


#: torch's own frames between a factory call and a mode's ``__torch_function__``.
_DISPATCH_FILES = frozenset(
    (_TORCH_ROOT / f).resolve() for f in ("overrides.py", "utils/_device.py", "_tensor.py", "functional.py")
)
