"""Pipeline parallelism: the layer protocol, stage partitioning and the executor over torch.distributed.pipelining."""

from lightning_hybrid.pipeline.executor import SCHEDULES, PipelineExecutor, resolve_schedule, stage_module
from lightning_hybrid.pipeline.partition import PROTOCOL_HELP, check_protocol, partition_layers, stage_ranks

__all__ = [
    "PROTOCOL_HELP",
    "SCHEDULES",
    "PipelineExecutor",
    "check_protocol",
    "partition_layers",
    "resolve_schedule",
    "stage_module",
    "stage_ranks",
]
