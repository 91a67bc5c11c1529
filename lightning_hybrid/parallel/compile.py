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


def enable_async_tp(tp_group, device) -> None:
    """Asynchronous (micro-pipelined) TP: Inductor's ``micro_pipeline_tp`` pass (as TorchTitan enables it) fuses each
    sequence-parallel all-gather with the matmul that reads it, and each matmul with the reduce-scatter of its
    output, into symmetric-memory kernels that compute on the chunks already received while the rest is in flight.
    It rewrites the compiled layers' functional collectives (`lightning_hybrid.core.collectives` issues them under
    ``torch.compile``), so it needs ``compile``, ``sequence_parallel`` and ``tp > 1`` (`ParallelOptions.create`
    checks) and CUDA with NCCL: symmetric memory exists only there. ``ValueError`` on any other device or backend,
    alike on every rank, before any collective. The fused kernels compute the same products and sums in another
    order: equal within the run's floating-point tolerance, not bitwise (checked on a GPU by
    ``benchmarks/gpu_check.py`` where one is lent with two or more devices)."""
    import torch
    import torch.distributed as dist

    backend = dist.get_backend(tp_group)
    if device.type != "cuda" or backend != "nccl":
        raise ValueError(
            f"async_tp=True needs CUDA with NCCL: torch's micro-pipelined TP runs on symmetric memory, which exists on"
            f" CUDA devices only; this run is on {device.type} with {backend}. Use async_tp=False (the TP collectives"
            " then run between the matmuls, as they do without it)."
        )
    torch._inductor.config._micro_pipeline_tp = True
