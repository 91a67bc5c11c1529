"""Every DP x TP x ZeRO layout reproduces the one-device run: losses, gradient norms, validation metrics
(a torchmetrics metric included) and final weights, over `tests.parity.STEPS` AdamW steps in fp32 with clipping
active.

The one-device reference runs in the test process; each world size is one group of spawned ranks that
runs several layouts one after another on the same process group.
"""

from __future__ import annotations

from functools import partial

import torch

from lightning_hybrid.data.corpus import ByteCorpusDataModule
from lightning_hybrid.models import GPTConfig, GPTLightningModule
from tests.parity import (
    BLOCK,
    FP8_BOUNDARY_TOLERANCES,
    PARAM_ATOL,
    RTOL,
    SGDGPT,
    DoubleOneGradient,
    check_world,
    float8_gpt,
    mismatches,
    run_world,
    tolerances_of,
)
from tests.user_modules import TiedUserLM, UserLM

# The user module trains at lr 3e-3, where Adam turns eps-scale gradient noise into parameter noise of 7.6e-6.
USER_TOLERANCES = (RTOL, 2.5e-5)
# bf16-mixed against fp32 at lr 5e-3: losses within 5e-3 relative (measured 1.9e-3); single parameters are as far
# apart as they moved (Adam's eps-scale elements), so the model's distance from fp32 is held against its movement
# (measured 0.03; a run that never updates: 1).
BF16_LR = 5e-3
BF16_TOLERANCES = (5e-3, float("inf"), 0.1, 0.1)  # a tensor's gradient norm: within 3.1e-2 measured
# Plain SGD at lr 0.1: parameters within 1.2e-7 of one device.
SGD_TOLERANCES = (RTOL, 1e-6)


def gpt(sgd: bool = False, lr: float = 5e-4, **overrides):
    """The reference GPT (AdamW, or with ``sgd`` plain SGD at lr 0.1: `SGDGPT`)."""
    base = dict(vocab_size=256, block_size=BLOCK, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp="swiglu",
                dropout=0.0)
    base.update(overrides)
    if sgd:
        return partial(SGDGPT, config=GPTConfig(**base), lr=0.1)
    return partial(GPTLightningModule, config=GPTConfig(**base), lr=lr, weight_decay=0.1)


class TinyLlama(GPTLightningModule):
    """A `transformers` Llama (GQA, RMSNorm, rotary, gated MLP), random init, trained like our GPT."""

    def configure_model(self) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        if self.model is not None:
            return
        config = LlamaConfig(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=BLOCK, tie_word_embeddings=False,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.model = LlamaForCausalLM(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx).logits


def test_world2_layouts_match_one_device():
    """dp2 with ZeRO 0-3 (also on many small gradient buckets, reduced while backward runs, and under
    accumulation), tp2, and a user-written module holding an nn.ModuleList itself under ZeRO-3."""
    model = gpt()
    runs = {name: (kwargs, model, {}) for name, kwargs in {
        "dp2": dict(dp=2),
        "tp2": dict(tp=2),
        "dp2-zero1": dict(dp=2, zero_stage=1),
        "dp2-zero2": dict(dp=2, zero_stage=2),
        "dp2-zero3": dict(dp=2, zero_stage=3),
        "dp2-zero0-small-buckets": dict(dp=2, bucket_cap_mb=0.01),
        "dp2-zero1-small-buckets": dict(dp=2, zero_stage=1, bucket_cap_mb=0.01),
    }.items()}
    runs["dp2-zero2-small-buckets-accumulate2"] = (dict(dp=2, zero_stage=2, bucket_cap_mb=0.01), model,
                                                   {"accumulate_grad_batches": 2})
    runs["user-dp2-zero3"] = (dict(dp=2, zero_stage=3), UserLM, {}, USER_TOLERANCES)
    # Sequence parallelism (logits split over the vocabulary, by default), also with full recompute; and the
    # gathered logits of loss_parallel=False.
    runs["tp2-sp"] = (dict(tp=2, sequence_parallel=True), model, {})
    runs["tp2-sp-recompute-full"] = (dict(tp=2, sequence_parallel=True, activation_checkpointing=True), model, {})
    # Selective recompute with TP and SP collectives inside the recomputed layers (kept, never run again).
    runs["tp2-sp-recompute-attention"] = (dict(tp=2, sequence_parallel=True, recompute="attention"), model, {})
    runs["tp2-gathered-logits"] = (dict(tp=2, loss_parallel=False), model, {})
    # torch.compile per block (inductor, whole graphs: the harness checks there is no graph break) against the
    # eager one-device run: with TP+SP collectives and selective recompute inside, and under FSDP2.
    runs["tp2-sp-recompute-attention-compile"] = (
        dict(tp=2, sequence_parallel=True, recompute="attention", compile=True), model, {})
    runs["dp2-zero3-compile"] = (dict(dp=2, zero_stage=3, compile=True), model, {})
    # Plain SGD: a gradient error in any element moves the parameters (AdamW would cancel a scale per tensor).
    runs.update({f"{name}-sgd": (kwargs, gpt(sgd=True), {}, SGD_TOLERANCES)
                 for name, kwargs in LAYOUT_FAMILIES.items()})
    check_world(2, runs)


#: One layout of each kind on two ranks: DP, ZeRO 1-3, TP, PP.
LAYOUT_FAMILIES = {
    "dp2": dict(dp=2), "dp2-zero1": dict(dp=2, zero_stage=1), "dp2-zero2": dict(dp=2, zero_stage=2),
    "dp2-zero3": dict(dp=2, zero_stage=3), "tp2": dict(tp=2), "pp2": dict(pp=2),
}


def test_the_harness_sees_a_doubled_gradient_of_one_small_tensor_on_one_rank():
    """The check that the checks can fail: on rank 1 only, the gradient of one norm's bias (32 numbers, in the
    pipeline's second stage) is doubled, under each kind of layout, with AdamW (which cancels a constant scale per
    tensor: the per-tensor gradient norms must see it) and with SGD (the parameters must see it too)."""
    inject = DoubleOneGradient("model.blocks.1.ln_2", rank=1)
    runs = {}
    for name, kwargs in LAYOUT_FAMILIES.items():
        runs[name] = (kwargs, gpt(), {"callbacks": [inject]})
        runs[f"{name}-sgd"] = (kwargs, gpt(sgd=True), {"callbacks": [inject]}, SGD_TOLERANCES)
    results, references = run_world(2, runs, steps=3)
    for name, run in runs.items():
        seen = [mismatches(per_run[name], references[name], *tolerances_of(run, (RTOL, PARAM_ATOL)))
                for per_run in results]
        assert any("tensor_grad_norm" in bad for bad in seen), (name, seen)
        if name.endswith("-sgd"):
            assert any("param" in bad for bad in seen), (name, seen)


def test_the_data_modules_loader_reads_its_data_without_drawing_from_the_global_random_state():
    """The runs' loader (`resumable_loader`, one device's and the ranks') draws its iterator's base seed from a
    generator of its own: a module's dropout then draws one device's masks from the same global state as the ranks'
    (the strategy rebuilds the ranks' loaders with its sampler, and a loader that drew from the global state would
    shift every mask by a draw on one side: a user module's tp2 dropout run looked 2e-3 off one device)."""
    data = ByteCorpusDataModule(max_bytes=20_000, block_size=BLOCK, batch_size=2)
    data.setup("fit")
    torch.manual_seed(0)
    before = torch.get_rng_state()
    next(iter(data.train_dataloader()))
    assert torch.equal(torch.get_rng_state(), before)


def test_world4_layouts_match_one_device():
    model = gpt(n_kv_head=4, mlp="gelu")  # plain MHA + fc1/fc2 MLP; tp4 splits 4 heads
    check_world(4, {name: (kwargs, model, {}) for name, kwargs in {
        "tp4": dict(tp=4),
        "dp2xtp2": dict(dp=2, tp=2),
        "dp2xtp2-zero1": dict(dp=2, tp=2, zero_stage=1),
        "dp2xtp2-zero2": dict(dp=2, tp=2, zero_stage=2),
        "dp2xtp2-zero3": dict(dp=2, tp=2, zero_stage=3),
        # Hybrid sharding: ZeRO-3 within pairs of ranks, replicated across the two pairs (FSDP2's 2-D mesh).
        "dp4-zero3-hsdp2": dict(dp=4, zero_stage=3, dp_shard=2),
        "dp2xtp2-zero2-sp": dict(dp=2, tp=2, zero_stage=2, sequence_parallel=True),
        "dp2xtp2-zero1-sp-recompute-attention": dict(dp=2, tp=2, zero_stage=1, sequence_parallel=True,
                                                     recompute="attention"),
    }.items()})


def test_accumulation_foreign_model_and_bf16_match_one_device():
    """Gradient accumulation (reduced once per optimizer step), a transformers Llama split by the auto plan,
    and bf16-mixed (against the one-device bf16-mixed run, at bf16 tolerance: TP sums partial products in bf16)."""
    check_world(4, {
        "dp2xtp2-zero2-accumulate2": (dict(dp=2, tp=2, zero_stage=2), gpt(), {"accumulate_grad_batches": 2}),
        "dp2xtp2-zero0-accumulate2": (dict(dp=2, tp=2), gpt(), {"accumulate_grad_batches": 2}),
        # ZeRO-3 reduce-scattering every batch of the window into the sharded gradients (the reductions counted).
        "dp2xtp2-zero3-accumulate2-micro_batch": (dict(dp=2, tp=2, zero_stage=3, grad_reduce="micro_batch"), gpt(),
                                                  {"accumulate_grad_batches": 2}),
        "llama-dp2xtp2-zero1": (dict(dp=2, tp=2, zero_stage=1), partial(TinyLlama, lr=5e-4), {}),
        "llama-dp2xtp2-zero3-sp": (dict(dp=2, tp=2, zero_stage=3, sequence_parallel=True), partial(TinyLlama, lr=5e-4),
                                   {}),
        # Against the fp32 one-device run, at a learning rate where the parameters move 20x the tolerance.
        "bf16-dp2xtp2-zero3": (dict(dp=2, tp=2, zero_stage=3), gpt(lr=BF16_LR), {"precision": "bf16-mixed"},
                               BF16_TOLERANCES),
        "bf16-pp2xtp2": (dict(pp=2, tp=2), gpt(lr=BF16_LR), {"precision": "bf16-mixed"}, BF16_TOLERANCES),
        # Selective recompute runs a row layer as one custom op, which autocast does not cast: bf16 activations
        # against fp32 weights, an fp32 output gradient (the bias) against a bf16 product, unless the layer casts.
        "bf16-dp2xtp2-sp-recompute-attention": (dict(dp=2, tp=2, sequence_parallel=True, recompute="attention"),
                                                gpt(lr=BF16_LR), {"precision": "bf16-mixed"}, BF16_TOLERANCES),
    })


def test_pipeline_schedules_match_one_device():
    """pp2 under every schedule; 1F1B also with activation checkpointing and gradient accumulation."""
    model = gpt(n_layer=2)  # 4 pipeline layers: embed, 2 blocks, head -> 2 or 4 stages
    check_world(2, {
        "pp2-gpipe": (dict(pp=2, schedule="gpipe"), model, {}),
        "pp2-1f1b": (dict(pp=2, schedule="1f1b"), model, {}),
        "pp2-interleaved": (dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2), model, {}),
        "pp2-zero-bubble": (dict(pp=2, schedule="zero_bubble"), model, {}),
        "pp2-1f1b-ac-accumulate2": (
            dict(pp=2, activation_checkpointing=True, micro_batches=2), model, {"accumulate_grad_batches": 2}
        ),
        "pp2-recompute-attention": (dict(pp=2, recompute="attention"), model, {}),
        "pp2-compile": (dict(pp=2, compile=True), model, {}),
    })


def test_pipeline_with_dp_and_tp_match_one_device():
    model = gpt(n_layer=2, n_kv_head=4, mlp="gelu")
    check_world(4, {
        "pp4-1f1b": (dict(pp=4, schedule="1f1b"), model, {}),
        "pp2xdp2": (dict(pp=2, dp=2), model, {}),
        "pp2xtp2": (dict(pp=2, tp=2, split_points=[2]), model, {}),
        "pp2xtp2-sp-interleaved": (
            dict(pp=2, tp=2, sequence_parallel=True, schedule="interleaved_1f1b", virtual_stages=2), model, {}),
        # Selective recompute of pipeline layers (the embedding's and the head's collectives inside) under TP.
        "pp2xtp2-recompute-pointwise": (dict(pp=2, tp=2, recompute="pointwise"), model, {}),
        # Compiled pipeline layers: the embedding's and the split head's collectives inside the graphs.
        "pp2xtp2-sp-compile": (dict(pp=2, tp=2, sequence_parallel=True, compile=True), model, {}),
        # Accumulation under a pipeline: ZeRO-1 buckets and ZeRO-3 (FSDP2) reduce once, after the last batch.
        "pp2xdp2-zero1-accumulate2": (dict(pp=2, dp=2, zero_stage=1, micro_batches=2), model,
                                      {"accumulate_grad_batches": 2}),
        "pp2xdp2-zero3-accumulate2": (dict(pp=2, dp=2, zero_stage=3, micro_batches=2), model,
                                      {"accumulate_grad_batches": 2}),
        # Each stage's buckets reduce during its last backward: with two stages per rank (a bucket filled by one
        # stage's last backward is reduced, and under ZeRO-2 freed, while the other stage still runs) ...
        "pp2xdp2-zero2-interleaved": (dict(pp=2, dp=2, zero_stage=2, schedule="interleaved_1f1b", virtual_stages=2),
                                      model, {}),
        # ... and under zero-bubble, whose weight pass sets .grad itself (no hook): taken into the buckets after
        # each schedule, not dropped by the zero_grad that follows it.
        "pp2xdp2-zero2-zero-bubble-accumulate2": (dict(pp=2, dp=2, zero_stage=2, schedule="zero_bubble"), model,
                                                  {"accumulate_grad_batches": 2}),
        # An LM head tied to the embedding, on the first and the last stage: each copy steps with the sum of both
        # gradients (in ZeRO-1's buckets, before the DP reduction), counted once in the clipping norm.
        "pp2xdp2-zero1-tied-user": (dict(pp=2, dp=2, zero_stage=1, micro_batches=2), TiedUserLM, {},
                                    USER_TOLERANCES),
    })


def test_3d_with_every_zero_stage_matches_one_device():
    """pp2 x dp2 x tp2 on 8 ranks with ZeRO 0-3, for the reference GPT and for a user-written module that holds
    its layers directly (a bare nn.Embedding first pipeline layer, an nn.ModuleList on the LightningModule);
    each rank holds about 1/(pp*tp) of the GPT (1/dp more under ZeRO-3)."""
    config = gpt(n_layer=2, n_embd=64)
    runs = {f"3d-zero{stage}": (dict(pp=2, dp=2, tp=2, zero_stage=stage), config, {}) for stage in range(4)}
    # (the user module at the ends of the range; ZeRO-1 in the 4-rank world (tied head), ZeRO-2 under manual
    # optimization in tests/strategy/test_user_code.py)
    runs.update({f"user-3d-zero{stage}": (dict(pp=2, dp=2, tp=2, zero_stage=stage), UserLM, {}, USER_TOLERANCES)
                 for stage in (0, 3)})
    runs["3d-zero1-sp"] = (dict(pp=2, dp=2, tp=2, zero_stage=1, sequence_parallel=True), config, {})
    # FP8 (torchao's tensorwise recipe, emulated): each micro-batch's amaxes over the stage's four ranks, under
    # ZeRO-3 with the weights gathered in float8 -- each shard cast with the scale of the whole weight, its amax over
    # the dp shards and the TP pieces. One step, at the tolerance of a value that fp32 noise put across a float8
    # rounding boundary (tests/parity.py's FP8_BOUNDARY_TOLERANCES; in the second step, weights an ulp from one
    # device's put more there: FP8_STEPS). Two steps of FP8 under ZeRO and TP: tests/strategy/test_float8.py.
    runs["fp8-3d-zero3-sp-float8-all-gather"] = (
        dict(pp=2, dp=2, tp=2, zero_stage=3, sequence_parallel=True, micro_batches=2, fp8="tensorwise",
             fp8_all_gather=True), float8_gpt(64, dp=2, micro_batches=2), {"max_steps": 1}, FP8_BOUNDARY_TOLERANCES)
    results = check_world(8, runs)
    one_device = config()
    one_device.configure_model()
    total = sum(p.numel() * p.element_size() for p in one_device.parameters())
    for rank, per_run in enumerate(results):
        for stage in range(4):
            share = per_run[f"3d-zero{stage}"]["param_bytes"] / (total / (2 * 2))
            # Norms, position embeddings and row-parallel biases are replicated over TP: a few percent more.
            expected = 0.5 if stage == 3 else 1.0
            assert expected * 0.9 <= share <= expected * 1.15, (rank, stage, share)
