"""``torch.compile`` per layer, as TorchTitan does: each decoder block (or pipeline layer) is compiled on its own.

Compiling block by block keeps what the other dimensions rely on: parameter names and state dicts do not change
(``nn.Module.compile`` compiles the module's call in place, no ``_orig_mod`` wrapper), the pipeline cuts between
layers, FSDP2 shards each block after it is compiled, and identical blocks share one compiled graph (the
parameters are graph inputs), so compile time does not grow with the depth. TP and SP layers' collectives and
activation checkpointing (full or selective) are traced with the block, or run eagerly between its graphs where
dynamo cannot trace them (a graph break costs speed, never exactness).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

from torch import nn

Compile = Union[bool, Mapping[str, Any]]


def compile_options(compile: Compile) -> dict[str, Any] | None:
    """The keyword arguments of ``torch.compile`` that ``compile`` asks for (``True``: its defaults), or ``None``
    for no compilation. Raises ``ValueError`` for anything else."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return {}
    if isinstance(compile, Mapping):
        allowed = {"fullgraph", "dynamic", "backend", "mode", "options", "disable"}
        unknown = sorted(set(compile) - allowed)
        if unknown:
            raise ValueError(f"compile={dict(compile)!r}: {unknown} are not arguments of torch.compile;"
                             f" use {sorted(allowed)}.")
        return dict(compile)
    raise ValueError(f"compile={compile!r} is invalid: use True, False, or a dict of torch.compile arguments.")


def apply_compile(module: nn.Module, names: list[str], options: dict[str, Any]) -> None:
    """Compile each named submodule of ``module`` in place (``nn.Module.compile(**options)``).

    Starts from empty compile caches (``torch._dynamo.reset()``): graphs compiled for an earlier run in this
    process (a sweep's previous job) are guarded on that run's process groups; they would only count towards
    dynamo's recompile limit, past which it silently runs the layers eagerly."""
    import torch._dynamo

    torch._dynamo.reset()
    for name in names:
        module.get_submodule(name).compile(**options)
