"""Pipeline parallelism: the module protocol, stage partitioning and the executor over torch.distributed.pipelining."""

from lightning_hybrid.core.protocol import (
    PROTOCOL_HELP,
    LayerwiseInit,
    PipelineAuxLoss,
    PipelineLayerContext,
    PipelineModule,
    SliceLoading,
    check_protocol,
)
from lightning_hybrid.parallel.pipeline.executor import SCHEDULES, PipelineExecutor, resolve_schedule, stage_module
from lightning_hybrid.parallel.pipeline.partition import partition_layers, stage_ranks

__all__ = [
    "PROTOCOL_HELP",
    "SCHEDULES",
    "LayerwiseInit",
    "PipelineAuxLoss",
    "PipelineExecutor",
    "PipelineLayerContext",
    "PipelineModule",
    "SliceLoading",
    "check_protocol",
    "partition_layers",
    "resolve_schedule",
    "stage_module",
    "stage_ranks",
]
