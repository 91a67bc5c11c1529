"""The planner on context parallelism: activations per rank and the masks of documents, the key/value
exchanges' time and bytes, ring attention's, the search enumerating ``cp`` only where the sequence splits and picking
it for long sequences (and the ring where the all-gather does not fit), the layout's label and strategy arguments,
the command line and ``parallel=auto``."""

from __future__ import annotations

import dataclasses
import re

import pytest

from lightning_hybrid import HybridStrategy
from lightning_hybrid.planner import Layout, ModelSpec, estimate_memory, load_cluster, model_spec, plan
from lightning_hybrid.planner.__main__ import main as planner_main
from lightning_hybrid.planner.cluster import Link
from lightning_hybrid.planner.memory import KORTHIKANTI, block_activation_bytes, korthikanti_coefficients
from lightning_hybrid.planner.time import estimate_time

#: Qwen2-7B's sizes (28 query heads, 4 key/value heads: tp at most 4 of a node's 8; vocabulary 152,064).
QWEN2_7B = ModelSpec("qwen2-7b", n_layer=28, hidden=3584, heads=28, kv_heads=4, ffn=18944, vocab=152064,
                     seq_len=32768, gated_mlp=True, bias=False, learned_positions=False)


class _StrategyWithCP:
    """A stand-in for ``HybridStrategy`` once it takes ``cp`` (strategy_kwargs reads only its signature)."""

    def __init__(self, dp=-1, tp=1, pp=1, zero_stage=0, activation_checkpointing=False, micro_batches=None,
                 schedule=None, virtual_stages=None, sequence_parallel=False, loss_parallel=True, ep=1, cp=1):
        pass


def _strategy_takes_cp() -> bool:
    import inspect

    return "cp" in inspect.signature(HybridStrategy).parameters


def test_cp_halves_activations_per_rank_plus_one_layers_attention_and_the_masks_of_documents():
    from lightning_hybrid.planner.memory import (
        codebase_coefficients,
        context_documents_bytes,
        context_mask_bytes,
        context_masks,
        context_transient_bytes,
        gathered_kv_bytes,
    )

    m = model_spec("llama2-7b", seq_len=32768)  # 32 blocks, h 4096, 32 heads of 128, vocabulary 32000
    e, s, h, L = 2, 32768, 4096, 32  # bf16-mixed activations
    block = block_activation_bytes(codebase_coefficients(m, e), s, 1, h, 32)  # one block at cp=1
    # Not kept by the checkpointed attention: SDPA's logsumexp (fp32 per head); its output is replaced by the copy
    # in the tokens' order the output projection keeps; and a rotary model's Q and K are kept as the checkpoint's
    # inputs, the fp32 sums of the rotation, rather than SDPA's bf16 casts: more kept, (4 - e) (q + kv) h per token.
    unsaved = s * (4 * 32 - (4 - e) * 2 * h)
    head = s * (h * e + 4 * 4 * 32000)  # the head's input and 4 fp32 logit-sized tensors per token
    # Plain causal batches (the default): no mask. The attention is checkpointed: a held block keeps only its 1/2
    # (its own q, k, v as the checkpoint's inputs), not the gathered K/V. Once, for the layer being computed: the
    # gathered pieces of K and V of all s tokens and their copy in the sequence's order (forward), or that copy and
    # the gradients of the longest prefix (backward): twice the gathered K and V.
    kv = 2 * 1 * s * 32 * 128 * e
    documents_kept = 8 * s  # the micro-batch's documents, int64 per token
    transient = 2 * kv
    assert gathered_kv_bytes(m, 1, e, cp=2) == kv and context_transient_bytes(m, 1, "bf16-mixed", cp=2) == transient
    one, two = (estimate_memory(m, Layout(1, 1, 1, 0, 1, 1, cp=cp), "bf16-mixed") for cp in (1, 2))
    assert one.activations == pytest.approx(L * block + head)
    assert two.activations == pytest.approx(L * (block - unsaved) / 2 + max(head / 2, transient))
    assert head / 2 > transient  # here the head's loss is the larger transient
    assert two.activations == pytest.approx(one.activations / 2 - L * unsaved / 2)
    assert (two.params, two.grads, two.optimizer) == (one.params, one.grads, one.optimizer)  # no ZeRO: whole
    # Batches with documents (packed, left padding): the micro-batch's documents (int64 per token), kept until the
    # batch's backward is done; the layer being computed holds twice the gathered K and V, and no mask: each chunk
    # attends one SDPA call per document (`document_block_attention`).
    docs = estimate_memory(m, Layout(1, 1, 1, 0, 1, 1, cp=2), "bf16-mixed", documents=True)
    doc_transient = 2 * kv
    assert context_documents_bytes(m, 1) == documents_kept
    assert context_transient_bytes(m, 1, "bf16-mixed", cp=2, documents=True) == doc_transient
    assert docs.activations == pytest.approx(L * (block - unsaved) / 2 + documents_kept
                                             + max(head / 2, doc_transient))
    # At cp=1 each block attends one SDPA call per document and keeps their outputs joined beside the calls' own:
    # s h e more per layer (measured: benchmarks/ACTIVATIONS.md, the reference GPT 4 x 128 at T=2048, fp32: packed
    # 76.30 MiB against plain 72.30, 4 layers x 1 MiB); under compile (the traceable mask) SDPA's float copy of the
    # (b, 1, s, s) mask instead, s^2 e per layer (measured before the per-document attention: 136.30 against 72.30).
    docs_one = estimate_memory(m, Layout(1, 1, 1, 0, 1, 1), "bf16-mixed", documents=True)
    assert docs_one.activations == pytest.approx(one.activations + L * s * h * e)
    compiled = estimate_memory(m, Layout(1, 1, 1, 0, 1, 1), "bf16-mixed", documents=True, compile=True)
    assert compiled.activations == pytest.approx(one.activations + L * s * s * e)
    gpt = ModelSpec("gpt-4x128", n_layer=4, hidden=128, heads=4, kv_heads=4, ffn=512, vocab=256, seq_len=2048)
    plain_gpt, packed_gpt = (estimate_memory(gpt, Layout(1, 1, 1, 0, 1, 1), "32-true", documents=d) for d in (0, 1))
    measured = (76.30 - 72.30) * 2**20
    assert packed_gpt.activations - plain_gpt.activations == 4 * 2048 * 128 * 4 == pytest.approx(measured)
    # Checkpointed: each block's input halves; beside them the head, or the recomputed block (its 1/2, SDPA's output
    # too: the attention is not checkpointed of its own) with the attention's transient (which holds SDPA's saved
    # inputs, the reordered K/V slices).
    one, two = (estimate_memory(m, Layout(1, 1, 1, 0, 1, 1, activation_checkpointing=True, cp=cp), "bf16-mixed")
                for cp in (1, 2))
    kept = s * h * 4  # the checkpoint's input: the residual stream, fp32 under bf16-mixed
    assert one.activations == pytest.approx(L * kept + max(head, block))
    assert two.activations == pytest.approx(L * kept / 2 + max(head / 2, block / 2 + transient))
    docs = estimate_memory(m, Layout(1, 1, 1, 0, 1, 1, activation_checkpointing=True, cp=2), "bf16-mixed",
                           documents=True)
    assert docs.activations == pytest.approx(L * kept / 2 + documents_kept + max(head / 2, block / 2 + doc_transient))
    # A small vocabulary: the attention's transient is the larger, taken once (not per block).
    small = ModelSpec("small-vocab", n_layer=4, hidden=512, heads=8, kv_heads=8, ffn=2048, vocab=256, seq_len=16384)
    lay = Layout(1, 1, 1, 0, 2, 1, cp=2)
    small_block = block_activation_bytes(codebase_coefficients(small, e), 16384, 2, 512, 8)
    small_transient = 2 * (2 * 2 * 16384 * 512 * e)
    small_head = 2 * 8192 * (512 * e + 4 * 4 * 256)
    assert small_transient > small_head
    assert context_transient_bytes(small, 2, "bf16-mixed", cp=2) == small_transient
    assert estimate_memory(small, lay, "bf16-mixed").activations == pytest.approx(
        4 * (small_block - 2 * 16384 * 4 * 8) / 2 + small_transient)  # learned positions: the logsumexp alone
    # With documents, under PP every micro-batch of the batch keeps its documents on every pipeline rank until the
    # schedule's backward is done; without PP one (each accumulated micro-batch is a batch). Plain batches: none.
    piped = Layout(1, 1, 2, 0, 1, 8, activation_checkpointing=True, cp=2)
    assert context_masks(piped, documents=True) == 8 and context_masks(dataclasses.replace(piped, pp=1), True) == 1
    assert context_masks(dataclasses.replace(piped, cp=1), documents=True) == 0 and context_masks(piped) == 0
    # 1F1B holds pp - rank micro-batches in flight whatever m: 8 micro-batches rather than 4 add 4 micro-batches'
    # documents (none at cp=1 or without documents).
    for cp, documents, masks in ((2, True, 4 * documents_kept), (2, False, 0), (1, True, 0)):
        eight, four = (estimate_memory(m, dataclasses.replace(piped, micro_batches=k, cp=cp), "bf16-mixed",
                                       documents=documents) for k in (8, 4))
        assert eight.activations - four.activations == pytest.approx(masks) and eight.rank == four.rank
    # Under TP the gathered K/V are the rank's heads/tp heads; the masks are whole on every TP rank.
    tp2 = estimate_memory(m, Layout(1, 2, 1, 0, 1, 1, cp=2), "bf16-mixed").activations
    tp2_cp1 = estimate_memory(m, Layout(1, 2, 1, 0, 1, 1), "bf16-mixed").activations
    assert tp2 == pytest.approx(tp2_cp1 / 2 - L * unsaved / 2 / 2)
    assert context_transient_bytes(m, 1, "bf16-mixed", tp=2, cp=2) == 2 * kv / 2
    assert context_transient_bytes(m, 1, "bf16-mixed", tp=2, cp=2, documents=True) == 2 * kv / 2
    # Grouped-query attention: K and V gathered per query head (the implementation repeats them first).
    gqa = model_spec("llama3-70b", seq_len=8192)  # 64 heads, 8 kv heads of 128
    gqa_kv = 2 * 2 * 8192 * (64 // 8) * 128 * 2
    assert gathered_kv_bytes(gqa, 2, 2, tp=8, cp=4) == gqa_kv
    assert context_mask_bytes(gqa, 2, 1, cp=4) == 2 * 1024 * 8192
    assert context_transient_bytes(gqa, 2, "bf16-mixed", tp=8, cp=4) == pytest.approx(2 * gqa_kv)
    assert context_transient_bytes(gqa, 2, "bf16-mixed", tp=8, cp=4, documents=True) == pytest.approx(2 * gqa_kv)
    # Korthikanti's block (megatron): its s x s scores term is not held (recomputed) and is the one layer's
    # transient, in place of the float mask: 5 b (a/tp) (s/cp) s bytes.
    scores = 5 * 2 * (64 / 8) * 2048 * 8192
    assert context_transient_bytes(gqa, 2, "megatron", tp=8, cp=4) == pytest.approx(2 * gqa_kv + scores)
    assert context_transient_bytes(gqa, 2, "megatron", tp=8, cp=4, documents=True) == pytest.approx(
        2 * gqa_kv + scores)
    assert context_transient_bytes(gqa, 2, "bf16-mixed", tp=8, cp=1) == 0
    meg = estimate_memory(m, Layout(1, 1, 1, 0, 1, 1, cp=2), "megatron").activations
    korthikanti_held = block_activation_bytes(korthikanti_coefficients(m, scores=False), s, 1, h, 32, cp=2)
    assert meg == pytest.approx(L * korthikanti_held + max(head / 2, context_transient_bytes(m, 1, "megatron", cp=2)))
    # Korthikanti's s x s scores become (s/cp) x s per rank: the whole block's bytes / cp.
    s2, b, h2, a = 2048, 1, 12288, 96
    assert block_activation_bytes(KORTHIKANTI, s2, b, h2, a, tp=8, cp=4) == pytest.approx(
        s2 / 4 * b * h2 * (10 + 24 / 8 + 5 * a * s2 / (h2 * 8)))
    # ZeRO shards over dp*cp: ZeRO-1's Adam states (8 bytes per parameter) over dp2 x cp2 = 4 ranks.
    P = m.params
    zero1 = estimate_memory(m, Layout(2, 1, 1, 1, 1, 1, cp=2), "bf16-mixed")
    assert zero1.optimizer == pytest.approx(8 * P / 4) and zero1.params == 4 * P
    assert estimate_memory(m, Layout(1, 1, 1, 1, 1, 1, cp=2), "bf16-mixed").optimizer == pytest.approx(8 * P / 2)


def test_kv_exchange_time_and_bytes_by_hand():
    from lightning_hybrid.planner.time import kv_exchange_bytes, kv_exchanges

    m = model_spec("n_layer=2,n_embd=64,n_head=4,n_kv_head=2,block_size=4096")  # 4 heads (2 kv heads) of 16
    intra, inter = Link(1e9, 1e-6), Link(1e8, 1e-5)
    cluster = dataclasses.replace(load_cluster("a100"), precision="32-true", intra=intra, inter=inter)
    lay = Layout(1, 2, 1, 0, 2, 3, cp=4)  # cp4 x tp2 = 8 ranks of one node; 2 x 4096-token sequences, 3 micro-batches
    # K and V of b=2 sequences for the rank's heads/tp = 2 query heads of 16, fp32 (what a rank holds: GQA's kv heads
    # repeated after the gather); the exchanges carry the kv heads, kv_heads/heads = 1/2 of it.
    kv = 2 * 2 * 4096 * (4 // 2) * 16 * 4 / 2
    # Per block and micro-batch: an all-gather of K and of V in forward; in backward the checkpointed attention's
    # recomputation gathers them again, then a reduce-scatter of each gradient; each a ring of cp - 1 steps sending
    # (cp - 1)/cp of the bytes; not overlapped. Per micro-batch the int64 positions' all-gather, for its mask.
    ring = 2 * 3 * intra.latency + 3 / 4 * kv / intra.bandwidth  # two collectives (K, V) over 4 ranks
    positions = 3 * intra.latency + 3 / 4 * 8 * 2 * 4096 / intra.bandwidth
    t = estimate_time(m, lay, cluster)
    assert kv_exchanges(lay) == 3
    assert t.cp_comm == pytest.approx(3 * (2 * (ring + ring + ring) + positions))  # micro-batches x (blocks x 3 + 1)
    assert t.total > t.compute + t.cp_comm
    assert kv_exchange_bytes(m, lay, precision="32-true") == 3 * 2 * 3 * 3 / 4 * kv
    assert kv_exchange_bytes(m, lay, precision="32-true", gathers_kv_heads=False) == 3 * 2 * 3 * 3 / 4 * kv * 2
    # Activation checkpointing: the attention is not checkpointed of its own; the layer's recomputation gathers
    # again instead of the attention's: 3 exchanges too.
    checkpointed = dataclasses.replace(lay, activation_checkpointing=True)
    assert kv_exchanges(checkpointed) == 3
    assert estimate_time(m, checkpointed, cluster).cp_comm == pytest.approx(3 * (2 * 3 * ring + positions))
    assert kv_exchange_bytes(m, checkpointed, precision="32-true") == 3 * 2 * 3 * 3 / 4 * kv
    # cp8 x tp2 = 16 ranks: the cp group spans two nodes, so the exchange runs at the inter-node link.
    wide = Layout(1, 2, 1, 0, 2, 3, cp=8)
    ring = 2 * 7 * inter.latency + 7 / 8 * kv / inter.bandwidth
    positions = 7 * inter.latency + 7 / 8 * 8 * 2 * 4096 / inter.bandwidth
    assert estimate_time(m, wide, cluster).cp_comm == pytest.approx(3 * (2 * 3 * ring + positions))
    # gloo (a CPU cluster) has no reduce-scatter of its own: backward all-reduces the gathered gradients.
    cpu = dataclasses.replace(cluster, compute_units=8)
    ring = 2 * 3 * intra.latency + 3 / 4 * kv / intra.bandwidth
    positions = 3 * intra.latency + 3 / 4 * 8 * 2 * 4096 / intra.bandwidth
    all_reduce = 2 * 2 * 3 * intra.latency + 2 * 3 / 4 * kv / intra.bandwidth
    assert estimate_time(m, lay, cpu).cp_comm == pytest.approx(3 * (2 * (2 * ring + all_reduce) + positions))
    plain = Layout(1, 2, 1, 0, 2, 3)
    assert estimate_time(m, plain, cluster).cp_comm == kv_exchange_bytes(m, plain) == kv_exchanges(plain) == 0
    # Compute per rank: 1/cp of the FLOPs (s/cp queries against all s keys), plus the attention core's forward once
    # more (the checkpointed attention recomputed: 4 h s FLOPs per local token, over tp); with activation
    # checkpointing the recomputed layer's forward (counted already) includes it. Element-wise traffic left out here.
    flat = dataclasses.replace(cluster, memory_bandwidth=float("inf"))
    base = estimate_time(m, plain, flat).compute
    core = 3 * 2 * (2 * 4096 // 4) * 4 * 64 * 4096 / 2 / flat.achievable_flops("32-true")  # m x blocks x ...
    assert estimate_time(m, lay, flat).compute == pytest.approx(base / 4 + core)
    assert estimate_time(m, checkpointed, flat).compute == pytest.approx(
        estimate_time(m, dataclasses.replace(checkpointed, cp=1), flat).compute / 4)
    # Element-wise traffic, read and written (3 passes over the bytes, per block and micro-batch): the gathered K/V
    # and their copy in the sequence's order; with documents the same (attended per document, no masks).
    assert estimate_time(m, lay, cluster, documents=True).compute == estimate_time(m, lay, cluster).compute
    # Collectives counted for collective_overhead (dp1 x cp4, no TP: one DP bucket besides): per micro-batch 2
    # blocks x 2 (K, V) x 3 exchanges (checkpointed too) and the positions' gather.
    solo = Layout(1, 1, 1, 0, 2, 3, cp=4)
    for layout in (solo, dataclasses.replace(solo, activation_checkpointing=True)):
        slow = dataclasses.replace(cluster, collective_overhead=1.0)
        assert estimate_time(m, layout, slow).total - estimate_time(m, layout, cluster).total == pytest.approx(
            3 * (2 * 2 * 3 + 1) + 1)
    # Gradients reduced over dp*cp: dp1 x cp2 steps and reduces as dp2 does (here under PP: nothing overlapped).
    a = estimate_time(m, Layout(1, 1, 2, 1, 1, 4, cp=2), cluster)
    b = estimate_time(m, Layout(2, 1, 2, 1, 1, 4), cluster)
    assert a.dp_comm == b.dp_comm > 0 and a.optimizer == b.optimizer


def test_the_search_enumerates_cp_only_where_the_sequence_splits():
    from collections import Counter

    from lightning_hybrid.planner.search import MIN_CP_TOKENS, enumerate_layouts

    cluster = load_cluster("h100")
    # 4100 tokens: 2*cp divides them for cp 2 only (4100 = 4 x 1025); cp 4 and 8 are turned away and counted.
    odd = model_spec("n_layer=2,n_embd=64,n_head=4", seq_len=4100)
    invalid = Counter()
    layouts = list(enumerate_layouts(odd, cluster, 8, 8, invalid=invalid))
    assert {lay.cp for lay in layouts} == {1, 2}
    assert invalid["seq_len not divisible by 2*cp"] > 0
    for lay in layouts:
        assert lay.devices == 8 and lay.dp * lay.micro_batch * lay.micro_batches == 8
        assert odd.seq_len % (2 * lay.cp) == 0 and (lay.zero_stage == 0 or lay.dp * lay.cp > 1)
    with pytest.raises(ValueError, match="does not divide by 2\\*cp = 8"):
        estimate_memory(odd, Layout(2, 1, 1, 0, 1, 4, cp=4), "bf16-mixed")
    # 8192 tokens: every cp that leaves a rank >= MIN_CP_TOKENS tokens (cp <= 4); ZeRO with dp 1 when cp > 1.
    long = odd.with_seq_len(8192)
    invalid = Counter()
    layouts = list(enumerate_layouts(long, cluster, 8, 8, invalid=invalid))
    assert MIN_CP_TOKENS == 2048 and {lay.cp for lay in layouts} == {1, 2, 4}
    assert invalid[f"cp: fewer than {MIN_CP_TOKENS} tokens of a sequence per rank"] > 0
    assert any(lay.dp == 1 and lay.cp > 1 and lay.zero_stage for lay in layouts)
    assert {lay.cp for lay in enumerate_layouts(long, cluster, 8, 8, min_cp_tokens=1024)} == {1, 2, 4, 8}
    assert {lay.cp for lay in enumerate_layouts(long, cluster, 8, 8, context_parallel=False)} == {1}
    # Ordinary sequence lengths: no cp at all, so the search (and every number of the cp=1 layouts) is as before.
    assert {lay.cp for lay in enumerate_layouts(model_spec("gpt3-175b"), load_cluster("a100"), 64, 64)} == {1}
    # Expert parallelism carved out of the dp*cp ranks.
    moe = model_spec("small-moe", seq_len=8192)
    eps = {(lay.dp, lay.cp, lay.ep) for lay in enumerate_layouts(moe, cluster, 4, 4)}
    assert (1, 4, 4) in eps and all((dp * cp) % ep == 0 for dp, cp, ep in eps)


def test_the_search_picks_cp_for_long_sequences_and_only_cp_fits_the_longest():
    cluster = load_cluster("h100")
    # 32k tokens on 8 H100s: layouts with and without cp fit, and cp is among those ranked.
    result = plan(QWEN2_7B, cluster, devices=8, global_batch=8)
    assert {c.layout.cp for c in result.ranked} >= {1, 2}
    assert all(c.layout.devices == 8 and QWEN2_7B.seq_len % (2 * c.layout.cp) == 0 for c in result.ranked)
    cp_best = next(c for c in result.ranked if c.layout.cp > 1)
    assert cp_best.time.cp_comm > 0 and cp_best.time.as_dict()["cp_comm"] == cp_best.time.cp_comm
    # 96k tokens: tp stops at 4 (4 kv heads), and without cp no layout's activations fit; with cp2 some do.
    result = plan(QWEN2_7B.with_seq_len(98304), cluster, devices=8, global_batch=8)
    assert result.ranked and all(c.layout.cp > 1 for c in result.ranked)
    assert any(c.layout.cp == 1 for c in result.too_big)
    smallest_without = next(c for c in result.too_big if c.layout.cp == 1)
    assert smallest_without.memory.activations > result.best.memory.activations
    best = result.best.layout
    kwargs = best.strategy_kwargs(_StrategyWithCP)
    assert kwargs["cp"] == best.cp > 1 and kwargs["dp"] * kwargs["tp"] * kwargs["pp"] * kwargs["cp"] == 8
    assert plan(QWEN2_7B.with_seq_len(98304), cluster, 8, 8, context_parallel=False).ranked == []
    # 128k tokens: plain causal batches fit under cp with checkpointing -- cp2 with ZeRO 1-2, cp4 and cp8 only under
    # ZeRO-3 reduce-scattering every micro-batch (the strategy's grad_reduce="auto" for gradients this large: the
    # window's unsharded gradients would not fit); batches with documents too (each chunk attends per document, no
    # mask), with each micro-batch's documents (int64 per token) more.
    longest = QWEN2_7B.with_seq_len(131072)
    fits = plan(longest, cluster, 8, 8).ranked
    assert fits and all(c.layout.cp >= 2 and c.layout.activation_checkpointing for c in fits)
    assert any(c.layout.cp == 2 for c in fits)
    assert all(c.layout.zero_stage == 3 and c.layout.grad_reduce == "micro_batch" for c in fits if c.layout.cp > 2)
    with_documents = {c.layout: c for c in plan(longest, cluster, 8, 8, documents=True).ranked}
    assert with_documents and set(with_documents) <= {c.layout for c in fits}
    for c in fits:
        if c.layout in with_documents:
            assert with_documents[c.layout].memory.total > c.memory.total
    if _strategy_takes_cp():  # the strategy's own checks pass
        for c in result.ranked:
            HybridStrategy(**c.layout.strategy_kwargs())


def test_layout_label_and_strategy_arguments_name_cp():
    lay = Layout(2, 2, 1, 1, 1, 4, cp=2)
    assert lay.label() == "dp2xtp2 cp2 zero1 mb1x4" and lay.devices == 8 and lay.shard == 4
    assert Layout(2, 2, 2, 0, 1, 4, ep=2, cp=2).label() == "dp2xtp2xpp2 cp2 ep2 mb1x4 1f1b"
    assert lay.strategy_kwargs(_StrategyWithCP)["cp"] == 2
    assert "cp" not in Layout(2, 2, 1, 1, 1, 4).strategy_kwargs(_StrategyWithCP)
    assert "cp" not in Layout(2, 2, 1, 1, 1, 4).label()

    class NoCP:
        def __init__(self, dp=-1, tp=1, pp=1, zero_stage=0, activation_checkpointing=False):
            pass

    with pytest.raises(ValueError, match="takes no cp"):
        lay.strategy_kwargs(NoCP)
    assert lay.as_dict()["cp"] == 2
    with pytest.raises(ValueError, match="cp=0 is invalid"):
        Layout(2, 1, 1, 0, 1, 1, cp=0)
    assert Layout(1, 1, 1, 0, 1, 1, ep=2, cp=2).edp == 1  # ep divides dp*cp
    with pytest.raises(ValueError, match="divisor of dp\\*cp"):
        Layout(1, 1, 1, 0, 1, 1, ep=4, cp=2)


def test_command_line_and_parallel_auto_name_cp(capsys, monkeypatch):
    from omegaconf import OmegaConf

    import lightning_hybrid
    from lightning_hybrid.planner.auto import _recipe_layout, choose_layout

    assert planner_main(["--model", "llama2-7b", "--seq-len", "131072", "--cluster", "h100", "--devices", "8",
                         "--global-batch", "8", "--top", "200"]) == 0
    out = capsys.readouterr().out
    assert " cp2 " in out and re.search(r" cp \d", out)  # cp in the layouts, and the key/value exchange's time
    assert planner_main(["--model", "llama2-7b", "--seq-len", "131072", "--cluster", "h100", "--devices", "8",
                         "--global-batch", "8", "--top", "200", "--no-context-parallel"]) == 0
    assert " cp2 " not in capsys.readouterr().out
    # parallel=auto writes the layout's cp into the recipe's parallel node (the strategy taking cp).
    monkeypatch.setattr(lightning_hybrid, "HybridStrategy", _StrategyWithCP)
    cfg = OmegaConf.create({
        "model": {"_target_": "lightning_hybrid.models.GPTLightningModule", "n_layer": 28, "n_embd": 3584,
                  "n_head": 28, "n_kv_head": 4, "mlp": "swiglu", "vocab_size": 152064, "bias": False},
        "data": {"batch_size": 8, "block_size": 98304}, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1},
        "trainer": {"devices": 8, "num_nodes": 1, "accumulate_grad_batches": 1, "accelerator": "gpu"},
        "planner": {"cluster": "h100", "global_batch": None, "show": 3}})
    out_cfg, why = choose_layout(cfg)
    # (the stand-in takes no cp_attention: the all-gather only)
    best = plan(ModelSpec.from_gpt({k: v for k, v in cfg.model.items() if k != "_target_"}, 98304, name="gpt"),
                load_cluster("h100"), 8, 8, ring_attention=False).best.layout
    assert best.cp > 1 and out_cfg.parallel.cp == best.cp and out_cfg.parallel.dp == best.dp
    assert out_cfg.trainer.devices == 8 and why.endswith(f"planner: running {best.label()}") and " cp" in why
    # A run's own layout read back for its prediction: cp from the world (dp without it) or from parallel.cp.
    world = {"dp": 2, "tp": 2, "pp": 1, "cp": 2}
    run = OmegaConf.merge(OmegaConf.to_container(out_cfg), {"parallel": {
        "zero_stage": 1, "micro_batches": None, "schedule": None, "virtual_stages": None,
        "activation_checkpointing": False}})
    assert _recipe_layout(run, world)[0].cp == 2 and _recipe_layout(run, world)[0].dp == 2
    run.parallel.cp = 2
    assert _recipe_layout(run, {"dp": 4, "tp": 2, "pp": 1})[0].dp == 2  # world without cp: dp over tp*pp


def test_parallel_auto_plans_for_documents_when_the_data_packs_or_pads_rows():
    """`parallel=auto` tells the planner the batches hold documents (their masks in memory) for a data config that
    packs or pads rows (`SFTDataModule`'s ``pack``), or as ``planner.documents`` says."""
    from omegaconf import OmegaConf

    from lightning_hybrid.planner.auto import _documents

    sft = OmegaConf.create({"data": {"pack": True, "batch_size": 2}, "planner": {"documents": None}})
    corpus = OmegaConf.create({"data": {"block_size": 64, "batch_size": 2}, "planner": {"documents": None}})
    assert _documents(sft) and not _documents(corpus)
    assert not _documents(OmegaConf.merge(sft, {"planner": {"documents": False}}))
    assert _documents(OmegaConf.merge(corpus, {"planner": {"documents": True}}))


# ------------------------------------------------------------------------------------------------ ring attention
def test_ring_attention_memory_time_and_bytes_by_hand():
    from lightning_hybrid.planner.context_memory import context_transient_bytes, gathered_kv_bytes
    from lightning_hybrid.planner.time import kv_exchange_bytes, kv_exchange_time

    m = model_spec("n_layer=2,n_embd=64,n_head=4,n_kv_head=2,block_size=4096")  # 4 heads (2 kv heads) of 16
    ring = Layout(1, 2, 1, 0, 2, 3, cp=4, cp_attention="ring")
    gather = dataclasses.replace(ring, cp_attention="all_gather")
    # What the ring holds (its backward, measured: `ring_transient_bytes`), u the rank's own K and V at its 2 query
    # heads, fp32: two ranks' K/V (the kv heads, 1/2 of u each), two ranks' fp32 gradients of them, five fp32
    # tensors of the queries' size (u/2 each), and one chunk pair's K/V repeated to the query heads (u/2).
    u = 2 * 2 * (4096 // 4) * 2 * 16 * 4
    held = 2 * u / 2 + 2 * u / 2 + 5 * u / 2 + u / 2
    assert context_transient_bytes(m, 2, "32-true", 2, 4, ring=True) == held
    assert context_transient_bytes(m, 2, "32-true", 2, 4) == 2 * gathered_kv_bytes(m, 2, 4, 2, 4) == 2 * 4 * u
    assert context_transient_bytes(m, 2, "32-true", 2, 4, documents=True, ring=True) == held  # no mask either way
    # Bytes a rank sends per block and micro-batch: cp - 1 transfers of its K/V (kv heads) in the forward and the
    # backward (the ring is not checkpointed; with activation checkpointing the recomputed forward's too), and cp of
    # their fp32 gradients; 2 blocks x 3 micro-batches.
    kv = u / 2
    assert kv_exchange_bytes(m, ring, precision="32-true") == 2 * 3 * (2 * 3 * kv + 4 * kv)
    checkpointed = dataclasses.replace(ring, activation_checkpointing=True)
    assert kv_exchange_bytes(m, checkpointed, precision="32-true") == 2 * 3 * (3 * 3 * kv + 4 * kv)
    # Time: each step's transfer under 1/cp of the pass's attention (the backward's under twice that); what exceeds
    # it shows, and the last gradients' transfer home always does.
    link = Link(1e9, 1e-6)
    cluster = dataclasses.replace(load_cluster("a100"), precision="32-true", intra=link, inter=link)
    home = link.latency + kv / link.bandwidth
    assert kv_exchange_time(m, ring, cluster, attention=1.0) == pytest.approx(home)  # all hidden but the last
    step = link.latency + kv / link.bandwidth
    both = link.latency + 2 * kv / link.bandwidth
    exposed = 3 * step + (step + 2 * both + step) + home  # nothing to hide under
    assert kv_exchange_time(m, ring, cluster) == pytest.approx(exposed)
    assert kv_exchange_time(m, checkpointed, cluster) == pytest.approx(exposed + 3 * step)  # the recomputed ring
    under = 4 * 0.4 * step  # a quarter of it a step: 0.4 of a transfer hidden forward, 0.8 of one backward
    part = 3 * 0.6 * step + (0.2 * step + 2 * (both - 0.8 * step) + 0.2 * step) + home
    assert kv_exchange_time(m, ring, cluster, attention=under) == pytest.approx(part)
    # In the step: the forward pass's attention core at the kernel's speed is what estimate_time hands it.
    tokens, h, flops = 2 * 4096 // 4, 64, cluster.achievable_flops("32-true")
    attention = tokens * 4 * h * 4096 / 2 / (flops * cluster.attention_speed)
    t = estimate_time(m, ring, cluster)
    positions = 3 * link.latency + 3 / 4 * 8 * 2 * 4096 / link.bandwidth
    assert t.cp_comm == pytest.approx(3 * (2 * kv_exchange_time(m, ring, cluster, attention) + positions))
    # Not checkpointed: no second forward of the attention core (the all-gather's checkpoint recomputes it), and a
    # held block keeps 1/cp of what it keeps at cp=1 (the ring's output and log-sum-exp, as SDPA keeps them).
    flat = dataclasses.replace(cluster, memory_bandwidth=float("inf"))
    core = 3 * 2 * tokens * 4 * h * 4096 / 2 / flat.achievable_flops("32-true")  # micro-batches x blocks x ...
    assert estimate_time(m, gather, flat).compute - estimate_time(m, ring, flat).compute == pytest.approx(core)
    from lightning_hybrid.planner.activations import block_activations

    whole = block_activations(m, dataclasses.replace(gather, cp=1), "32-true")[0]
    assert block_activations(m, ring, "32-true")[0] == pytest.approx(whole / 4)
    assert block_activations(m, gather, "32-true")[0] < whole / 4  # the checkpointed attention's output not kept
    # A long sequence's attention hides the ring's transfers but the gradients' last (fp32, home): at cp2 (NVLink)
    # 2/3 of the all-gathers' three exchanges of the rank's own K/V (bf16); at cp4 less than half.
    long, h100 = model_spec("llama2-7b", seq_len=131072), load_cluster("h100")
    for cp, ratio in ((2, 2 / 3), (4, 0.5)):
        ring_t, gather_t = (estimate_time(long, Layout(1, 8, 1, 0, 1, 8, cp=cp, cp_attention=kind,
                                                       sequence_parallel=True), h100).cp_comm
                            for kind in ("ring", "all_gather"))
        assert ring_t < gather_t * ratio * 1.01


def test_ring_attention_in_the_search_label_arguments_and_command_line(capsys):
    from lightning_hybrid.planner.__main__ import parse_layout
    from lightning_hybrid.planner.search import enumerate_layouts, evaluate

    lay = Layout(2, 2, 1, 1, 1, 4, cp=2, cp_attention="ring")
    assert lay.label() == "dp2xtp2 cp2 ring zero1 mb1x4"
    assert lay.strategy_kwargs(HybridStrategy)["cp_attention"] == "ring"
    assert "cp_attention" not in dataclasses.replace(lay, cp_attention="all_gather").strategy_kwargs(HybridStrategy)
    with pytest.raises(ValueError, match="takes no cp_attention"):
        lay.strategy_kwargs(_StrategyWithCP)
    for bad in ({"cp_attention": "ring"}, {"cp_attention": "ulysses", "cp": 2}):
        with pytest.raises(ValueError, match="cp_attention="):
            Layout(2, 1, 1, 0, 1, 1, **bad)
    m = model_spec("llama2-7b", seq_len=131072)
    assert parse_layout("dp1xtp8 cp2 ring mb1x8", m, 16, 8).cp_attention == "ring"
    with pytest.raises(ValueError, match="needs cp > 1"):
        parse_layout("dp2xtp8 ring mb1x4", m, 16, 8)
    # Every CP layout in both kinds (ring_attention=False: the all-gather only); none without CP.
    h100 = load_cluster("h100")
    layouts = list(enumerate_layouts(m, h100, 16, 8))
    rings = [x for x in layouts if x.cp_attention == "ring"]
    assert rings and all(x.cp > 1 for x in rings)
    assert len(rings) == sum(x.cp > 1 for x in layouts) // 2
    assert not any(x.cp_attention == "ring" for x in enumerate_layouts(m, h100, 16, 8, ring_attention=False))
    # Where the whole sequence's keys and values do not fit and the ring's do, the ring is what fits.
    # (A small vocabulary: the attention's transient, not the head's loss, is the larger one.)
    wide = ModelSpec("wide", n_layer=8, hidden=4096, heads=32, kv_heads=32, ffn=16384, vocab=256, seq_len=131072)
    gather = Layout(1, 1, 1, 0, 1, 8, cp=8, recompute="pointwise")
    ring = dataclasses.replace(gather, cp_attention="ring")
    peaks = [estimate_memory(wide, x, "bf16-mixed").total for x in (gather, ring)]
    assert peaks[1] < peaks[0]
    from lightning_hybrid.planner.cluster import USABLE_MEMORY

    tight = dataclasses.replace(h100, memory=(peaks[0] + peaks[1]) / 2 / USABLE_MEMORY)
    assert evaluate(wide, gather, tight, 8).reason and not evaluate(wide, ring, tight, 8).reason
    # The search skips a ring whose all-gather twin does not fit by more than the ring's transient saves: every
    # skipped one, evaluated, does not fit.
    result = plan(m, h100, 16, 8)
    skipped = sum(n for why, n in result.invalid.items() if why.startswith("ring attention"))
    seen = {c.layout.label() for c in result.ranked + result.too_big}
    unseen = [x for x in rings if evaluate(m, x, h100, 8).layout.label() not in seen]
    assert skipped == len(unseen) > 0 and not any(evaluate(m, x, h100, 8).fits for x in unseen)
    assert planner_main(["--model", "llama2-7b", "--seq-len", "131072", "--cluster", "h100", "--devices", "16",
                         "--global-batch", "8", "--layout", "dp1xtp8 cp2 ring mb1x8 pw sp"]) == 0
    assert "cp2 ring" in capsys.readouterr().out


def test_parallel_auto_tries_ring_attention_only_for_models_attending_without_dropout():
    from omegaconf import OmegaConf

    from lightning_hybrid.planner.auto import _recipe_layout, _without_attention_dropout

    gpt = OmegaConf.create({"model": {"_target_": "lightning_hybrid.models.GPTLightningModule", "dropout": 0.0}})
    assert _without_attention_dropout(gpt)
    assert not _without_attention_dropout(OmegaConf.merge(gpt, {"model": {"dropout": 0.1}}))
    assert not _without_attention_dropout(OmegaConf.create({"model": {"_target_": "my.Module"}}))  # unknown: no ring
    # A run's own layout read back for its prediction names its cp_attention.
    run = OmegaConf.create({"data": {"batch_size": 4}, "trainer": {"accumulate_grad_batches": 1}, "parallel": {
        "zero_stage": 0, "micro_batches": None, "schedule": None, "virtual_stages": None, "cp": 2,
        "activation_checkpointing": False, "cp_attention": "ring"}})
    assert _recipe_layout(run, {"dp": 2, "tp": 1, "pp": 1})[0].cp_attention == "ring"
