"""The layout planner: predicted per-device peak memory and step time of every layout of a model on a
cluster, ranked (docs/planner.md).

    from lightning_hybrid.planner import ModelSpec, load_cluster, plan
    result = plan(ModelSpec.from_gpt(config), load_cluster("a100"), devices=64, global_batch=512)
    result.best.layout.strategy_kwargs()     # HybridStrategy(**...)

``python -m lightning_hybrid.planner --model gpt3-175b --cluster a100 --devices 1024 --global-batch 1536``
prints the ranked table (mixture-of-experts models: expert parallelism ``ep`` searched too, `all_to_all_bytes` the
expert all-to-all volume; long sequences: context parallelism ``cp`` searched too, `kv_exchange_bytes` the key/value
exchange's volume); ``python -m lightning_hybrid.planner calibrate`` measures this machine.
"""

from .cluster import CLUSTER_PRESETS, Cluster, Link, calibrate, cpu_cluster, load_cluster
from .layout import Layout
from .memory import MemoryEstimate, estimate_memory
from .model import MODEL_PRESETS, ModelSpec, hf_config, hf_notes, hf_parameter_count, model_spec
from .search import Candidate, Plan, evaluate, plan
from .time import TimeEstimate, all_to_all_bytes, estimate_time, kv_exchange_bytes

__all__ = ["CLUSTER_PRESETS", "Candidate", "Cluster", "Layout", "Link", "MODEL_PRESETS", "MemoryEstimate",
           "ModelSpec", "Plan", "TimeEstimate", "all_to_all_bytes", "calibrate", "cpu_cluster", "estimate_memory",
           "estimate_time", "evaluate", "hf_config", "hf_notes", "hf_parameter_count", "kv_exchange_bytes",
           "load_cluster", "model_spec", "plan"]
