"""The planner in the recipes: ``parallel=auto`` picks the layout, and every run records the planner's
prediction for its own layout (``predicted_*`` in ``metrics.json``, shown by the sweep summary).

``parallel=auto`` (``configs/parallel/auto.yaml``) sets the top-level ``planner`` node (`AutoLayoutConfig`).
`choose_layout` then plans the recipe's model on the machine it runs on -- ``trainer.devices x num_nodes`` devices
(null: every CUDA device, or every CPU core) of ``planner.cluster`` (null: this machine, `this_machine`) -- for the
global batch ``planner.global_batch`` (null: ``data.batch_size x trainer.accumulate_grad_batches``, the batch one
device would step on, so the run stays comparable to ``parallel=single``), and writes the best layout into the
config: the ``parallel`` arguments (``ep`` and ``cp`` among them when the layout has them, and the strategy takes
them: the search tries context parallelism only for a strategy with a ``cp`` argument, and ring attention,
``cp_attention="ring"``, only for a model known to attend without dropout), ``data.batch_size`` (a
replica's batch: the ``cp`` ranks of a replica share its samples), and ``trainer.accumulate_grad_batches`` and
``trainer.devices`` (``dp tp pp cp`` over the nodes). ``parallel.fp8`` is planned as FP8 where the planner models
it (`_fp8`: a cluster with float8 tensor cores), else as bf16. Every rank plans the same way from the same inputs,
so the ranks Lightning starts agree with rank 0 without a message passed.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from .cluster import Cluster, cpu_cluster, load_cluster
from .float8 import check_fp8
from .layout import Layout
from .memory import estimate_memory
from .model import ModelSpec, hf_config
from .search import Plan, plan
from .time import estimate_time

__all__ = ["AutoLayoutConfig", "choose_layout", "predicted_metrics", "this_machine"]


@dataclass
class AutoLayoutConfig:
    """``planner`` node of a recipe (set by ``parallel=auto``): ``cluster`` a preset or cluster JSON (null:
    `this_machine`); ``global_batch`` sequences per optimizer step (null: ``data.batch_size x
    trainer.accumulate_grad_batches``); ``show``: how many ranked layouts the log lists; ``documents``: the
    batches hold documents (packed, padded), whose attention takes a mask (null: when the data config packs or
    pads rows, `lightning_hybrid.data.sft.SFTDataModule`'s ``pack``)."""

    cluster: Optional[str] = None
    global_batch: Optional[int] = None
    show: int = 5
    documents: Optional[bool] = None


def this_machine(accelerator: str) -> Cluster:
    """The cluster the recipe runs on: CUDA A100 / H100 by device name, else this CPU machine (`cpu_cluster`)."""
    if accelerator in ("cuda", "gpu"):
        import torch

        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
        for preset in ("a100", "h100"):
            if preset in name.lower():
                return load_cluster(preset)
        raise ValueError(f"no cluster preset for the GPU {name!r}: set planner.cluster to a cluster JSON.")
    return cpu_cluster()


def _model(cfg: DictConfig, module: Any = None) -> ModelSpec:
    """The recipe's model: `GPTLightningModule` fields, a `CausalLM`'s Hugging Face config, or any other
    module (``module`` if the run built it already, else built here) counted (`ModelSpec.from_module`)."""
    from lightning_hybrid.models import GPTConfig

    node, target = cfg.model, str(cfg.model.get("_target_", ""))
    seq_len = cfg.data.get("block_size")
    if target.endswith("GPTLightningModule"):
        names = {f.name for f in fields(GPTConfig)}
        return ModelSpec.from_gpt({k: v for k, v in node.items() if k in names}, seq_len, name="gpt")
    if target.endswith("CausalLM"):
        spec = ModelSpec.from_hf(_hf_config(cfg), seq_len)
        lora = node.get("lora")  # LoRA (a mapping of peft's LoraConfig fields; its default rank 8): a frozen base
        return spec if lora is None else replace(spec, lora_rank=int(lora.get("r", 8)))
    if module is None:
        from hydra.utils import instantiate

        module = instantiate(node, _convert_="all")
        getattr(module, "configure_model", lambda: None)()
    return ModelSpec.from_module(module, seq_len)


def _hf_config(cfg: DictConfig) -> Any:
    """A `CausalLM` recipe's ``transformers`` config, read as the module reads it: ``model.model`` a local folder
    (the finetune recipe's; its ``config.json``) or a model type, with the ``model.config`` overrides."""
    node = cfg.model
    overrides = OmegaConf.to_container(node.config, resolve=True) if node.get("config") is not None else {}
    return hf_config(str(node.model), overrides)


def _without_attention_dropout(cfg: DictConfig) -> bool:
    """Whether the recipe's model is known to attend without dropout (a `GPTLightningModule` with ``dropout`` 0, a
    `CausalLM` whose config's ``attention_dropout`` is 0): the search tries ring attention, which refuses dropout,
    for those only."""
    target = str(cfg.model.get("_target_", ""))
    if target.endswith("GPTLightningModule"):
        return not float(cfg.model.get("dropout", 0.0) or 0.0)
    if target.endswith("CausalLM"):
        return not float(getattr(_hf_config(cfg), "attention_dropout", 0.0) or 0.0)
    return False


def _documents(cfg: DictConfig) -> bool:
    """Whether the recipe's batches hold documents (`AutoLayoutConfig.documents`; null: a data config that packs or
    pads rows -- one with ``pack``, as `lightning_hybrid.data.sft.SFTDataModule`'s)."""
    documents = cfg.planner.get("documents") if cfg.get("planner") is not None else None
    return bool(documents) if documents is not None else "pack" in cfg.data


def _fp8(cfg: DictConfig, cluster: Cluster, model: ModelSpec) -> Optional[str]:
    """The recipe's ``parallel.fp8`` recipe where the planner models it on ``cluster`` (float8 tensor cores, a dense
    model: `lightning_hybrid.planner.float8`); else None -- off CUDA the strategy emulates FP8, which the planner
    does not time, so the layouts are planned and predicted as in bf16."""
    fp8 = cfg.parallel.get("fp8") if cfg.get("parallel") is not None else None
    try:
        check_fp8(fp8, cluster, model)
    except ValueError:
        return None
    return None if fp8 is None else str(fp8)


def _cluster(cfg: DictConfig) -> Cluster:
    """``planner.cluster`` or this machine, gathering float8 weights under ZeRO-3 where the recipe's
    ``parallel.fp8_all_gather`` says so, overlapping TP's forward collectives where its ``parallel.async_tp`` does
    (and no backward all-reduce under the weight gradient's GEMM, compiled: also under ``parallel.compile``),
    ZeRO 1-2's parameter gathers with the next forward unless ``parallel.compile`` or ``overlap_param_gather=False``
    keeps them in the step."""
    name = cfg.planner.cluster if cfg.get("planner") is not None else None
    cluster = load_cluster(name) if name else this_machine(str(cfg.trainer.accelerator))
    parallel = cfg.get("parallel")
    if parallel is None:
        return cluster
    if parallel.get("fp8_all_gather"):
        cluster = replace(cluster, fp8_all_gather=True)
    if parallel.get("async_tp"):  # torch's async TP: the forward's
        cluster = replace(cluster, tp_comm_overlap=True, tp_overlap_backward=False)
    if parallel.get("compile") or parallel.get("async_tp"):  # TP's collectives functional in compiled blocks
        cluster = replace(cluster, tp_grad_reduce_overlap=False)
    if parallel.get("compile") or parallel.get("overlap_param_gather") is False:
        cluster = replace(cluster, param_gather_overlap=False)  # ZeRO 1-2 gather in the optimizer step
    return cluster


def _devices(cfg: DictConfig) -> int:
    nodes = int(cfg.trainer.num_nodes)
    if cfg.trainer.devices is not None:
        return int(cfg.trainer.devices) * nodes
    if str(cfg.trainer.accelerator) in ("cuda", "gpu"):
        import torch

        return torch.cuda.device_count() * nodes
    return (os.cpu_count() or 1) * nodes


def explain(result: Plan, show: int) -> str:
    """Why the chosen layout: the first ``show`` ranked with their predictions, and what did not fit."""
    lines = [f"planner: {result.model.name} ({result.model.params / 1e6:.3g}M params) on {result.devices} x"
             f" {result.cluster.name}, global batch {result.global_batch}: {len(result.ranked)} layouts fit,"
             f" {len(result.too_big)} do not; fastest predicted first:"]
    for i, c in enumerate(result.ranked[:show]):
        lines.append(f"  {i + 1}. {c.layout.label():<44} {c.tokens_per_s:10.4g} tokens/s  step {c.time.total:.4g} s"
                     f"  peak {c.memory.total / 2**20:.1f} MiB/device")
    if result.too_big:
        lines.append(f"  smallest that does not fit: {result.too_big[0].layout.label()}: {result.too_big[0].reason}")
    return "\n".join(lines)


def _adds_router_loss(cfg: DictConfig) -> bool:
    """Whether the recipe's model is a `CausalLM` whose config adds its routers' load-balancing loss
    (``output_router_logits``): a loss of the whole batch, which a pipeline computes under GPipe only, without
    sequence parallelism (docs/moe.md); the planner searches those layouts."""
    if not str(cfg.model.get("_target_", "")).endswith("CausalLM"):
        return False
    return bool(getattr(_hf_config(cfg), "output_router_logits", False))


def choose_layout(cfg: DictConfig) -> tuple[DictConfig, str]:
    """A copy of ``cfg`` with the planner's best layout written in, and the explanation. Raises ``ValueError``
    (a bad cluster, no ``data.batch_size``, nothing fits)."""
    from lightning_hybrid import HybridStrategy

    if "batch_size" not in cfg.data:
        raise ValueError(f"parallel=auto sets data.batch_size, which {cfg.data.get('_target_')} does not take.")
    accumulate = int(cfg.trainer.accumulate_grad_batches)
    global_batch = int(cfg.planner.global_batch or int(cfg.data.batch_size) * accumulate)
    accepted = inspect.signature(HybridStrategy).parameters
    model, cluster = _model(cfg), _cluster(cfg)
    result = plan(model, cluster, _devices(cfg), global_batch,
                  sequence_parallel="sequence_parallel" in accepted, context_parallel="cp" in accepted,
                  ring_attention="cp_attention" in accepted and _without_attention_dropout(cfg),
                  whole_batch_loss=_adds_router_loss(cfg), documents=_documents(cfg), fp8=_fp8(cfg, cluster, model))
    best = result.best.layout
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    OmegaConf.set_struct(out, True)
    with open_dict(out):
        out.parallel.update(best.strategy_kwargs(HybridStrategy))
        if "cp" in out.parallel:  # the layout's cp, 1 included (strategy_kwargs names it only when > 1)
            out.parallel.cp = best.cp
        if "cp_attention" in out.parallel:  # the layout's, all-gather included
            out.parallel.cp_attention = best.cp_attention
        out.data.batch_size = best.micro_batch * (best.micro_batches if best.pp > 1 else 1)
        out.trainer.accumulate_grad_batches = best.accumulation
        out.trainer.devices = best.devices // int(cfg.trainer.num_nodes)
    return out, explain(result, int(cfg.planner.show)) + f"\nplanner: running {best.label()}"


def _recipe_layout(cfg: DictConfig, world: dict[str, int], batch_size: Optional[int] = None) -> tuple[Layout, int]:
    """The layout a recipe config runs (its per-replica batch split into micro-batches) and its global batch.
    ``cp``: ``world["cp"]`` (then ``world["dp"]`` is the data-parallel size without it), else ``parallel.cp``
    (then ``world["dp"]``, the devices over ``tp pp``, holds the ``cp`` ranks too)."""
    par = cfg.parallel
    cp = int(world.get("cp") or par.get("cp", 1) or 1)
    dp = world["dp"] if "cp" in world else world["dp"] // cp
    batch = cfg.data.get("batch_size", batch_size)
    if batch is None:
        raise ValueError(f"{cfg.data.get('_target_')} names no batch_size")
    batch, accumulate = int(batch), int(cfg.trainer.accumulate_grad_batches)
    m = int(par.micro_batches or 2 * world["pp"]) if world["pp"] > 1 else accumulate
    b = batch // m if world["pp"] > 1 else batch
    checkpointing = bool(par.activation_checkpointing)
    layout = Layout(dp, world["tp"], world["pp"], int(par.zero_stage), max(1, b), m,
                    str(par.schedule or "1f1b"), int(par.virtual_stages or 1) if par.schedule != "zero_bubble" else 2,
                    checkpointing, bool(par.get("sequence_parallel", False)), bool(par.get("loss_parallel", False)),
                    ep=int(par.get("ep", 1) or 1), cp=cp, accumulate=accumulate if world["pp"] > 1 else 1,
                    cp_attention=str(par.get("cp_attention") or "all_gather") if cp > 1 else "all_gather")
    return layout, dp * batch * accumulate


def predicted_metrics(cfg: DictConfig, world: dict[str, int], module: Any = None,
                      batch_size: Optional[int] = None) -> dict[str, Any]:
    """``predicted_peak_mib``, ``predicted_tokens_per_s`` and ``predicted_step_s`` of the layout ``cfg`` runs
    (``world``: `lightning_hybrid.runs.recipe.world_layout`; ``module``: the model the run built; ``batch_size``: the
    data module's, where its config does not name it), on ``planner.cluster`` or this machine; empty when the
    planner cannot describe the model, the batch or the machine."""
    try:
        model, cluster = _model(cfg, module), _cluster(cfg)
        layout, global_batch = _recipe_layout(cfg, world, batch_size)
    except (ValueError, KeyError, TypeError):
        return {}
    documents = _documents(cfg)
    memory = estimate_memory(model, layout, cluster.precision, cluster.activation_scale,
                             float(cfg.parallel.bucket_cap_mb), documents=documents)
    step = estimate_time(model, layout, cluster, float(cfg.parallel.bucket_cap_mb), documents=documents,
                         fp8=_fp8(cfg, cluster, model)).total
    return {"predicted_peak_mib": round(memory.total / 2**20, 3), "predicted_step_s": step,
            "predicted_tokens_per_s": global_batch * model.seq_len / step, "predicted_cluster": cluster.name}
