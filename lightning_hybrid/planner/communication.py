"""Time and volume of the step's collectives and transfers: ring all-reduce, reduce-scatter and all-gather
(`ring_volume`, `ring_time`) and all-to-all (`all_to_all_time`); context parallelism's key/value exchanges and the
positions' gather (`kv_exchanges`, `kv_exchange_bytes`, `kv_exchange_time`, `mask_gather_time`; ring attention's
transfers `ring_kv_bytes`); expert
parallelism's all-to-all volume (`all_to_all_bytes`); the pipeline's point-to-point transfers
(`pipeline_boundaries`, `pipeline_p2p_time`). The model: `lightning_hybrid.planner.time`'s docstring.
"""

from __future__ import annotations

from lightning_hybrid.parallel.pipeline.executor import SCHEDULES

from .activations import PRECISIONS, routed_tokens
from .cluster import Cluster, Link
from .context_memory import gathered_kv_bytes
from .layout import Layout
from .model import ModelSpec
from .placement import moe_block_count, pipeline_stages, rank_layers

__all__ = ["all_to_all_bytes", "all_to_all_time", "deepep_node_copies", "ep_all_to_all_time", "kv_exchange_bytes",
           "kv_exchange_time", "kv_exchanges", "mask_gather_time", "pipeline_boundaries", "pipeline_p2p_time",
           "ring_forwards", "ring_kv_bytes", "ring_time", "ring_volume"]

def ring_volume(n: int, nbytes: float, op: str = "all_reduce") -> float:
    """Bytes each rank sends in a ring ``op`` over ``n`` ranks: ``2 (n-1)/n B`` for all-reduce, ``(n-1)/n B``
    for reduce-scatter and all-gather."""
    if n <= 1:
        return 0.0
    return (2.0 if op == "all_reduce" else 1.0) * (n - 1) / n * nbytes


def ring_time(n: int, nbytes: float, link: Link, op: str = "all_reduce", messages: int = 1) -> float:
    """Seconds of a ring ``op`` of ``nbytes`` in all, sent as ``messages`` collectives: their steps' latency
    plus the volume at the link's bandwidth."""
    if n <= 1:
        return 0.0
    steps = (2 if op == "all_reduce" else 1) * (n - 1)
    return messages * steps * link.latency + ring_volume(n, nbytes, op) / link.bandwidth


def all_to_all_time(n: int, sent: float, link: Link, messages: int = 1) -> float:
    """Seconds of ``messages`` all-to-alls over ``n`` ranks in which a rank sends ``sent`` bytes in all (and
    receives as many): pairwise exchanges, ``n - 1`` steps of latency each, and the bytes at the link's bandwidth
    per direction."""
    if n <= 1:
        return 0.0
    return messages * (n - 1) * link.latency + sent / link.bandwidth


def ep_all_to_all_time(cluster: Cluster, n: int, stride: int, sent: float, messages: int = 1,
                       model: ModelSpec | None = None) -> float:
    """Seconds of ``messages`` all-to-alls over an expert-parallel group of ``n`` ranks ``stride`` apart in which a
    rank sends ``sent`` bytes in all, spread evenly over its ``n - 1`` peers: the ``k - 1`` on its node (``k`` the
    group's ranks per node) over NVLink, the others through its NIC, both at once -- the slower sets the pace (a group
    within a node: `all_to_all_time` over NVLink); ``n - 1`` steps of the slowest hop's latency each.

    With DeepEP's dispatch and combine (`Cluster.ep_dispatcher` ``"deepep"``; ``model``: the experts) a token crosses
    the network once per other node holding one of its experts and is forwarded to them over NVLink there: the NIC
    carries `deepep_node_copies` of a token's rows, not one per remote expert, and NVLink every row once."""
    if n <= 1:
        return 0.0
    k = max(1, min(n, cluster.devices_per_node // max(1, stride)))
    if k >= n:
        return all_to_all_time(n, sent, cluster.intra, messages)
    off = (n - k) / (n - 1)  # the share of a rank's bytes that leaves its node
    if cluster.ep_dispatcher == "deepep" and model is not None:
        rows = sent * n / (n - 1)  # the rank's rows, every pair: sent is the (n-1)/n that leaves the rank
        inter = rows * deepep_node_copies(model.experts, model.top_k, n // k) / model.top_k
        return messages * (n - 1) * cluster.inter.latency + max(rows / cluster.intra.bandwidth,
                                                                 inter / cluster.inter.bandwidth)
    return (messages * (n - 1) * cluster.inter.latency
            + max(sent * (1 - off) / cluster.intra.bandwidth, sent * off / cluster.inter.bandwidth))


def deepep_node_copies(experts: int, top_k: int, nodes: int) -> float:
    """Copies of a token DeepEP sends across the network: the other nodes (of ``nodes`` holding ``experts / nodes``
    experts each) that hold at least one of the token's ``top_k`` experts under uniform routing -- ``(nodes - 1) (1 -
    C(E - E/G, k) / C(E, k))``."""
    if nodes <= 1:
        return 0.0
    per_node = experts / nodes
    missed = 1.0
    for i in range(top_k):  # none of the k experts (drawn without replacement) on a given node
        missed *= max(0.0, (experts - per_node - i) / (experts - i))
    return (nodes - 1) * (1 - missed)


def _pipeline_ranks(model: ModelSpec, layout: Layout) -> tuple[tuple[int, ...], ...]:
    spec = SCHEDULES[layout.schedule] if layout.pp > 1 else SCHEDULES["1f1b"]
    return rank_layers(model, layout.pp, layout.virtual_stages if layout.pp > 1 else 1, spec.style)


def _exchange_bytes(model: ModelSpec, layout: Layout, tokens: float, element: float) -> float:
    """Bytes a rank sends in one all-to-all of one MoE layer for ``tokens`` of its replica: ``(ep-1)/ep`` of its
    ``N k`` rows of ``h`` elements (``N`` the tokens it routes: `routed_tokens`)."""
    ep = layout.ep
    routed = routed_tokens(tokens, layout.tp, layout.sequence_parallel)
    return routed * model.top_k * model.hidden * element * (ep - 1) / ep


def kv_exchanges(layout: Layout) -> int:
    """Key/value exchanges per block and micro-batch under context parallelism (each an all-gather, or the
    reduce-scatter of the gradients, of K and of V): 3, with or without activation checkpointing; 0 at ``cp = 1``.

    Without activation checkpointing the implementation runs the gather and the attention under
    ``torch.utils.checkpoint`` (non-reentrant): (1) the forward gathers; (2) backward, reaching the attention's
    nodes, recomputes the attention from its saved inputs, gathering again; (3) the reduce-scatter of the
    gradients. With activation checkpointing (full or selective) the attention is not checkpointed of its own
    (``ContextParallel(recompute_attention=False)``): (1) the layer's forward gathers (keeping nothing); (2)
    backward recomputes the layer, whose forward gathers again and keeps what SDPA saves for the layer's backward;
    (3) the reduce-scatter. Counted on CPU (one layer's attention, 2 ranks emulated in one process, with and without
    the layer checkpointed): 4 all-gathers (K and V, twice) and 2 gradient reductions per layer and micro-batch.
    """
    if layout.cp == 1:
        return 0
    return 3


def kv_exchange_bytes(model: ModelSpec, layout: Layout, *, precision: str = "bf16-mixed",
                      bytes_per_element: float | None = None, pipeline_rank: int | None = None,
                      gathers_kv_heads: bool = True) -> float:
    """Bytes one rank sends in the context-parallel key/value exchanges of one optimizer step:

        X * L * m * (cp - 1)/cp * 2 b s (a_kv/tp) d e

    ``X = 3`` exchanges per block and micro-batch (`kv_exchanges`: the forward's all-gather of K and V, the
    backward's gather again -- the checkpointed attention's recomputation, or with activation checkpointing the
    layer's -- and the reduce-scatter of their gradients), ``L`` the blocks of the rank's
    pipeline stages (``pipeline_rank``; default the rank with the most), ``m`` the micro-batches, ``2 b s (a_kv/tp) d
    e`` the gathered K and V of a micro-batch (`gathered_kv_bytes` of the rank's ``a/tp`` query heads times ``a_kv /
    a``: grouped-query attention's key/value heads are gathered once and repeated after; ``gathers_kv_heads=False``
    for a runtime repeating them first; ``b`` sequences of ``s`` tokens, heads of ``d``, ``e`` bytes per element:
    ``bytes_per_element``, else the activation size of ``precision``) of which a rank sends ``(cp - 1)/cp`` in a
    ring. 0 for ``cp = 1``. Not counted: the tokens' positions gathered for the mask (``8 b s (cp -
    1)/cp`` bytes per micro-batch), and on gloo the backward's all-reduce in place of the reduce-scatter (twice the
    volume; `estimate_time` counts both). Ring attention (`Layout.cp_attention` ``"ring"``): per block and
    micro-batch ``cp - 1`` transfers of the rank's own K and V in each pass (the forward, its recomputation where
    the layer or its attention core is recomputed, the backward) and ``cp`` of their fp32 gradients in backward
    (`ring_kv_bytes`)."""
    layout.check_model(model)
    if layout.cp == 1:
        return 0.0
    element = bytes_per_element if bytes_per_element is not None else PRECISIONS[precision][3]
    blocks = [sum(1 for i in layers if 0 < i <= model.n_layer) for layers in _pipeline_ranks(model, layout)]
    count = max(blocks) if pipeline_rank is None else blocks[pipeline_rank]
    if layout.cp_attention == "ring":
        kv, grads = ring_kv_bytes(model, layout, element, gathers_kv_heads)
        passes = ring_forwards(layout) + 1  # and the backward's
        return count * layout.micro_batches * ((layout.cp - 1) * passes * kv + layout.cp * grads)
    kv = gathered_kv_bytes(model, layout.micro_batch, element, layout.tp, layout.cp)
    volume = ring_volume(layout.cp, kv * (model.kv_heads / model.heads if gathers_kv_heads else 1.0), "all_gather")
    return kv_exchanges(layout) * count * layout.micro_batches * volume


def ring_forwards(layout: Layout) -> int:
    """Forward rings of ring attention per block and micro-batch: 1 (the implementation does not checkpoint the
    ring), 2 where the layer or its attention core is recomputed (full or selective recompute)."""
    return 2 if layout.recompute_mode in ("full", "attention", "pointwise") else 1


def ring_kv_bytes(model: ModelSpec, layout: Layout, element: float, kv_heads: bool = True) -> tuple[float, float]:
    """What one step of ring attention sends (`lightning_hybrid.parallel.context_parallel.ring`): the rank's own
    keys and values, ``2 b (s/cp) (a_kv/tp) d e`` bytes (``a/tp`` heads where not ``kv_heads``), and their gradients
    in fp32 (the same with ``e = 4``)."""
    kv = gathered_kv_bytes(model, layout.micro_batch, element, layout.tp, layout.cp) / layout.cp
    kv *= model.kv_heads / model.heads if kv_heads else 1.0
    return kv, kv * 4 / element


def kv_exchange_time(model: ModelSpec, layout: Layout, cluster: Cluster, attention: float = 0.0) -> float:
    """Seconds of one block's context-parallel key/value exchanges for one micro-batch, all on the critical path:
    the all-gathers of K and of V in forward, again in backward (the checkpointed attention's recomputation, or with
    activation checkpointing the layer's), and the reduce-scatter of their gradients (two; on a CPU cluster gloo's
    all-reduce in its place) (`kv_exchanges`); each a ring over the ``cp`` ranks
    (``tp`` apart: `Cluster.link`). 0 for ``cp = 1``. Not overlapped with computation (attention waits for the
    keys). The positions' gather, once per micro-batch, is `mask_gather_time`.

    Ring attention (`Layout.cp_attention` ``"ring"``; ``attention``: seconds of the block's attention core in one
    forward pass): each of its ``cp`` steps sends the keys and values to the next rank (`ring_kv_bytes`) while it
    attends to the ones it holds -- a point-to-point transfer each way over the same link, under ``1/cp`` of the
    pass's attention (the zigzag split balances the steps), of which what exceeds that compute shows. One forward
    ring (the implementation does not checkpoint the ring: it keeps what SDPA keeps), two where the layer or its
    attention core is recomputed (full or selective recompute), ``cp - 1`` transfers each; in backward (twice the
    compute a step) the ``cp - 1`` transfers of the keys carry the gradients gathered so far one step behind them,
    and the last gradients' transfer home shows whole."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    if layout.cp_attention == "ring":
        link = cluster.link(cp, layout.tp)
        kv, grads = ring_kv_bytes(model, layout, PRECISIONS[cluster.precision][3], cluster.cp_gathers_kv_heads)

        def shows(sent: float, under: float) -> float:
            return max(0.0, link.latency + sent / link.bandwidth - under)

        step = attention / cp
        forward = (cp - 1) * shows(kv, step)
        backward = shows(kv, 2 * step) + (cp - 2) * shows(kv + grads, 2 * step) + shows(grads, 2 * step)
        return ring_forwards(layout) * forward + backward + link.latency + grads / link.bandwidth
    kv = gathered_kv_bytes(model, layout.micro_batch, PRECISIONS[cluster.precision][3], layout.tp, cp)
    if cluster.cp_gathers_kv_heads:  # grouped-query attention's own K/V heads gathered, repeated after
        kv *= model.kv_heads / model.heads
    link = cluster.link(cp, layout.tp)
    gathers = kv_exchanges(layout) - 1
    backward_op = "all_reduce" if cluster.compute_units else "reduce_scatter"  # gloo: no reduce-scatter of its own
    return gathers * ring_time(cp, kv, link, "all_gather", messages=2) + ring_time(cp, kv, link, backward_op, 2)


def mask_gather_time(model: ModelSpec, layout: Layout, cluster: Cluster) -> float:
    """Seconds of the all-gather of a micro-batch's token positions (int64) over the ``cp`` ranks, from which each
    rank finds, once before its first layer, whether the micro-batch is plain causal or makes its documents' mask;
    0 for ``cp = 1``."""
    if layout.cp == 1:
        return 0.0
    return ring_time(layout.cp, 8 * layout.micro_batch * model.seq_len, cluster.link(layout.cp, layout.tp),
                     "all_gather")


def all_to_all_bytes(model: ModelSpec, layout: Layout, tokens_per_rank: float | None = None, *,
                     precision: str = "bf16-mixed", bytes_per_element: float | None = None,
                     pipeline_rank: int | None = None) -> float:
    """Bytes one rank sends (and, under uniform routing, receives) in the expert-parallel all-to-alls of one
    optimizer step:

        X * L_moe * N * k * h * e * (ep - 1) / ep

    ``X = 4`` exchanges per MoE layer (dispatch and combine in forward, their reverses in backward; 6 with
    activation checkpointing, whose recomputed forward exchanges again), ``L_moe`` the MoE layers of the rank's
    pipeline stages (``pipeline_rank``; default the rank with the most), ``N`` the tokens the rank routes in the
    step -- ``tokens_per_rank``, its data-parallel replica's tokens over all micro-batches (default ``micro_batch x
    micro_batches x seq_len``; ``/cp`` under context parallelism: the rank's part of each sequence), divided by ``tp``
    under sequence parallelism (each TP rank routes its part of the sequence; without it every TP rank routes all of
    them) -- ``k`` the experts per token, ``h`` the width, ``e`` bytes per element (``bytes_per_element``, else the
    activation size of ``precision``: `PRECISIONS`), and ``(ep - 1)/ep`` the pairs that leave the rank under uniform
    routing. 0 for ``ep = 1``. Not counted: the split sizes exchanged before each forward dispatch (``8 (ep - 1)``
    bytes per layer)."""
    layout.check_model(model)
    if layout.ep == 1:
        return 0.0
    tokens = (layout.micro_batch * layout.micro_batches * model.seq_len // layout.cp if tokens_per_rank is None
              else tokens_per_rank)
    element = bytes_per_element if bytes_per_element is not None else PRECISIONS[precision][3]
    counts = [moe_block_count(model, layers) for layers in _pipeline_ranks(model, layout)]
    moe_layers = max(counts) if pipeline_rank is None else counts[pipeline_rank]
    exchanges = 6 if layout.activation_checkpointing else 4
    return exchanges * moe_layers * _exchange_bytes(model, layout, tokens, element)


def pipeline_boundaries(model: ModelSpec, layout: Layout, precision: str = "bf16-mixed", *,
                        scatter_gather: bool = False) -> list[tuple[int, int, float]]:
    """The stage boundaries between two pipeline ranks, in stage order, as ``(sending rank, receiving rank, bytes)``
    of the tensor one crosses per micro-batch forward (its gradient, as large, crosses back): the last layer's
    output of the sending stage, ``b s / c`` tokens of ``h`` elements of the parameters' size (the residual stream:
    fp32 under ``bf16-mixed``), ``/tp`` under sequence parallelism where both sides are blocks (the split hidden
    states; the embedding's output and the last block's are whole), or everywhere with ``scatter_gather``
    (Megatron's). Stages split as the strategy splits them; consecutive stages on one rank (ZB-V's turn) send
    nothing. Empty for ``pp = 1``."""
    if layout.pp == 1:
        return []
    stages, owners = pipeline_stages(model, layout.pp, layout.virtual_stages, SCHEDULES[layout.schedule].style)
    whole = layout.micro_batch * model.seq_len // layout.cp * model.hidden * PRECISIONS[precision][0]
    out = []
    for stage in range(len(stages) - 1):
        if owners[stage] == owners[stage + 1]:
            continue
        last = stages[stage][-1]  # the layer whose output crosses: 0 the embedding, 1..L the blocks
        split = scatter_gather or (layout.sequence_parallel and 0 < last < model.n_layer)
        out.append((owners[stage], owners[stage + 1], whole / layout.tp if split else whole))
    return out


def pipeline_p2p_time(model: ModelSpec, layout: Layout, cluster: Cluster) -> tuple[float, float]:
    """Seconds of the pipeline's point-to-point transfers, as ``(ramp, steady)``: ``ramp`` once per step -- the
    first micro-batch's forward crossing every boundary between ranks in turn and the last one's backward crossing
    them back (`pipeline_boundaries`) -- and ``steady`` per micro-batch, before any overlap with computation
    (`estimate_time` takes it for the interleaved and ZB-V schedules): 1F1B the messages of the rank with the most
    neighbours (each exchange with a neighbour, a send and a receive batched, waited for), GPipe the slowest
    boundary once per pass (each receive waited for), interleaved and ZB-V a rank's sends of both passes. A message
    is the link's latency plus its bytes at the link's bandwidth, over the link of its two ranks (``dp c tp`` apart
    per rank between them: `Cluster.link`); with `Cluster.pp_scatter_gather` plus the receiver's all-gather over
    TP. (0, 0) for ``pp = 1``."""
    bounds = pipeline_boundaries(model, layout, cluster.precision, scatter_gather=cluster.pp_scatter_gather)
    if not bounds:
        return 0.0, 0.0
    stride = layout.dp * layout.cp * layout.tp  # ranks between two consecutive pipeline ranks

    def message(src: int, dst: int, nbytes: float) -> float:
        link = cluster.link(2, abs(src - dst) * stride)
        gather = (ring_time(layout.tp, nbytes * layout.tp, cluster.link(layout.tp, 1), "all_gather")
                  if cluster.pp_scatter_gather else 0.0)
        return link.latency + nbytes / link.bandwidth + gather

    times = [message(*bound) for bound in bounds]
    ramp = 2 * sum(times)
    if layout.schedule == "gpipe":
        return ramp, 2 * max(times)
    # 1F1B: one exchange per neighbour; interleaved, ZB-V: per boundary a rank touches its forward send (it sends)
    # or its backward send (it receives) -- ``v`` times 1F1B's boundaries per rank for the interleaved schedule.
    per_rank = [0.0] * layout.pp  # each rank's messages, summed in the boundaries' order
    for (src, dst, _), x in zip(bounds, times):
        per_rank[src] += x
        if dst != src:
            per_rank[dst] += x
    return ramp, max(per_rank)
