"""One candidate layout: the `HybridStrategy` arguments the planner chooses, plus the micro-batch size."""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from typing import Any, Optional

from lightning_hybrid.parallel.context_parallel.ring import CP_ATTENTION
from lightning_hybrid.parallel.zero import GRAD_REDUCE

__all__ = ["Layout", "RECOMPUTE_MODES"]

#: What a layer recomputes in backward: nothing, the whole layer (activation checkpointing), the attention core only
#: (selective recompute), or the attention core and every element-wise op (pointwise selective recompute).
#: ``"op"``: torchtitan's per-op policy (every other matmul's output and the attention's kept; other runtimes only:
#: `Layout.strategy_kwargs` refuses it).
RECOMPUTE_MODES = ("none", "full", "attention", "pointwise", "op")


@dataclass(frozen=True)
class Layout:
    """``dp x tp x pp`` (x ``cp``) with ZeRO ``zero_stage``; each replica's batch is ``micro_batches`` micro-batches of
    ``micro_batch`` sequences (a pipeline's micro-batches, or gradient accumulation when ``pp == 1``);
    ``schedule``/``virtual_stages`` as `lightning_hybrid.parallel.pipeline.resolve_schedule` takes them;
    ``loss_parallel``: the LM head's logits stay split over the vocabulary under TP (the strategy's default;
    not searched: it only saves); ``ep``: expert parallelism, each experts module split over ``ep`` of the ``dp``
    ranks (``ep`` divides ``dp``; 1: none; the model must have experts that ``ep`` divides: `check_model`);
    ``cp``: context parallelism, every sequence split over ``cp`` ranks (mesh ``(pp, dp, cp, tp)``: ``devices = pp dp
    cp tp``; the ``cp`` ranks of a replica see the same samples, gradients are reduced and ZeRO-sharded over ``dp cp``
    ranks, and the expert-parallel ranks are carved out of those, so ``ep`` divides ``dp cp``; the sequence length
    must divide by ``2 cp``, the zigzag split's chunks: `check_model`); ``recompute``: what a checkpointed layer
    recomputes, the strategy's option of the same name -- ``"full"`` (the whole layer, when
    ``activation_checkpointing``), ``"attention"`` (selective recompute, Korthikanti et al. 2022: every layer keeps
    its activations but the attention core's, which backward recomputes) or ``"pointwise"`` (selective recompute of
    the attention core and every element-wise op: a layer keeps only its matmul, norm and reduction outputs;
    `lightning_hybrid.parallel.activation_checkpointing`); with either selective mode ``activation_checkpointing`` is
    False, as the strategy checkpoints every layer selectively; ``"op"`` describes torchtitan's per-op selective
    recompute for other runtimes (not the strategy's). `recompute_mode` names the five choices.
    ``dp_shard`` (ZeRO-3 only, ``ep = 1``): hybrid sharding -- ZeRO-3 within groups of ``dp_shard cp`` ranks,
    replicated across ``dp / dp_shard`` of them (``None``: over all ``dp cp``); ``grad_reduce`` (ZeRO-3 under
    accumulation, ``pp = 1``): ``"window"`` (reduce-scatter once per optimizer step, unsharded gradients kept through
    the window), ``"micro_batch"`` (every micro-batch) or ``"auto"`` (`resolve_grad_reduce`, as the strategy);
    ``accumulate`` (``pp > 1``): gradient accumulation around the pipeline -- each optimizer step runs the schedule
    of ``micro_batches`` that many times (Lightning's ``accumulate_grad_batches`` under a pipeline strategy; a
    bubble per run), the gradients reduced once, after the last (1: one run; under ``pp = 1`` the micro-batches are
    the accumulation); ``ep_folding``: Megatron-Core's MoE parallel folding with expert tensor parallel size 1 -- the
    expert-parallel group spans the tp ranks too (``ep`` divides ``dp cp tp``; the experts' data-parallel group is
    the rest, `edp`), each expert whole on its rank, a TP group's ranks routing their own sequence shards (sequence
    parallelism) to different experts; described for other runtimes (this strategy keeps a rank's experts on every
    rank of its TP group: `strategy_kwargs` refuses folding)."""

    dp: int
    tp: int
    pp: int
    zero_stage: int
    micro_batch: int
    micro_batches: int
    schedule: str = "1f1b"
    virtual_stages: int = 1
    activation_checkpointing: bool = False
    sequence_parallel: bool = False
    loss_parallel: bool = True
    ep: int = 1
    cp: int = 1
    recompute: str = "full"
    dp_shard: Optional[int] = None
    grad_reduce: str = "auto"
    accumulate: int = 1
    ep_folding: bool = False
    cp_attention: str = "all_gather"

    def __post_init__(self) -> None:
        if self.cp_attention not in CP_ATTENTION or (self.cp_attention == "ring" and self.cp == 1):
            raise ValueError(f"cp_attention={self.cp_attention!r} is invalid for cp={self.cp}: use 'all_gather', or"
                             " 'ring' with cp > 1 (the keys and values passed around the CP group).")
        if self.dp_shard is not None:
            if not isinstance(self.dp_shard, int) or self.dp_shard < 1 or self.dp % self.dp_shard:
                raise ValueError(f"dp_shard={self.dp_shard!r} is invalid for dp={self.dp}: it must be a positive"
                                 " divisor of dp (ZeRO-3's shard groups), or None.")
            if self.zero_stage != 3 or self.ep > 1:
                raise ValueError(f"dp_shard={self.dp_shard} (hybrid sharding) takes zero_stage=3 and ep=1, got"
                                 f" zero_stage={self.zero_stage}, ep={self.ep}.")
        if not isinstance(self.accumulate, int) or isinstance(self.accumulate, bool) or self.accumulate < 1 or (
                self.accumulate > 1 and self.pp == 1):
            raise ValueError(f"accumulate={self.accumulate!r} is invalid for pp={self.pp}: it counts the pipeline"
                             " schedules run per optimizer step (a positive integer; 1 when pp == 1, where"
                             " micro_batches are the accumulation).")
        if self.grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"grad_reduce={self.grad_reduce!r} is invalid: use one of {list(GRAD_REDUCE)}.")
        if self.recompute not in RECOMPUTE_MODES[1:]:
            raise ValueError(f"recompute={self.recompute!r} is invalid: use 'full', 'attention', 'pointwise' or 'op'.")
        if self.recompute != "full" and self.activation_checkpointing:
            raise ValueError(f"recompute={self.recompute!r} is selective recompute of every layer: it takes"
                             " activation_checkpointing=False (True with 'full' recomputes whole layers).")
        if not isinstance(self.cp, int) or isinstance(self.cp, bool) or self.cp < 1:
            raise ValueError(f"cp={self.cp!r} is invalid: it must be a positive integer (1: no context parallelism).")
        if self.ep_folding:
            if not isinstance(self.ep, int) or self.ep < 2 or self.dp * self.cp * self.tp % self.ep:
                raise ValueError(f"ep={self.ep!r} with ep_folding is invalid for dp*cp*tp ="
                                 f" {self.dp * self.cp * self.tp}: folding splits the experts over ep > 1 ranks out"
                                 " of dp*cp*tp.")
            if self.tp > 1 and not self.sequence_parallel:
                raise ValueError(f"ep_folding with tp={self.tp} takes sequence_parallel=True: the ranks of a TP group"
                                 " route their own sequence shards (Megatron-Core's MoE with TP needs it).")
        elif not isinstance(self.ep, int) or isinstance(self.ep, bool) or self.ep < 1 or self.dp * self.cp % self.ep:
            within = f"dp*cp = {self.dp * self.cp}" if self.cp > 1 else f"dp={self.dp}"
            raise ValueError(f"ep={self.ep!r} is invalid for {within}: it must be a positive divisor of dp"
                             + ("*cp" if self.cp > 1 else "")
                             + " (the expert-parallel ranks are carved out of the data-parallel ones; ep_folding"
                             " carves them out of dp*cp*tp).")

    def check_model(self, model: Any) -> None:
        """Raise ``ValueError`` unless ``ep`` and ``cp`` suit ``model`` (a `ModelSpec`): ``ep > 1`` needs experts, and
        their number must divide by ``ep``; ``cp > 1`` needs a sequence length that divides by ``2 cp`` (each rank
        holds chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``)."""
        if self.ep > 1 and not model.experts:
            raise ValueError(f"ep={self.ep}: {model.name} has no experts to split (a dense model takes ep=1).")
        if model.experts and model.experts % self.ep:
            raise ValueError(f"ep={self.ep} does not divide the {model.experts} experts of {model.name}.")
        if self.cp > 1 and model.seq_len % (2 * self.cp):
            raise ValueError(f"cp={self.cp}: the sequence length {model.seq_len} of {model.name} does not divide by"
                             f" 2*cp = {2 * self.cp} (the load-balanced split's chunks).")

    @property
    def recompute_mode(self) -> str:
        """``"none"``, ``"full"`` (activation checkpointing), ``"attention"`` (selective recompute of the attention
        core), ``"pointwise"`` (selective recompute of the attention core and the element-wise ops) or ``"op"``
        (torchtitan's per-op policy)."""
        if self.recompute in ("attention", "pointwise", "op"):
            return self.recompute
        return "full" if self.activation_checkpointing else "none"

    @property
    def edp(self) -> int:
        """The experts' own data-parallel size: ranks holding the same experts (``dp cp / ep``; ``dp cp tp / ep``
        under `ep_folding`)."""
        return self.dp * self.cp * (self.tp if self.ep_folding else 1) // self.ep

    @property
    def ep_stride(self) -> int:
        """How many ranks apart the ranks of an expert-parallel group are: ``tp`` (one per TP group), 1 folded."""
        return 1 if self.ep_folding else self.tp

    @property
    def shard(self) -> int:
        """Ranks over which gradients are reduced and ZeRO shards (``dp cp``: the context-parallel ranks hold the
        same parameters and reduce their gradients with the data-parallel ones)."""
        return self.dp * self.cp

    @property
    def zero3_shard(self) -> int:
        """Ranks one ZeRO-3 shard is split over (``dp_shard cp``; ``dp cp`` without hybrid sharding)."""
        return (self.dp_shard or self.dp) * self.cp

    @property
    def replicas(self) -> int:
        """Hybrid sharding's replicas of each shard group (``dp / dp_shard``; 1 without it)."""
        return self.dp // (self.dp_shard or self.dp)

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def accumulation(self) -> int:
        """Optimizer step = this many backward passes outside a pipeline, this many runs of the schedule under PP
        (``accumulate``)."""
        return self.micro_batches if self.pp == 1 else self.accumulate

    @property
    def sequences(self) -> int:
        """Sequences per optimizer step: ``dp`` replicas of ``micro_batch x micro_batches`` (x ``accumulate``)."""
        return self.dp * self.micro_batch * self.micro_batches * self.accumulate

    def label(self) -> str:
        """``dp4xtp2xpp2 cp2 ring ep2 zero1 mb2x4 1f1b acc2 ac sp`` (only what differs from the defaults; ``ring``:
        ring attention under CP; ``sel``:
        selective recompute of the attention core, ``pw``: pointwise selective recompute; ``accN``: N runs of the
        pipeline schedule per optimizer step)."""
        parts = [f"dp{self.dp}xtp{self.tp}" + (f"xpp{self.pp}" if self.pp > 1 else "")]
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += ["ring"] if self.cp_attention == "ring" else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += ["fold"] if self.ep_folding else []
        parts += [f"zero{self.zero_stage}"] if self.zero_stage else []
        parts += [f"hsdp{self.dp_shard}"] if self.replicas > 1 else []
        parts += ["rs-mb"] if self.grad_reduce == "micro_batch" else []
        parts.append(f"mb{self.micro_batch}x{self.micro_batches}")
        if self.pp > 1:
            parts.append(self.schedule + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
            parts += [f"acc{self.accumulate}"] if self.accumulate > 1 else []
        parts += ["ac"] if self.activation_checkpointing else []
        parts += {"attention": ["sel"], "pointwise": ["pw"], "op": ["op"]}.get(self.recompute, [])
        parts += ["sp"] if self.sequence_parallel else []
        return " ".join(parts)

    def strategy_kwargs(self, strategy_cls: Any = None) -> dict[str, Any]:
        """Arguments of ``HybridStrategy`` (``strategy_cls``) for this layout; ``sequence_parallel``, ``ep`` and ``cp``
        only when they are on (``ep``, ``cp``: ``ValueError`` if the strategy does not take them)."""
        if strategy_cls is None:
            from lightning_hybrid import HybridStrategy as strategy_cls
        kwargs: dict[str, Any] = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "zero_stage": self.zero_stage,
                                  "activation_checkpointing": self.activation_checkpointing}
        if self.pp > 1:
            kwargs.update(micro_batches=self.micro_batches, schedule=self.schedule, virtual_stages=self.virtual_stages)
        accepted = inspect.signature(strategy_cls).parameters
        if self.sequence_parallel and "sequence_parallel" in accepted:
            kwargs["sequence_parallel"] = True
        if self.ep > 1:
            if "ep" not in accepted:
                raise ValueError(f"ep={self.ep}: {strategy_cls.__name__} takes no ep (expert parallelism).")
            kwargs["ep"] = self.ep
        if self.cp > 1:
            if "cp" not in accepted:
                raise ValueError(f"cp={self.cp}: {strategy_cls.__name__} takes no cp (context parallelism).")
            kwargs["cp"] = self.cp
            if self.cp_attention != "all_gather":
                if "cp_attention" not in accepted:
                    raise ValueError(f"cp_attention={self.cp_attention!r}: {strategy_cls.__name__} takes no"
                                     " cp_attention.")
                kwargs["cp_attention"] = self.cp_attention
        if self.ep_folding:
            raise ValueError(f"ep_folding: {strategy_cls.__name__} keeps a rank's experts on every rank of its TP"
                             " group (ep within dp*cp); folding expert parallelism over TP is described for other"
                             " runtimes (Megatron-Core).")
        if self.recompute == "op":
            raise ValueError("recompute='op' is torchtitan's per-op selective recompute, which the planner describes"
                             f" for other runtimes: {strategy_cls.__name__} has recompute='pointwise' (the attention"
                             " core and the element-wise ops recomputed, every matmul output kept).")
        if self.recompute != "full":
            if "recompute" not in accepted:
                raise ValueError(f"recompute={self.recompute!r}: {strategy_cls.__name__} takes no recompute.")
            kwargs["recompute"] = self.recompute
        if "loss_parallel" in accepted:
            kwargs["loss_parallel"] = self.loss_parallel
        if self.dp_shard is not None:
            if "dp_shard" not in accepted:
                raise ValueError(f"dp_shard={self.dp_shard}: {strategy_cls.__name__} takes no dp_shard"
                                 " (hybrid sharding).")
            kwargs["dp_shard"] = self.dp_shard
        if self.zero_stage == 3 and self.grad_reduce != "auto" and "grad_reduce" in accepted:
            kwargs["grad_reduce"] = self.grad_reduce  # what the plan modelled
        return kwargs

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
