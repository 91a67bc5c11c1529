"""`ParallelOptions`: what a layout asks for beyond the sizes, validated once, frozen.

The sizes live in `lightning_hybrid.core.dims.ParallelDims` alone; `ParallelOptions.create` validates the other
arguments against them (every bad value is an error here, before any process exists). `HybridStrategy` hands both
to `lightning_hybrid.parallelize.parallelize` and `lightning_hybrid.grad_sync.GradientSync`; nothing below them
reads the strategy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch

from lightning_hybrid.checks.randomness import RANDOMNESS
from lightning_hybrid.core.dims import ParallelDims, validate_zero_stage
from lightning_hybrid.parallel.activation_checkpointing import Recompute, Selection, recompute_selection
from lightning_hybrid.parallel.compile import Compile, compile_options
from lightning_hybrid.parallel.context_parallel.ring import CP_ATTENTION
from lightning_hybrid.parallel.float8 import Float8, validate_float8, validate_float8_all_gather
from lightning_hybrid.parallel.pipeline import resolve_schedule
from lightning_hybrid.parallel.pipeline.executor import ScheduleSpec
from lightning_hybrid.parallel.zero import DEFAULT_BUCKET_CAP_MB, GRAD_REDUCE

PIPELINE_ARGUMENTS = ("schedule", "micro_batches", "virtual_stages", "split_points")


@dataclass(frozen=True)
class ParallelOptions:
    """Every option of the layout that is not a size, resolved: the schedule's spec and stages per rank, the
    recompute selection, the compile arguments. `create` validates; the fields are then what the steps of
    `parallelize` read."""

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
    batch_check_interval: int = 100  # after the first batches, every n-th batch is compared within its peers
    randomness: str = "exact"  # random ops: one device's draws or refused; "independent": per-rank streams
    grad_reduce: str = "auto"  # ZeRO-3 under accumulation: reduce-scatter each batch ("micro_batch") or once ("window")
    async_tp: bool = False  # compiled SP collectives fused with their matmuls (`parallel.compile.enable_async_tp`)
    fp8: Float8 = None  # torchao's float8 recipe or config for the linears (`lightning_hybrid.parallel.float8`)
    fp8_exclude: tuple[str, ...] = ()  # globs of linears kept in the training precision
    fp8_all_gather: bool = False  # ZeRO-3 gathers the float8 linears' weights in float8 (`parallel.float8_all_gather`)
    cp_attention: str = "all_gather"  # CP's keys and values: all-gathered, or around a ring (`context_parallel.ring`)
    overlap_param_gather: Optional[bool] = None  # ZeRO 1-2's gathers under the next forward (None: where possible)

    @classmethod
    def create(
        cls,
        dims: Optional[ParallelDims] = None,
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
        batch_check_interval: int = 100,
        randomness: str = "exact",
        grad_reduce: str = "auto",
        async_tp: bool = False,
        fp8: Float8 = None,
        fp8_exclude: Optional[list[str]] = None,
        fp8_all_gather: bool = False,
        cp_attention: str = "all_gather",
        overlap_param_gather: Optional[bool] = None,
    ) -> "ParallelOptions":
        """Validate the `HybridStrategy` arguments of the same names against the requested ``dims``.
        ``ValueError`` naming the bad value and what would be valid; an argument that nothing would use with these
        sizes is refused (`refuse_unused`)."""
        dims = dims if dims is not None else ParallelDims.request()
        tp, pp, cp = dims.tp, dims.pp, dims.cp
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
        validate_zero_stage(zero_stage)
        if grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"grad_reduce={grad_reduce!r} is invalid: use 'micro_batch' (ZeRO-3 reduce-scatters every"
                             " batch of an accumulation window into the sharded gradients), 'window' (once, after the"
                             " last: unsharded gradients kept through the window) or 'auto' (by memory).")
        if zero_stage != 3 and grad_reduce != "auto":
            raise ValueError(f"grad_reduce={grad_reduce!r} chooses when ZeRO-3 reduce-scatters under gradient"
                             f" accumulation; zero_stage={zero_stage} reduces its buckets once per window. Use"
                             " zero_stage=3, or leave grad_reduce='auto'.")
        if dims.dp_shard is not None and zero_stage != 3:
            raise ValueError(f"dp_shard={dims.dp_shard} shards ZeRO-3 within groups of dp_shard data-parallel ranks"
                             f" (hybrid sharding); zero_stage={zero_stage} does not shard parameters. Use zero_stage=3,"
                             " or leave dp_shard=None.")
        if dims.dp_shard is not None and dims.ep > 1:
            raise ValueError(f"dp_shard={dims.dp_shard} with ep={dims.ep}: hybrid sharding of expert-parallel experts"
                             " (sharded over their own data-parallel group) is not implemented; use dp_shard=None"
                             " (ZeRO-3 over the whole dp) with ep > 1.")
        selection = recompute_selection(recompute)
        arguments = compile_options(compile)
        if randomness == "independent" and tp > 1 and not sequence_parallel and arguments is not None:
            raise ValueError("randomness='independent' with tp > 1 and compile: each TP rank's stream is switched in"
                             " hooks at the TP layers, which torch.compile does not trace; use sequence_parallel=True"
                             " (every TP rank then has its own streams throughout), or compile=False.")
        if async_tp not in (True, False):
            raise ValueError(f"async_tp={async_tp!r} is invalid: use True or False.")
        if async_tp and (tp == 1 or not sequence_parallel or arguments is None):
            missing = [need for need, ok in (("tp > 1", tp > 1), ("sequence_parallel=True", sequence_parallel),
                                             ("compile=True", arguments is not None)) if not ok]
            raise ValueError(f"async_tp=True fuses the compiled layers' sequence-parallel all-gathers and"
                             f" reduce-scatters with their matmuls; it needs {', '.join(missing)} (got tp={tp},"
                             f" sequence_parallel={sequence_parallel}, compile={compile!r}).")
        validate_float8(fp8)
        fp8_all_gather = validate_float8_all_gather(fp8, fp8_all_gather, zero_stage)
        if fp8_exclude is not None and (isinstance(fp8_exclude, str)
                                        or not all(isinstance(p, str) for p in fp8_exclude)):
            raise ValueError(f"fp8_exclude={fp8_exclude!r} is invalid: use a list of glob patterns of module names"
                             " (e.g. ['lm_head', '*.mlp.*']).")
        if fp8_exclude and fp8 is None:
            raise ValueError(f"fp8_exclude={list(fp8_exclude)!r} names linears to keep out of FP8, but fp8=None trains"
                             " none in FP8; set fp8 (e.g. 'tensorwise'), or leave fp8_exclude unset.")
        if fp8 is not None and dims.ep > 1:
            raise ValueError(f"fp8={fp8!r} with ep={dims.ep}: the experts' tokens are exchanged over the EP group, and"
                             " scaling their float8 GEMMs as one device does is not implemented; use ep=1 with fp8,"
                             " or fp8=None.")
        if cp_attention not in CP_ATTENTION:
            raise ValueError(f"cp_attention={cp_attention!r} is invalid: use 'all_gather' (every rank gathers the whole"
                             " sequence's keys and values per layer; SDPA's kernels) or 'ring' (passed around the CP"
                             " group: two ranks' keys and values at a time).")
        if cp_attention != "all_gather" and cp == 1:
            raise ValueError(f"cp_attention={cp_attention!r} chooses how context parallelism's attention meets the"
                             " other ranks' keys and values; cp=1 has none. Use cp > 1, or leave cp_attention unset.")
        if cp > 1 and arguments is not None:
            raise ValueError(f"cp={cp} with compile={compile!r}: context parallelism catches each layer's attention"
                             " at run time, which torch.compile does not trace; use compile=False with cp > 1.")
        if overlap_param_gather not in (None, True, False):
            raise ValueError(f"overlap_param_gather={overlap_param_gather!r} is invalid: use None (ZeRO 1-2's parameter"
                             " all-gathers under the next forward wherever it can be done), True (required) or False"
                             " (gathered in the optimizer step).")
        if overlap_param_gather and zero_stage not in (1, 2):
            raise ValueError(f"overlap_param_gather=True overlaps ZeRO 1-2's all-gather of the updated parameters with"
                             f" the next forward; zero_stage={zero_stage} has none (stage 3 gathers each layer's"
                             " parameters in its forward). Use zero_stage 1 or 2, or leave overlap_param_gather=None.")
        if overlap_param_gather and arguments is not None:
            raise ValueError(f"overlap_param_gather=True with compile={compile!r}: a read of a parameter whose gather"
                             " is in flight is caught at run time, which torch.compile does not trace; use"
                             " compile=False, or leave overlap_param_gather=None (gathered in the step when compiled).")
        return cls(
            zero_stage=validate_zero_stage(zero_stage), bucket_cap_mb=float(bucket_cap_mb),
            tp_plan=MappingProxyType(dict(tp_plan)) if isinstance(tp_plan, Mapping) else tp_plan,
            sequence_parallel=bool(sequence_parallel), loss_parallel=bool(loss_parallel),
            schedule=schedule, schedule_default=schedule_default, schedule_spec=spec, stages_per_rank=per_rank,
            micro_batches=micro_batches,
            virtual_stages=virtual_stages, split_points=tuple(split_points) if split_points is not None else None,
            # anything but full recomputation checkpoints every layer unless told which
            activation_checkpointing=activation_checkpointing or selection is not None,
            recompute=selection, compile=MappingProxyType(arguments) if arguments is not None else None,
            batch_check_interval=batch_check_interval, randomness=randomness, grad_reduce=grad_reduce,
            async_tp=bool(async_tp), fp8=fp8, fp8_exclude=tuple(fp8_exclude or ()),
            fp8_all_gather=fp8_all_gather, cp_attention=cp_attention, overlap_param_gather=overlap_param_gather,
        )

    def defers_param_gather(self, module: torch.nn.Module) -> bool:
        """Whether ZeRO 1-2's gathers run under the next forward (`lightning_hybrid.parallel.zero.gather`) for
        ``module`` (the LightningModule): stages 1-2, nothing compiled -- neither by ``compile`` nor by the module
        itself (``torch.compile`` of a submodule or ``module.compile()``: a wait inside a compiled graph would break
        it) -- and automatic optimization (a manual ``training_step`` steps inside itself and reads on).
        ``ValueError`` where ``overlap_param_gather=True`` asked for it and cannot have it."""
        from torch._dynamo import OptimizedModule

        automatic = module.automatic_optimization
        compiled = [name or type(module).__name__ for name, m in module.named_modules()
                    if isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None]
        if self.overlap_param_gather and not automatic:
            raise ValueError("overlap_param_gather=True: the module uses manual optimization, whose training_step"
                             " steps the optimizers itself and may read the parameters right after; use automatic"
                             " optimization, or leave overlap_param_gather=None (gathered in the step).")
        if self.overlap_param_gather and compiled:
            raise ValueError(f"overlap_param_gather=True: {compiled[:3]} of the module are compiled, and a read that"
                             " waits for a parameter's gather would break their graphs; leave overlap_param_gather=None"
                             " (gathered in the step when anything is compiled), or do not compile them.")
        return (self.overlap_param_gather is not False and self.zero_stage in (1, 2) and self.compile is None
                and automatic and not compiled)

    def example_multiple(self, dims: ParallelDims) -> int:
        """Example inputs of the TP verification have a sequence length divisible by this (the SP split)."""
        return dims.tp if self.sequence_parallel else 1

    def data_error(self, data: Any) -> Optional[str]:
        """Why a data module or data loader cannot train under this layout (`batch_size_error` of the batch size it
        says it gives), or ``None``."""
        batch_size = _batch_size_of(data)
        return None if batch_size is None else self.batch_size_error(batch_size)

    def batch_size_error(self, batch_size: int) -> Optional[str]:
        """Why a training batch of ``batch_size`` samples per data-parallel rank cannot run, or ``None``
        (``micro_batches`` is set under ``pp > 1`` only)."""
        if self.micro_batches and batch_size % self.micro_batches != 0:
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


def _batch_size_of(data: Any) -> Optional[int]:
    """The per-rank training batch size a data module (``batch_size`` attribute or hyperparameter) or a data loader
    says it gives, else ``None``."""
    if isinstance(data, torch.utils.data.DataLoader):
        return data.batch_size
    if isinstance(data, pl.LightningDataModule):
        size = getattr(data, "batch_size", None)
        if size is None:
            size = getattr(data, "hparams", {}).get("batch_size")
        return size if isinstance(size, int) and not isinstance(size, bool) else None
    return None
