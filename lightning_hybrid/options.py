"""`ParallelOptions`: what a layout asks for beyond the mesh sizes, validated once, frozen.

`HybridStrategy` builds it from its arguments (every bad value is an error here, before any process exists) and
hands it to `lightning_hybrid.parallelize.parallelize` and `lightning_hybrid.grad_sync.GradientSync`; nothing
below them reads the strategy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Optional, Union

from lightning_hybrid.activation_checkpointing import Recompute, Selection, recompute_selection
from lightning_hybrid.compile import Compile, compile_options
from lightning_hybrid.mesh import ParallelDims, validate_zero_stage
from lightning_hybrid.pipeline import resolve_schedule
from lightning_hybrid.pipeline.executor import ScheduleSpec
from lightning_hybrid.randomness import RANDOMNESS
from lightning_hybrid.zero import DEFAULT_BUCKET_CAP_MB

PIPELINE_ARGUMENTS = ("schedule", "micro_batches", "virtual_stages", "split_points")


@dataclass(frozen=True)
class ParallelOptions:
    """The requested sizes (``dp=-1``: inferred from the world size by `ParallelDims.resolve`) and every option
    of the layout, resolved: the schedule's spec and stages per rank, the recompute selection, the compile
    arguments. `create` validates; the fields are then what the steps of `parallelize` read."""

    dp: int = -1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    tp_plan: Union[str, Mapping[str, Any]] = "auto"
    sequence_parallel: bool = False
    loss_parallel: bool = True
    schedule: Optional[str] = None  # the name (pp > 1)
    schedule_default: bool = False  # left to the default: 1F1B, GPipe for a module with a loss of the whole batch
    schedule_spec: Optional[ScheduleSpec] = None
    stages_per_rank: int = 1
    micro_batches: Optional[int] = None
    virtual_stages: Optional[int] = None
    split_points: Optional[tuple[int, ...]] = None
    activation_checkpointing: Union[bool, str] = False
    recompute: Optional[Selection] = None  # None: full recomputation of a checkpointed layer
    compile: Optional[Mapping[str, Any]] = None  # torch.compile's arguments; None: no compilation
    ep: int = 1  # expert parallelism: ranks (of the DP ones) that split each experts module
    cp: int = 1  # context parallelism: ranks that split each sequence
    batch_check_interval: int = 100  # after the first batches, every n-th batch is compared within its peers
    randomness: str = "exact"  # random ops: one device's draws or refused; "independent": per-rank streams

    @classmethod
    def create(
        cls,
        dp: int = -1,
        tp: int = 1,
        pp: int = 1,
        zero_stage: int = 0,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        tp_plan: Union[str, Mapping[str, Any]] = "auto",
        sequence_parallel: bool = False,
        loss_parallel: bool = True,
        micro_batches: Optional[int] = None,
        schedule: Optional[str] = None,
        virtual_stages: Optional[int] = None,
        split_points: Optional[list[int]] = None,
        activation_checkpointing: Union[bool, str] = False,
        recompute: Recompute = "full",
        compile: Compile = False,
        ep: int = 1,
        cp: int = 1,
        batch_check_interval: int = 100,
        randomness: str = "exact",
    ) -> "ParallelOptions":
        """Validate the `HybridStrategy` arguments of the same names. ``ValueError`` naming the bad value and
        what would be valid; an argument that nothing would use with these sizes is refused (`refuse_unused`)."""
        ParallelDims.check_sizes(dp, tp, pp)
        ParallelDims.check_cp(cp)
        ParallelDims.check_ep(ep, dp * cp if dp != -1 else -1)
        refuse_unused(pp=pp, tp=tp, schedule=schedule, micro_batches=micro_batches, virtual_stages=virtual_stages,
                      split_points=split_points, sequence_parallel=sequence_parallel, tp_plan=tp_plan)
        spec, per_rank, schedule_default = None, 1, pp > 1 and schedule is None
        if pp > 1:
            schedule, virtual_stages = schedule or "1f1b", virtual_stages or 1
            spec, per_rank, micro_batches = resolve_schedule(schedule, pp, micro_batches, virtual_stages)
        if not (tp_plan == "auto" or isinstance(tp_plan, Mapping)):
            raise ValueError(f"tp_plan={tp_plan!r} is invalid: use 'auto' or a dict of glob pattern -> style.")
        if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} is invalid: it must be a positive number of MiB.")
        interval = batch_check_interval
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f"batch_check_interval={interval!r} is invalid: it must be a positive integer (after the"
                             " first batches, every n-th batch is compared between the ranks that share it).")
        if randomness not in RANDOMNESS:
            raise ValueError(f"randomness={randomness!r} is invalid: use 'exact' (random ops draw what one device"
                             " draws, or the run is refused) or 'independent' (every rank's own streams: statistically,"
                             " not bitwise, one device's run).")
        selection = recompute_selection(recompute)
        arguments = compile_options(compile)
        if randomness == "independent" and tp > 1 and not sequence_parallel and arguments is not None:
            raise ValueError("randomness='independent' with tp > 1 and compile: each TP rank's stream is switched in"
                             " hooks at the TP layers, which torch.compile does not trace; use sequence_parallel=True"
                             " (every TP rank then has its own streams throughout), or compile=False.")
        if cp > 1 and arguments is not None:
            raise ValueError(f"cp={cp} with compile={compile!r}: context parallelism catches each layer's attention"
                             " at run time, which torch.compile does not trace; use compile=False with cp > 1.")
        return cls(
            dp=dp, tp=tp, pp=pp, zero_stage=validate_zero_stage(zero_stage), bucket_cap_mb=float(bucket_cap_mb),
            tp_plan=MappingProxyType(dict(tp_plan)) if isinstance(tp_plan, Mapping) else tp_plan,
            sequence_parallel=bool(sequence_parallel), loss_parallel=bool(loss_parallel),
            schedule=schedule, schedule_default=schedule_default, schedule_spec=spec, stages_per_rank=per_rank,
            micro_batches=micro_batches,
            virtual_stages=virtual_stages, split_points=tuple(split_points) if split_points is not None else None,
            # anything but full recomputation checkpoints every layer unless told which
            activation_checkpointing=activation_checkpointing or selection is not None,
            recompute=selection, compile=MappingProxyType(arguments) if arguments is not None else None, ep=ep,
            cp=cp, batch_check_interval=batch_check_interval, randomness=randomness,
        )

    @property
    def example_multiple(self) -> int:
        """Example inputs of the TP verification have a sequence length divisible by this (the SP split)."""
        return self.tp if self.sequence_parallel else 1

    def batch_size_error(self, batch_size: int) -> Optional[str]:
        """Why a training batch of ``batch_size`` samples per data-parallel rank cannot run, or ``None``."""
        if self.pp > 1 and self.micro_batches and batch_size % self.micro_batches != 0:
            valid = f"{self.micro_batches}, {2 * self.micro_batches}, ..."
            return (f"batch_size={batch_size} (per data-parallel rank) does not split into micro_batches="
                    f"{self.micro_batches}: use a multiple of micro_batches ({valid}), or another micro_batches.")
        return None


def refuse_unused(pp: int, tp: int, **given: Any) -> None:
    """``ValueError`` naming the arguments that were given but that nothing would use with this ``pp`` and ``tp``
    (every accepted argument is used or refused: a run never differs silently from what was asked)."""
    unused = [f"{k}={given[k]!r}" for k in PIPELINE_ARGUMENTS if pp == 1 and given.get(k) is not None]
    if tp == 1 and given.get("sequence_parallel"):
        unused.append(f"sequence_parallel={given['sequence_parallel']!r}")
    if tp == 1 and isinstance(given.get("tp_plan"), Mapping):
        unused.append(f"tp_plan={given['tp_plan']!r}")
    if unused:
        raise ValueError(
            f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} not used with pp={pp}, tp={tp}: the pipeline"
            f" arguments ({', '.join(PIPELINE_ARGUMENTS)}) need pp > 1, sequence_parallel and a tp_plan dict need"
            " tp > 1. Leave them unset for this layout."
        )
