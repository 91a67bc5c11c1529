"""A mixture-of-experts block's time per micro-batch on a device (`moe_block_time`), for
`lightning_hybrid.planner.time.estimate_time`.

Mixture of experts (`ModelSpec.experts`; `lightning_hybrid.parallel.expert_parallel`), per MoE block and micro-batch:

* compute: attention and the shared experts as a dense block's (``/tp``); the router (``2 E h``) and the experts
  (``2 x`` one expert's weights per (token, expert) pair, ``k`` pairs per token under uniform routing) on the
  tokens the rank routes -- all of its replica's under TP without sequence parallelism (the experts are whole on
  every TP rank, so this work is not split), ``1/tp`` of them with it -- whatever ``ep`` (a rank computes as many
  pairs as it sends); the weight GEMMs at their shapes (`moe_time_factors`: an expert's down projection reduces over
  its own width ``F_e``, whole on its rank); the routing's permutation copies (`permutation_bytes`: each pair's row
  gathered to its expert and scattered back, forward and backward) at the memory bandwidth, beside the block's
  element-wise traffic; TP's collectives only for attention (and the shared experts);
* EP (``ep > 1``): an all-to-all of the pairs to the experts' ranks and one back in forward (dispatch, combine),
  the reverse two in backward (two more when the block is recomputed), each sending ``(ep-1)/ep`` of the ``N k`` rows
  of ``h`` elements (`all_to_all_bytes`), plus the split sizes' exchange before each forward dispatch. Over the EP
  group's links (`ep_all_to_all_time`: ``ep`` ranks ``tp`` apart, or 1 apart folded over TP,
  `Layout.ep_folding`; the rows for peers on the rank's node over NVLink, the others through its NIC at once; with
  DeepEP, `Cluster.ep_dispatcher`, a token crosses the network once per other node holding its experts). In this
  codebase synchronous (a host sync for the split sizes per layer): on the critical path. A runtime overlapping
  them (`Cluster.ep_comm_overlap`, Megatron-Core's combined 1F1B: a micro-batch's forward of the block interleaved
  with another's backward) hides each under the other direction's chunk running beside it -- the forward's
  dispatch under the experts' backward, its combine under the attention's backward, the backward's dispatch under
  the experts' forward and its combine under the attention's forward: what exceeds its chunk shows, and every
  all-to-all's latency.
"""

from __future__ import annotations

from .activations import PRECISIONS, op_recomputed_weights, routed_tokens
from .cluster import Cluster
from .communication import _exchange_bytes, ep_all_to_all_time
from .gemm import moe_time_factors
from .layout import Layout
from .model import ModelSpec

__all__ = ["PERMUTATION_COPIES", "moe_block_time", "permutation_bytes"]

#: Rows of ``h`` elements the routing copies per (token, expert) pair and pass pair: in forward the token's row
#: gathered into its expert's order and the expert's output scattered back into the token's sum, in backward the same
#: two for the gradients -- each a read and a write: 8. Measured on this machine
#: (`benchmarks/bench_moe_routing.py`, benchmarks/MOE_ROUTING.md: a transformers Qwen3-MoE block against the same
#: GEMMs without routing): 64 and 128 narrow experts route in 0.91-1.00 of the time predicted with the copies,
#: 1.5-1.8x of it without them; 8 wide experts 0.8-1.4x (the difference of two noisy timings).
PERMUTATION_COPIES = 8


def permutation_bytes(model: ModelSpec, routed: float, element: float, recompute: bool = False) -> float:
    """HBM bytes the routing's permutation moves for ``routed`` tokens on a rank, forward and backward
    (`PERMUTATION_COPIES` rows per pair; a recomputed forward gathers and scatters again)."""
    copies = PERMUTATION_COPIES + (PERMUTATION_COPIES // 2 if recompute else 0)
    return routed * model.top_k * model.hidden * element * copies


def moe_block_time(model: ModelSpec, lay: Layout, cluster: Cluster, *, tokens: float, passes: int, weight_passes: int,
                   recompute: bool, mode: str, attention_flops: float, slower: float,
                   elementwise: float) -> tuple[float, float]:
    """``(compute, all-to-alls)`` seconds of one MoE block and micro-batch of ``tokens`` on a rank: ``passes`` of the
    block (forward, backward as two, a recomputed forward), ``weight_passes`` of its weight GEMMs (one fewer under
    LoRA), ``recompute``: the whole block recomputed
    (two more all-to-alls), ``mode``: the recompute mode (``"op"``: torchtitan's per-op policy, whose recomputation
    runs the experts' grouped GEMMs again whole), ``attention_flops`` the attention core's FLOPs and ``slower`` what
    its kernel's speed adds (as the dense block's), ``elementwise`` the seconds of the block's launches and
    element-wise traffic (the dense block's model, on the MoE block's activations)."""
    t, ep, h = lay.tp, lay.ep, model.hidden
    e = PRECISIONS[cluster.precision][3]
    flops = cluster.achievable_flops(cluster.precision)
    routed = routed_tokens(tokens, t, lay.sequence_parallel)
    split = model.attention_weights() + model.mlp_weights(model.shared_ffn)
    expert = model.experts * h + model.top_k * model.mlp_weights(model.expert_ffn)
    op_split, op_expert = op_recomputed_weights(model, True) if mode == "op" else (0.0, 0.0)
    f_split, f_experts = moe_time_factors(model, t, cluster.matmul_k0)
    # One pass of each part's GEMMs (forward), at their shapes; the attention core forward at its kernel's speed.
    split_pass = tokens * 2 * split / t * f_split / flops
    expert_pass = routed * 2 * expert * f_experts / flops
    core = (attention_flops + slower) / flops  # every pass's, trained or frozen weights
    matmul = (weight_passes * (split_pass + expert_pass) + core
              + (tokens * 2 * op_split / t * f_split + routed * 2 * model.top_k * op_expert * f_experts) / flops)
    compute = matmul + elementwise + permutation_bytes(model, routed, e, recompute) / cluster.memory_bandwidth
    if ep == 1:
        return compute, 0.0
    exchanges, sizes = (6, 2) if recompute else (4, 1)
    per_exchange = ep_all_to_all_time(cluster, ep, lay.ep_stride, _exchange_bytes(model, lay, tokens, e), 1, model)
    latency = (ep - 1) * cluster.link(ep, lay.ep_stride).latency
    size_exchanges = ep_all_to_all_time(cluster, ep, lay.ep_stride, sizes * 8 * (ep - 1), sizes)
    if not cluster.ep_comm_overlap or cluster.compute_units:
        return compute, exchanges * per_exchange + size_exchanges
    # Combined 1F1B: each all-to-all beside the other direction's chunk (forward dispatch | experts' backward,
    # forward combine | attention's backward, backward dispatch | experts' forward, backward combine | attention's
    # forward; a backward pass is two forwards); a recomputed block's two more all-to-alls show whole.
    attention_forward, experts_forward = split_pass + core / passes, expert_pass
    chunks = (2 * experts_forward, 2 * attention_forward, experts_forward, attention_forward)
    shown = sum(latency + max(0.0, per_exchange - latency - chunk) for chunk in chunks)
    return compute, shown + (exchanges - 4) * per_exchange + size_exchanges
