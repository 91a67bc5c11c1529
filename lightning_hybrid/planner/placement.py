"""Where a layout puts the model: the pipeline's stages and each rank's layers, split as the strategy splits them
(`pipeline_stages`, `rank_layers`; dense and MoE blocks per rank and per local stage), and the parameters a device
holds for them (`rank_params`: matrices split over ``tp``, a MoE block's experts ``1/ep``; `rank_expert_params`),
and the largest FSDP2 unit's (`fsdp_unit_params`).
"""

from __future__ import annotations

import functools

from lightning_hybrid.parallel.pipeline.partition import partition_layers, stage_ranks

from .model import ModelSpec

__all__ = ["FUSED_GATE_UP", "FUSED_QKV", "PACKED_EXPERT_ADAPTERS", "block_adapters", "fsdp_unit_params",
           "largest_block_params", "moe_block_count", "pipeline_stages", "rank_block_counts", "rank_chunk_blocks",
           "rank_expert_params", "rank_layers", "rank_params", "rank_trainable"]

@functools.lru_cache(maxsize=None)
def pipeline_stages(model: ModelSpec, pp: int, stages_per_rank: int,
                    style: str) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """The pipeline's stages (each a tuple of layer indices, ``0`` embed, ``L + 1`` head), split as the strategy
    splits them, and the rank of each (cached: the split is a search over the layers)."""
    stages = partition_layers(model.pipeline_layer_params(), pp * stages_per_rank)
    return tuple(tuple(stage) for stage in stages), tuple(stage_ranks(len(stages), pp, style))


@functools.lru_cache(maxsize=None)
def rank_layers(model: ModelSpec, pp: int, stages_per_rank: int, style: str) -> tuple[tuple[int, ...], ...]:
    """Pipeline layer indices (``0`` embed, ``L + 1`` head) of each rank, split as the strategy splits them."""
    stages, ranks = pipeline_stages(model, pp, stages_per_rank, style)
    return tuple(tuple(i for stage, r in zip(stages, ranks) if r == rank for i in stage) for rank in range(pp))


def _block_on_device(model: ModelSpec, moe: bool, tp: int, ep: int) -> float:
    """One block's parameters on a device: matrices and column-parallel biases split over ``tp``, norms and
    row-parallel biases whole; in a MoE block the router whole and the experts ``1/ep`` (whole across TP)."""
    norms = 2 * model.hidden * (2 if model.bias else 1)
    if not (moe and model.experts):
        whole = norms + (2 * model.hidden if model.bias else 0)  # norms, o/down bias
        return (model.block_params() - whole) / tp + whole
    experts = model.block_expert_params()
    whole = norms + (model.hidden if model.bias else 0) + model.router_params()  # norms, o bias, router
    whole += model.hidden if model.bias and model.shared_ffn else 0  # the shared experts' down bias
    return (model.block_params(True) - whole - experts) / tp + whole + experts / ep


#: Families whose attention computes q, k and v with one fused linear (one adapter for the three), and whose gated
#: MLP fuses its gate and up projections (`block_adapters`).
FUSED_QKV = frozenset({"gpt_neox", "gpt2", "phi3", "bloom", "falcon", "gpt_bigcode", "codegen", "mpt", "persimmon",
                       "olmo", "dbrx"})
FUSED_GATE_UP = frozenset({"phi3"})
#: MoE families whose router and packed experts peft's ``all-linear`` adapts (its ``ParamWrapper``: the router's
#: weight at rank r, the experts' fused gate/up at rank 2r and down at rank r, each for every expert).
PACKED_EXPERT_ADAPTERS = frozenset({"mixtral", "olmoe", "qwen3_moe", "deepseek_v3", "ernie4_5_moe"})


def block_adapters(model: ModelSpec, moe: bool = False) -> tuple[int, int, int]:
    """LoRA (``lora_rank`` r > 0): one block's adapters, as ``(whole, split, experts)`` -- the elements every TP rank
    holds, those TP splits, and those on the experts (split by expert parallelism). Adapted, as peft's
    ``all-linear`` adapts them: every linear of the attention and of the MLP (a MoE block's shared experts'), each
    ``r (h + n)`` for its ``h x n`` matrix -- a fused q/k/v or gate/up projection (`FUSED_QKV`, `FUSED_GATE_UP`) one
    matrix -- the ``r h`` side whole (a column-split layer's A, a row-split layer's B), the ``r n`` side split with
    its layer; in a MoE block of `PACKED_EXPERT_ADAPTERS` the router (whole) and the experts."""
    r, h = model.lora_rank, model.hidden
    if not r:
        return 0, 0, 0
    width = model.shared_ffn if moe and model.experts else model.ffn
    mlp = (3 if model.gated_mlp else 2) if width else 0
    fused_mlp = 1 if mlp == 3 and model.name in FUSED_GATE_UP else 0  # gate and up: one matrix
    attention = 2 if model.name in FUSED_QKV else 4  # q, k, v (or qkv) and o
    whole, split = r * h * (attention + mlp - fused_mlp), r * (model.attention_weights() // h + mlp * width)
    experts = 0
    if moe and model.experts and model.name in PACKED_EXPERT_ADAPTERS:
        whole += r * (h + model.experts)  # the router's weight
        f = model.expert_ffn
        experts = model.experts * r * (2 * (h + 2 * f) + (f + h))
    return whole, split, experts


def rank_trainable(model: ModelSpec, layers: tuple[int, ...], tp: int, ep: int = 1) -> tuple[float, float]:
    """LoRA: the adapter elements a device holds for pipeline ``layers`` under ``tp`` and ``ep`` (the embedding and
    head carry none), as ``(dense, experts)`` -- those reduced over the data-parallel ranks and those on the experts,
    reduced over the experts' own; ``(0, 0)`` without LoRA."""
    if not model.lora_rank:
        return 0.0, 0.0
    first_moe = model.n_layer - model.moe_layers + 1
    dense = on_experts = 0.0
    for i in layers:
        if 0 < i <= model.n_layer:
            whole, split, experts = block_adapters(model, model.experts > 0 and i >= first_moe)
            dense, on_experts = dense + whole + split / tp, on_experts + experts / ep
    return dense, on_experts


@functools.lru_cache(maxsize=1 << 16)  # a search asks again for the same stages (other dp, ZeRO, micro-batches)
def rank_params(model: ModelSpec, layers: tuple[int, ...], tp: int, ep: int = 1) -> float:
    """Parameters a device holds for pipeline ``layers`` under ``tp`` (and ``ep``): matrices, embeddings, the LM
    head and column-parallel biases split, norms and row-parallel biases whole; a MoE block's router whole and its
    experts ``1/ep`` (`rank_expert_params`)."""
    head = model.n_layer + 1
    first_moe = model.n_layer - model.moe_layers + 1
    dense = _block_on_device(model, False, tp, ep)
    moe = _block_on_device(model, True, tp, ep) if model.experts else dense
    total = 0.0
    for i in layers:
        if i == 0:
            total += model.embedding_params() / tp
        elif i == head:
            total += (model.hidden * (2 if model.bias else 1)
                      + (0 if model.tied_embeddings else model.vocab * model.hidden / tp))
        else:
            total += moe if i >= first_moe else dense
    return total


def moe_block_count(model: ModelSpec, layers: tuple[int, ...]) -> int:
    """How many of pipeline ``layers`` are MoE blocks."""
    if not model.experts:
        return 0
    first, last = model.n_layer - model.moe_layers + 1, model.n_layer
    return sum(1 for i in layers if first <= i <= last)


@functools.lru_cache(maxsize=None)
def rank_block_counts(model: ModelSpec, pp: int, stages_per_rank: int, style: str) -> tuple[tuple[int, int], ...]:
    """``(dense blocks, MoE blocks)`` of each pipeline rank (`rank_layers`)."""
    counts = []
    for layers in rank_layers(model, pp, stages_per_rank, style):
        moe = moe_block_count(model, layers)
        counts.append((sum(1 for i in layers if 0 < i <= model.n_layer) - moe, moe))
    return tuple(counts)


@functools.lru_cache(maxsize=None)
def rank_chunk_blocks(model: ModelSpec, pp: int, stages_per_rank: int,
                      style: str) -> tuple[tuple[tuple[int, int], ...], ...]:
    """``(dense blocks, MoE blocks)`` of each local stage of each pipeline rank, in the order the rank runs them."""
    stages, ranks = pipeline_stages(model, pp, stages_per_rank, style)
    out = []
    for rank in range(pp):
        chunks = []
        for stage, r in zip(stages, ranks):
            if r == rank:
                moe = moe_block_count(model, stage)
                chunks.append((sum(1 for i in stage if 0 < i <= model.n_layer) - moe, moe))
        out.append(tuple(chunks))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def largest_block_params(model: ModelSpec, tp: int, ep: int) -> float:
    """The parameters on a device of the largest block (dense or MoE): an FSDP2 unit under ``torch.compile``."""
    return max(rank_params(model, (i,), tp, ep) for i in {1, model.n_layer}) if model.n_layer else 0.0


def fsdp_unit_params(model: ModelSpec, tp: int, ep: int, compile: bool = False) -> float:
    """The parameters on a device of the largest FSDP2 unit of a block
    (`lightning_hybrid.parallel.zero.apply_fsdp_units`): the whole block under ``torch.compile``
    (`largest_block_params`), else the largest of its parts -- the attention
    (``/tp``), the MLP or shared experts (``/tp``), a MoE block's experts (``E/ep``, whole across TP)."""
    if compile or not model.n_layer:
        return largest_block_params(model, tp, ep)
    parts = [model.attention_weights() / tp, model.mlp_weights(model.ffn if model.moe_layers < model.n_layer
                                                                 else model.shared_ffn) / tp]
    if model.experts:
        parts.append(model.block_expert_params() / ep)
    return max(parts)


def rank_expert_params(model: ModelSpec, layers: tuple[int, ...], ep: int = 1) -> float:
    """The expert parameters a device holds for pipeline ``layers``: ``E/ep`` experts of each MoE block (whole
    across TP), reduced and sharded over their own data-parallel group of ``dp/ep`` ranks."""
    return moe_block_count(model, layers) * model.block_expert_params() / ep
