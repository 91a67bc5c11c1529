"""Context parallelism: each sequence split over the CP ranks (the zigzag split), attention over the whole sequence
(keys and values all-gathered, the mask of the whole sequence: causal, padded, packed documents), every layout
equal to one device -- on the reference GPT and on transformers families, composed with DP, TP + SP, PP, ZeRO,
activation checkpointing and reshardable checkpoints."""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_hybrid import HybridStrategy
from lightning_hybrid.core.batch import TokenBatch, document_causal_mask
from lightning_hybrid.data.corpus import ByteCorpusDataModule
from lightning_hybrid.parallel.context_parallel import split_batch, zigzag_indices
from lightning_hybrid.runtime.rank_zero import BatchError
from lightning_hybrid.testing import run_distributed
from tests.helpers import QUIET_TRAINER
from tests.parity import RTOL, check_world
from tests.strategy.test_strategy_parity import gpt

pytest.importorskip("transformers")

from lightning_hybrid.hf import CausalLM  # noqa: E402
from tests.families import tiny_config  # noqa: E402

HF_TOLERANCES = (RTOL, 1e-5)


def _hf(family: str, **overrides) -> CausalLM:
    config = tiny_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    return CausalLM(config, lr=2e-4)


# ---------------------------------------------------------------------------------------------- the split
@pytest.mark.parametrize("cp", [2, 4])
def test_the_zigzag_split_gives_each_rank_two_chunks_and_every_token_once(cp):
    shares = [zigzag_indices(16, cp, r) for r in range(cp)]
    assert torch.equal(torch.cat(shares).sort().values, torch.arange(16))
    chunk = 16 // (2 * cp)
    assert shares[0].tolist()[:chunk] == list(range(chunk)) and shares[0].tolist()[-1] == 15  # first and last
    with pytest.raises(ValueError, match="multiple of 8"):
        zigzag_indices(12, 4, 0)


def test_a_split_batch_keeps_the_positions_labels_and_padding_of_the_whole_sequence():
    ids = torch.arange(16).view(2, 8)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0  # right padding
    whole = TokenBatch.from_batch({"input_ids": ids, "attention_mask": mask})
    for rank in range(2):
        part = split_batch({"input_ids": ids, "attention_mask": mask}, 2, rank)
        places = zigzag_indices(8, 2, rank)
        assert torch.equal(part.input_ids, ids[:, places])
        assert torch.equal(part.labels, whole.labels[:, places])  # shifted over the whole sequence
        assert torch.equal(part.padding, mask.bool()[:, places])
        assert TokenBatch.from_batch(part) is part  # what the module reads
    pair = split_batch((ids, ids + 1), 2, 1)  # an (x, y) pair: positions 0..T-1 of the whole
    assert torch.equal(pair.position_ids, torch.arange(8)[zigzag_indices(8, 2, 1)].expand(2, -1))
    assert pair.padding is None and torch.equal(pair.labels, (ids + 1)[:, zigzag_indices(8, 2, 1)])
    with pytest.raises(TypeError, match="read it with TokenBatch.from_batch"):  # a module unpacking (x, y)
        x, y = pair
    # ... while Lightning finds its batch size (`self.log` without batch_size reads the batch: a user module's does).
    from lightning.pytorch.utilities.data import extract_batch_size

    assert extract_batch_size(pair) == 2
    # Packed documents whose positions on a rank happen to count 0, 1, ...: they still travel (the mask needs them).
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])  # rank 0 holds places 0, 1, 6, 7: positions 0, 1, 2, 3
    part = split_batch({"input_ids": ids[:1], "position_ids": packed}, 2, 0)
    assert torch.equal(part.position_ids, torch.tensor([[0, 1, 2, 3]]))


def test_each_chunks_mask_is_the_whole_sequences_mask_cut_to_its_queries_and_keys():
    """The mask each of a rank's chunks attends under (`block_mask`: its queries against the keys of the sequence
    up to its last token) equals one device's document mask (`document_causal_mask`) cut to those rows and
    columns, for every chunk of every rank."""
    from lightning_hybrid.core.batch import document_ids
    from lightning_hybrid.core.document_attention import block_mask

    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7],
                              [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 0, 1, 2, 3]])  # documents across chunks
    whole = document_causal_mask(positions)
    docs = document_ids(positions)
    cp, chunk = 4, 2
    for rank in range(cp):
        for index in (rank, 2 * cp - 1 - rank):
            start, end = index * chunk, (index + 1) * chunk
            assert torch.equal(block_mask(docs, start, end), whole[:, :, start:end, :end])


@pytest.mark.parametrize("window", [None, 3])
def test_each_chunk_attends_its_documents_as_under_its_mask(window):
    """What a rank's chunk computes with documents (`document_block_attention`: one SDPA call per document it meets,
    no mask) is SDPA under the chunk's mask (`block_mask`, a sliding window's too): values and gradients."""
    import torch.nn.functional as F

    from lightning_hybrid.core.batch import document_ids
    from lightning_hybrid.core.document_attention import block_mask, document_block_attention, document_spans

    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7],
                              [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 0, 1, 2, 3]])
    docs, spans = document_ids(positions), document_spans(positions)
    g = torch.Generator().manual_seed(0)
    for start, end in ((0, 4), (4, 8), (8, 12), (12, 16), (4, 12)):
        q = torch.randn(2, 4, end - start, 8, generator=g, requires_grad=True)
        k, v = (torch.randn(2, 2, end, 8, generator=g, requires_grad=True) for _ in range(2))
        mask = block_mask(docs, start, end, window)
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        ours = document_block_attention(q, k, v, spans, start, window=window)
        torch.testing.assert_close(ours, masked, rtol=0, atol=1e-6)
        out_grad = torch.randn(masked.shape, generator=g)
        for a, b in zip(*(torch.autograd.grad(y, (q, k, v), out_grad) for y in (ours, masked))):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


def test_the_key_value_groups_are_read_from_the_modules_config():
    """`kv_group_of`: query heads per key/value head from the reference GPT's config or a transformers config (the
    module's or its ``model``'s); None where no config says (GPT-NeoX has no key/value heads of its own: the ranks
    then go by the shapes only)."""
    from lightning_hybrid.models import GPTConfig, GPTLightningModule
    from lightning_hybrid.parallel.context_parallel.layers import kv_group_of

    gqa = GPTLightningModule(config=GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=4, n_kv_head=2,
                                              n_embd=32))
    assert kv_group_of(gqa) == 2 and kv_group_of(_hf("llama")) == 2 and kv_group_of(_hf("gpt_neox")) is None
    assert kv_group_of(torch.nn.Linear(2, 2)) is None


# ---------------------------------------------------------------------------------------------- layouts
def test_context_parallel_layouts_match_one_device_on_4_ranks():
    """cp4, dp2 x cp2 with ZeRO-3, cp2 x tp2 with SP, cp2 x pp2 with selective recompute: the reference GPT and
    transformers families (one a mixture of experts under EP, two with sliding windows: Mistral's on every layer,
    Qwen2's on its second), with causal, padded and packed batches; the keys and values all-gathered, or passed
    around a ring (``cp_attention="ring"``)."""
    check_world(4, {
        "cp4-packed-gpt": (dict(dp=1, cp=4), gpt(), {"data": "packed"}),
        "dp2xcp2-zero3-padded-gpt": (dict(dp=2, cp=2, zero_stage=3), gpt(), {"data": "padded"}),
        "cp2xtp2-sp-gpt": (dict(dp=1, cp=2, tp=2, sequence_parallel=True), gpt(), {}),
        "cp2xpp2-recompute-packed-gpt": (dict(dp=1, cp=2, pp=2, micro_batches=2, recompute="attention"), gpt(),
                                         {"data": "packed"}),
        "dp2xcp2-zero3-packed-llama": (dict(dp=2, cp=2, zero_stage=3), partial(_hf, "llama"), {"data": "packed"},
                                       HF_TOLERANCES),
        "cp2xtp2-sp-padded-qwen2": (dict(dp=1, cp=2, tp=2, sequence_parallel=True), partial(_hf, "qwen2"),
                                    {"data": "padded"}, HF_TOLERANCES),
        # A sliding window of 8 tokens over sequences of 32: kept by the CP attention's mask (pipeline included).
        "cp2xpp2-checkpointed-window-mistral": (dict(dp=1, cp=2, pp=2, micro_batches=2,
                                                     activation_checkpointing=True),
                                                partial(_hf, "mistral", sliding_window=8), {"data": "packed"},
                                                HF_TOLERANCES),
        # Ring attention (the keys and values passed around the CP group): a window on one layer of two; documents.
        "cp4-ring-window-qwen2": (dict(dp=1, cp=4, cp_attention="ring"),
                                  partial(_hf, "qwen2", use_sliding_window=True, sliding_window=6,
                                          layer_types=["full_attention", "sliding_attention"]), {}, HF_TOLERANCES),
        "cp4-ring-packed-gpt_neox": (dict(dp=1, cp=4, cp_attention="ring"), partial(_hf, "gpt_neox"),
                                     {"data": "packed"}, HF_TOLERANCES),
        # experts over EP ranks of dp * cp, the load-balancing loss over every rank's tokens
        "dp2xcp2-ep2-padded-olmoe": (dict(dp=2, cp=2, ep=2), partial(_hf, "olmoe"), {"data": "padded"},
                                     HF_TOLERANCES),
    }, steps=4, tolerances=(RTOL, 5e-6))


_CP_LAYOUTS = {"cp1-dp4-zero3": dict(dp=4, zero_stage=3), "cp4-dp1": dict(dp=1, cp=4)}


def _checkpoints(ckpt: str) -> dict:
    from tests.strategy.test_checkpoint import fit_and_resume

    return fit_and_resume(ckpt, dict(dp=2, cp=2, zero_stage=1), _CP_LAYOUTS, gpt())


def test_checkpoints_resume_exactly_under_another_cp_on_4_ranks(tmp_path):
    from lightning_hybrid.checkpoint import read_meta
    from tests.strategy.test_checkpoint import assert_resumed_exactly

    ckpt = str(tmp_path / "step4.ckpt")
    by_rank = run_distributed(_checkpoints, 4, ckpt)
    assert read_meta(ckpt)["lightning_hybrid"]["layout"] == {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 1, "cp": 2}
    assert_resumed_exactly(by_rank, _CP_LAYOUTS)


# ---------------------------------------------------------------------------------------------- ring attention
# `ring_attention` against one device's masked SDPA, operator by operator (run in the refusals' 2-rank world below):
# outputs and the gradients of queries, keys and values of every rank's zigzag chunks, for plain causal rows,
# documents, a sliding window (both), and grouped-query heads, on the CPU's fused kernel and on the explicit scores.
RING_T = 48


def _ring_case(heads: int = 4, kv_heads: int = 2, labels=None, window=None) -> float:
    from lightning_hybrid.parallel.context_parallel import ring

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, RING_T, 8, generator=g, requires_grad=True)
    k = torch.randn(2, kv_heads, RING_T, 8, generator=g, requires_grad=True)
    v = torch.randn(2, kv_heads, RING_T, 8, generator=g, requires_grad=True)
    grad = torch.randn(2, heads, RING_T, 8, generator=g)
    places = torch.arange(RING_T)
    allowed = (places[:, None] >= places[None, :])[None, None]
    if window is not None:
        allowed = allowed & (places[:, None] - places[None, :] < window)
    if labels is not None:
        allowed = allowed & (labels[:, None, :, None] == labels[:, None, None, :])
    repeats = heads // kv_heads
    reference = F.scaled_dot_product_attention(q, k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1),
                                               attn_mask=allowed)
    reference.backward(grad)
    mine = zigzag_indices(RING_T, dist.get_world_size(), dist.get_rank())
    local = [t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    out = ring.ring_attention(*local, labels, dist.group.WORLD, None, window)
    out.backward(grad[:, :, mine])
    pairs = [(out, reference)] + [(t.grad, whole.grad) for t, whole in zip(local, (q, k, v))]
    return max((got - want[:, :, mine]).abs().max().item() for got, want in pairs)


def _ring_cases() -> dict[str, float]:
    docs = torch.tensor([[0] * 10 + [1] * 20 + [2] * 18, [0] * 30 + [1] * 18])
    return {"plain": _ring_case(), "documents": _ring_case(labels=docs), "window": _ring_case(window=7),
            "documents and window": _ring_case(labels=docs, window=5),
            "one key head per query head": _ring_case(kv_heads=4),
            "documents and window, explicit scores": _explicit(lambda: _ring_case(labels=docs, window=5))}


def _explicit(case):
    """``case`` with every chunk pair on the explicit fp32 scores (devices without a fused kernel that takes a mask
    and returns the log-sum-exp), several row blocks a chunk."""
    from lightning_hybrid.parallel.context_parallel import ring

    kernel, rows = ring._kernel, ring.ROWS
    ring._kernel, ring.ROWS = (lambda q: "explicit"), 5  # 12 tokens a chunk at cp2: three row blocks
    try:
        return case()
    finally:
        ring._kernel, ring.ROWS = kernel, rows


# ---------------------------------------------------------------------------------------------- refusals
def _refusals() -> dict:
    out = {}

    def fit(module, block_size: int = 16, predict: bool = False, precision: str = "32-true", **layout) -> None:
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(dp=1, cp=2, **layout), max_steps=1,
                            precision=precision, **{**QUIET_TRAINER, "limit_val_batches": 0})
        data = ByteCorpusDataModule(max_bytes=10_000, block_size=block_size, batch_size=2)
        if predict:
            data.setup("fit")
            trainer.predict(module, data.train_dataloader())
        else:
            trainer.fit(module, data)

    for name, call in {
        "eager": lambda: fit(CausalLM(tiny_config("llama"), attn_implementation="eager")),
        # 16 tokens past a window of 8: the CP attention keeps the window (its parity: the 4-rank layouts).
        "window": lambda: fit(_hf("mistral", sliding_window=8)),
        "length": lambda: fit(gpt()(), block_size=14),
        "predict": lambda: fit(gpt()(), predict=True),
        # Not a refusal: under autocast a Llama layer hands SDPA fp32 queries and keys (rotary's fp32 cos/sin) and a
        # bf16 value, which SDPA's autocast casts; the CP attention must do the same before its causal blocks.
        "bf16": lambda: fit(CausalLM(tiny_config("llama")), precision="bf16-mixed"),
        "ring-dropout": lambda: fit(_hf("llama", attention_dropout=0.1), cp_attention="ring"),
    }.items():
        try:
            call()
            out[name] = "ran"
        except (ValueError, BatchError) as e:
            out[name] = f"{type(e).__name__}: {e}"
        except SystemExit as e:  # a batch error: rank 0 says it, the others leave quietly
            out[name] = f"SystemExit: {e.code}"
    out["ring attention"] = _ring_cases()  # in the process group the fits made
    out["ring kernel"] = {kind: _with_a_wrong_kernel(kind) for kind in ("forward", "backward")}
    return out


def _with_a_wrong_kernel(kind: str) -> str:
    """The ring with its fused kernel's ``kind`` pass 1% off (a kernel called with arguments a torch version
    reads otherwise): the error at its first chunk pair, or "ran"."""
    from lightning_hybrid.parallel.context_parallel import ring

    name = f"_pair_{kind}"
    fused, checked = getattr(ring, name), set(ring._CHECKED)

    def off(*args, kernel=None):  # the fused kernel's results off; the explicit scores' as they are
        first, *rest = fused(*args, kernel=kernel)
        return (first, *rest) if kernel == "explicit" else (first * 1.01, *rest)

    ring._CHECKED.clear()
    setattr(ring, name, off)
    try:
        _ring_case()
        return "ran"
    except RuntimeError as e:
        return str(e)
    finally:
        setattr(ring, name, fused)
        ring._CHECKED.clear()
        ring._CHECKED.update(checked)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_distributed(_refusals, 2)


def test_ring_attention_is_one_devices_masked_attention(two_ranks):
    for out in two_ranks:
        assert max(out["ring attention"].values()) < 5e-6, out["ring attention"]
        # each fused kernel checked against the explicit scores on its first chunk pair in the process
        for kind, error in out["ring kernel"].items():
            assert error.startswith("cp_attention='ring': SDPA's fused cpu attention kernel (torch.float32) differs"
                                    " from the explicit attention of a chunk pair by"), (kind, error)
            assert f"in its {kind} pass" in error and "use cp_attention='all_gather'" in error, (kind, error)


def test_what_context_parallelism_cannot_split_is_refused_with_the_reason_on_2_ranks(two_ranks):
    first, other = two_ranks
    for out in (first, other):
        assert "scaled_dot_product_attention" in out["eager"] and "attn_implementation='sdpa'" in out["eager"], out
        assert out["window"] == "ran", out
    assert "BatchError" in first["length"] and "multiple of 4" in first["length"], first
    assert "BatchError" in first["predict"] and "predict under cp=2" in first["predict"], first
    assert other["length"] == other["predict"] == "SystemExit: 1", other
    assert first["bf16"] == other["bf16"] == "ran", (first, other)
    for out in (first, other):  # every rank says it: the attention is the same on each
        assert "cp_attention='ring' computes attention without dropout (dropout_p=0.1)" in out["ring-dropout"], out
    with pytest.raises(ValueError, match="compile=False with cp > 1"):
        HybridStrategy(cp=2, compile=True)
    with pytest.raises(ValueError, match="cp=0 is invalid"):
        HybridStrategy(cp=0)
