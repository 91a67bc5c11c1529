"""Exact or refused for what users write (docs/correctness.md, "What the strategy verifies"): their own loaders,
losses, random ops, gradient hooks and tied parameters, each under the layouts that would otherwise train another
model without a word. Every refusal here is a test that fails when its mechanism is switched off (the run would
train); every "matches" compares against Lightning's one-device run."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_hybrid import HybridStrategy
from lightning_hybrid.checks.batch_check import fingerprint
from lightning_hybrid.hf import CausalLM
from lightning_hybrid.models import GPTLightningModule
from lightning_hybrid.runtime.rank_zero import BatchError
from tests.families import tiny_config
from tests.helpers import QUIET_TRAINER, run_distributed
from tests.user_code import (
    BLOCK,
    VOCAB,
    AssignedGradLM,
    BatchNormBlock,
    ClipAfterBackwardLM,
    ConvBlock,
    DeclaredMeanDictLM,
    DictLM,
    DropoutLM,
    DropoutMasks,
    GainLM,
    HandClippingLM,
    HandNormLM,
    HookCallsLM,
    LoraUserLM,
    ManualLM,
    MiscountedLM,
    ScaledGradsLM,
    SequenceLM,
    SumLM,
    SumWeights,
    TiedLM,
    TiedTrunkLM,
    UndeclaredSumLM,
    UnfrozenLaterLM,
    UserLM,
    WindowBlock,
    ordered_loader,
    padded_loader,
    pairs_loader,
    stream_loader,
    token_rows,
)

GLOBAL_BATCH = 8
PARAM_ATOL = 1e-5


def _outcome(call) -> str:
    try:
        call()
        return "ran"
    except (ValueError, TypeError, RuntimeError, BatchError) as e:
        return f"{type(e).__name__}: {e}"
    except SystemExit as e:  # rank 0 says it, the others leave quietly
        return f"SystemExit: {e.code}"


def _fit(strategy, module, loader_of, steps: int = 2, devices: int = 2, **trainer_kwargs) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps,
                        **{**QUIET_TRAINER, "limit_val_batches": 0, **trainer_kwargs})
    trainer.fit(module, train_dataloaders=loader_of(trainer))
    return trainer


def _state(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The whole model's final parameters (gathered from every rank's pieces)."""
    strategy, module = trainer.strategy, trainer.lightning_module
    state = strategy.full_state_dict() if isinstance(strategy, HybridStrategy) else module.state_dict()
    return {k: v.detach().cpu().clone() for k, v in state.items()}


class SGDCausalLM(CausalLM):
    """Trained with plain SGD: an update is the learning rate times the gradient (Adam turns fp32 noise in gradients
    of nearly zero into updates of order its learning rate)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _llama4(temperature_tuning: bool = False) -> CausalLM:
    """A transformers Llama 4 text model whose first layer attends within chunks of 4 tokens (its
    ``attention_chunk_size``), dense; with ``temperature_tuning`` its second layer has no rotary embedding and scales
    its queries by each token's position (its attention temperature, from positions 0..T-1 of the tokens it is
    given); SGD."""
    import transformers as T

    config = T.Llama4TextConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        intermediate_size_mlp=64, vocab_size=VOCAB, max_position_embeddings=64, num_local_experts=2,
        num_experts_per_tok=1, moe_layers=[], attention_chunk_size=4, no_rope_layers=[1, int(not temperature_tuning)],
        layer_types=["chunked_attention", "full_attention"], attn_temperature_tuning=temperature_tuning,
        floor_scale=4, attn_scale=0.5, tie_word_embeddings=False)
    return SGDCausalLM(config)


def _dynamic_rope_llama() -> CausalLM:
    """A transformers Llama whose rotary embedding is scaled by the longest position it sees (beyond 8)."""
    config = tiny_config("llama")
    config.max_position_embeddings = 8
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    return CausalLM(config)


#: Runs compared against one device: name -> (strategy arguments, module factory, loader factory (per-rank batch
#: size -> loader), trainer arguments).
PARITY = {
    "declared sum, dp2": (dict(dp=2), SumLM, pairs_loader, {}),
    "declared sum, dp2, accumulation": (dict(dp=2), SumLM, pairs_loader, {"accumulate_grad_batches": 2}),
    "declared sum, pp2, accumulation": (dict(pp=2, micro_batches=2), SumLM, pairs_loader,
                                        {"accumulate_grad_batches": 2}),
    # Two manual_backward calls before one (clipped) step: the first gradient must not be lost to the second.
    "manual optimization, dp2 ZeRO-1": (dict(dp=2, zero_stage=1), ManualLM, pairs_loader, {}),
    "manual optimization, dp2 ZeRO-2": (dict(dp=2, zero_stage=2), ManualLM, pairs_loader, {}),
    # An LM head tied to the embedding: one parameter on one device, a copy per stage under pp2 (clipped by the
    # global norm, which must count it once), one FSDP unit under ZeRO-3.
    "tied head, pp2": (dict(pp=2, micro_batches=2), TiedLM, pairs_loader, {"gradient_clip_val": 0.5}),
    "tied head in a submodule, pp2 ZeRO-1": (dict(pp=2, micro_batches=2, zero_stage=1), TiedTrunkLM, pairs_loader,
                                             {"gradient_clip_val": 0.5}),
    "tied head in a submodule, dp2 ZeRO-3": (dict(dp=2, zero_stage=3), TiedTrunkLM, pairs_loader,
                                             {"gradient_clip_val": 0.5}),
    # Parameters read outside their layers' forwards while ZeRO 1-2's gathers of the step may be in flight: a gain in
    # training_step, a callback that adds them up after the step (tests/zero has the reads before the data arrives).
    **{f"parameters read outside the layers, dp2 ZeRO-{stage}": (dict(dp=2, zero_stage=stage), GainLM, pairs_loader,
                                                                 {"callbacks": [SumWeights()]})
       for stage in (1, 2)},
    # Chunked attention (Llama 4's first layer): the CP attention keeps the chunks.
    "chunked attention, cp2": (dict(dp=1, cp=2), _llama4, pairs_loader, {}),
    # Dropout where a TP rank holds what one device holds (after the row-split projection): one device's masks.
    "dropout on replicated activations, tp2": (dict(tp=2), lambda: DropoutLM(whole_p=0.3), pairs_loader, {}),
    # peft's LoRA on the module's own linears: TP splits each adapter with its layer.
    "LoRA on the module's linears, tp2": (dict(tp=2), LoraUserLM, pairs_loader, {}),
    # A sampler of the user's own: one device's batches of 8 in its order, 4 of them on each rank.
    "a sampler of its own, dp2": (dict(dp=2), UserLM, ordered_loader, {}),
}


#: Gradients changed in Lightning's hooks, compared against one device at the same accumulation (the hook runs after
#: each backward): name -> (strategy arguments, module factory, trainer arguments). The hook sees the reduced
#: gradients (not a reduction in flight), each rank's own part inside a window, and under PP it runs at all.
HOOKS = {
    "scaled after backward, dp2": (dict(dp=2), ScaledGradsLM, {}),
    "scaled after backward, dp2, accumulation": (dict(dp=2), ScaledGradsLM, {"accumulate_grad_batches": 2}),
    "scaled after backward, pp2": (dict(pp=2, micro_batches=2), ScaledGradsLM, {}),
    "scaled after backward, dp2 ZeRO-3 reduced every batch, accumulation": (
        dict(dp=2, zero_stage=3, grad_reduce="micro_batch"), ScaledGradsLM, {"accumulate_grad_batches": 2}),
    # A parameter trainable from the second step on (in no gradient bucket): reduced all the same, and cleared by
    # zero_grad as the optimizer's own would.
    "unfrozen at the second step, dp2, accumulation": (dict(dp=2), UnfrozenLaterLM, {"accumulate_grad_batches": 2}),
    "added to the optimizer at the second step, dp2": (dict(dp=2), lambda: UnfrozenLaterLM(join=True), {}),
    "gradient assigned before the step, dp2": (dict(dp=2), AssignedGradLM, {}),
}


def _hooked(name: str) -> dict[str, torch.Tensor]:
    kwargs, make, trainer_kwargs = HOOKS[name]
    batch = GLOBAL_BATCH // kwargs.get("dp", 1)
    return _state(_fit(HybridStrategy(**kwargs), make(), lambda t: pairs_loader(batch), steps=3, **trainer_kwargs))


def _parity_on_2_ranks() -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name, (kwargs, make, loader, trainer_kwargs) in PARITY.items():
        dp = kwargs.get("dp", 1)
        batches = GLOBAL_BATCH // dp
        out[name] = _state(_fit(HybridStrategy(**kwargs), make(), lambda t, n=batches, loader=loader: loader(n),
                                **trainer_kwargs))
    return out


def _masks(kwargs: dict, module) -> dict[str, torch.Tensor]:
    """The first training step's dropout masks under ``randomness="independent"``."""
    masks = DropoutMasks()
    _fit(HybridStrategy(randomness="independent", **kwargs), module, lambda t: pairs_loader(), steps=1,
         callbacks=[masks])
    return masks.masks


def _gathers(overlap: "bool | None") -> dict:
    """ZeRO-1's parameter gathers under the next forward (``None``: the default) or in the step: the final state,
    how many buckets were waited for by a read and at the end of a forward, the torch function modes left on."""
    trainer = _fit(HybridStrategy(dp=2, zero_stage=1, bucket_cap_mb=0.01, overlap_param_gather=overlap), UserLM(),
                   lambda t: pairs_loader(), steps=3)
    gathers = trainer.strategy._sync.gathers
    return {"state": _state(trainer), "on_use": gathers.waited_on_use, "at_release": gathers.waited_at_release,
            "modes": torch._C._len_torch_function_stack(),
            "lightning injects samplers": trainer._accelerator_connector.use_distributed_sampler}


def _on_2_ranks() -> dict[str, str]:
    return {
        "gathers overlapped": _gathers(None),
        "gathers in the step": _gathers(False),
        "gathers required under manual optimization": _outcome(lambda: _fit(
            HybridStrategy(dp=2, zero_stage=1, overlap_param_gather=True), ManualLM(), lambda t: pairs_loader())),
        # 63 rows in order and no drop_last: one device's last batch of 7 rows cannot be shared by 2 ranks alike.
        "a last batch dp2 cannot share": _outcome(lambda: _fit(HybridStrategy(dp=2), UserLM(), lambda t: ordered_loader(
            rows=63, drop_last=False))),
        # A stream split by torch.distributed's rank under tp2: the two TP ranks would train on other rows.
        "rank-split stream, tp2": _outcome(lambda: _fit(HybridStrategy(tp=2), UserLM(), lambda t: stream_loader(None))),
        "rank-split stream, pp2": _outcome(lambda: _fit(HybridStrategy(pp=2, micro_batches=2), UserLM(),
                                                        lambda t: stream_loader(None))),
        # The same stream split by the strategy's data-parallel rank and size: every TP rank reads it whole.
        "dp-split stream, tp2": _outcome(lambda: _fit(HybridStrategy(tp=2), UserLM(), stream_loader)),
        # A stream not split at all under dp2: both data-parallel ranks would train on the same rows.
        "unsplit stream, dp2": _outcome(lambda: _fit(HybridStrategy(dp=2), UserLM(),
                                                     lambda t: stream_loader(t, whole=True))),
        "dp-split stream, dp2": _outcome(lambda: _fit(HybridStrategy(dp=2), UserLM(), stream_loader)),
        # A mean over padded rows, not declared: under a split it would be a mean of the parts' means.
        **{f"undeclared mean on padding, {name}": _outcome(lambda k=kwargs: _fit(HybridStrategy(**k), DictLM(),
                                                                                 lambda t: padded_loader()))
           for name, kwargs in (("dp2", dict(dp=2)), ("cp2", dict(dp=1, cp=2)), ("pp2", dict(pp=2, micro_batches=2)))},
        "declared mean on padding, dp2": _outcome(lambda: _fit(HybridStrategy(dp=2), DeclaredMeanDictLM(),
                                                               lambda t: padded_loader())),
        "undeclared sum, dp2": _outcome(lambda: _fit(HybridStrategy(dp=2), UndeclaredSumLM(),
                                                     lambda t: pairs_loader())),
        "miscounted loss items, dp2": _outcome(lambda: _fit(HybridStrategy(dp=2), MiscountedLM(),
                                                            lambda t: pairs_loader())),
        "miscounted loss items, pp2": _outcome(lambda: _fit(HybridStrategy(pp=2, micro_batches=2), MiscountedLM(),
                                                            lambda t: pairs_loader())),
        # torch.nn.utils.clip_grad_norm_ by hand: a shard's, a stage's norm; under ZeRO-1 no rank holds p.grad.
        **{f"hand clipping, {name}": _outcome(lambda k=kwargs: _fit(HybridStrategy(**k), HandClippingLM(),
                                                                    lambda t: pairs_loader()))
           for name, kwargs in (("tp2", dict(tp=2)), ("pp2", dict(pp=2, micro_batches=2)),
                                ("dp2 ZeRO-1", dict(dp=2, zero_stage=1)), ("dp2", dict(dp=2)))},
        # Random ops where ranks hold other data: refused by default ...
        **{f"dropout, {name}": _outcome(lambda k=kwargs, m=make: _fit(HybridStrategy(**k), m(),
                                                                      lambda t: pairs_loader()))
           for name, kwargs, make in (("dp2", dict(dp=2), lambda: DropoutLM(whole_p=0.3)),
                                      ("split by tp2", dict(tp=2), lambda: DropoutLM(split_p=0.3)),
                                      ("pp2", dict(pp=2, micro_batches=2), lambda: DropoutLM(whole_p=0.3)))},
        # ... and with independent streams, whose masks are kept for the test to compare between the ranks.
        "masks, dp2": _masks(dict(dp=2), DropoutLM(split_p=0.5, whole_p=0.5)),
        "masks, tp2": _masks(dict(tp=2), DropoutLM(split_p=0.5, whole_p=0.5)),
        "masks, tp2 SP": _masks(dict(tp=2, sequence_parallel=True), GPTLightningModule(
            n_layer=1, n_embd=16, n_head=2, block_size=BLOCK, vocab_size=VOCAB, dropout=0.5)),
        # A router's load-balancing loss, per batch, under accumulation over batches of other token counts.
        "moe aux loss, padding, accumulation, dp2": _outcome(lambda: _fit(
            HybridStrategy(dp=2), CausalLM(tiny_config("mixtral")), lambda t: padded_loader(),
            accumulate_grad_batches=2)),
        # What context parallelism cannot split, found by running the model on the whole sequence and on the shares:
        **{f"cp2: {name}": _outcome(lambda m=make: _fit(HybridStrategy(dp=1, cp=2), m(), lambda t: pairs_loader()))
           for name, make in (("a window mask of its own", lambda: SequenceLM(block=WindowBlock)),
                              ("a convolution along the sequence", lambda: SequenceLM(block=ConvBlock)),
                              ("positions from torch.arange", lambda: SequenceLM(own_positions=True)),
                              ("positions from the batch", lambda: SequenceLM()),
                              ("dynamic RoPE", _dynamic_rope_llama),
                              ("attention temperature", lambda: _llama4(temperature_tuning=True)))},
        # ... and what splitting the rows cannot (dynamic RoPE over left-padded rows of other lengths: the positions
        # of each row count from its first real token).
        "dp2: dynamic RoPE on padded rows": _outcome(lambda: _fit(HybridStrategy(dp=2), _dynamic_rope_llama(),
                                                                  lambda t: padded_loader(left=True))),
        "dp2: BatchNorm": _outcome(lambda: _fit(HybridStrategy(dp=2), SequenceLM(block=BatchNormBlock),
                                                lambda t: pairs_loader())),
        "tied head held directly, dp2 ZeRO-3": _outcome(lambda: _fit(HybridStrategy(dp=2, zero_stage=3), TiedLM(),
                                                                     lambda t: pairs_loader())),
        "user LoRA dropout, tp2": _outcome(lambda: _fit(HybridStrategy(tp=2), LoraUserLM(dropout=0.1),
                                                        lambda t: pairs_loader())),
        # LoRA with FP8 under SP: a column layer's A adapters would cast each rank's part of their output gradient.
        "lora fp8 sp, tp2": _outcome(lambda: _fit(HybridStrategy(tp=2, sequence_parallel=True, fp8="tensorwise"),
                                                  CausalLM(tiny_config("llama"), lora={"r": 16, "target_modules": [
                                                      "q_proj", "o_proj"]}), lambda t: pairs_loader())),
        # LoRA's adapter dropout where TP splits the adapted layers (tests/hf/test_lora.py has the rest of it).
        "lora dropout, tp2": _outcome(lambda: _fit(HybridStrategy(tp=2), CausalLM(tiny_config("llama"), lora={
            "r": 4, "target_modules": ["q_proj"], "lora_dropout": 0.1}), lambda t: pairs_loader())),
        **{f"parity: {name}": state for name, state in _parity_on_2_ranks().items()},
        **{f"hooks: {name}": _hooked(name) for name in HOOKS},
        # ... and where no rank holds what one device's hook would see: ZeRO-3 reducing once per window, a norm
        # by hand of TP shards or of a stage's gradients, a clipping of each rank's part inside a window.
        "scaled after backward, dp2 ZeRO-3, accumulation": _outcome(lambda: _fit(
            HybridStrategy(dp=2, zero_stage=3, grad_reduce="window"), ScaledGradsLM(), lambda t: pairs_loader(),
            accumulate_grad_batches=2)),
        **{f"norm by hand, {name}": _outcome(lambda k=kwargs: _fit(HybridStrategy(**k), HandNormLM(),
                                                                   lambda t: pairs_loader()))
           for name, kwargs in (("tp2", dict(tp=2)), ("pp2", dict(pp=2, micro_batches=2)))},
        "backward hooks called, pp2, accumulation": _fit(HybridStrategy(pp=2, micro_batches=2), HookCallsLM(),
                                                         lambda t: pairs_loader(), accumulate_grad_batches=2
                                                         ).lightning_module.calls,
        "gradient assigned before the step, dp2 ZeRO-2": _outcome(lambda: _fit(
            HybridStrategy(dp=2, zero_stage=2), AssignedGradLM(), lambda t: pairs_loader())),
        "unfrozen at the second step, dp2 ZeRO-1": _outcome(lambda: _fit(
            HybridStrategy(dp=2, zero_stage=1), UnfrozenLaterLM(), lambda t: pairs_loader(), steps=3)),
        "clipping after backward, dp2, accumulation": _outcome(lambda: _fit(
            HybridStrategy(dp=2), ClipAfterBackwardLM(), lambda t: pairs_loader(), accumulate_grad_batches=2)),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, str]]:
    return run_distributed(_on_2_ranks, 2)


@pytest.mark.parametrize("name", sorted(PARITY))
def test_declared_losses_match_one_device(two_ranks, name):
    kwargs, make, loader, trainer_kwargs = PARITY[name]
    # One device reads an accumulation window as one batch (the global batch of the optimizer step).
    window = trainer_kwargs.get("accumulate_grad_batches", 1)
    reference = _state(_fit("auto", make(), lambda t: loader(GLOBAL_BATCH * window), devices=1,
                            **{**trainer_kwargs, "accumulate_grad_batches": 1}))
    fresh = make()
    fresh.configure_model()  # a module that builds its model there (CausalLM)
    initial = fresh.state_dict()
    moved = max((reference[k] - v).abs().max().item() for k, v in initial.items())
    assert moved > 20 * PARAM_ATOL, moved
    for rank_states in two_ranks:
        got = rank_states[f"parity: {name}"]
        # Beyond 1e-5 + 1e-5 x |value| (`SumWeights`' buffer, the sum of every parameter, is ~200).
        apart = max(((got[k] - v).abs() - PARAM_ATOL * v.abs()).max().item() for k, v in reference.items())
        assert apart < PARAM_ATOL, (name, apart, moved)


def test_zero_parameter_gathers_under_the_next_forward_are_bit_for_bit_those_of_the_step(two_ranks):
    for out in two_ranks:
        overlapped, in_step = out["gathers overlapped"], out["gathers in the step"]
        assert overlapped["on_use"] > 0, overlapped  # the forward found buckets in flight and waited for them
        assert in_step["on_use"] == in_step["at_release"] == 0, in_step
        assert overlapped["modes"] == in_step["modes"] == 0  # the guard is off after the run
        assert overlapped["lightning injects samplers"] is True  # Lightning's flag back after the fit
        for name, value in in_step["state"].items():
            assert torch.equal(overlapped["state"][name], value), name
        message = out["gathers required under manual optimization"]
        assert message.startswith("ValueError: overlap_param_gather=True: the module uses manual optimization"), message


def test_lora_dropout_under_tp_is_refused_on_every_rank(two_ranks):
    """CausalLM's lora refuses it at construction; peft's adapters on a user's module, where TP's plan finds them."""
    pytest.importorskip("peft")
    for out in two_ranks:
        assert "lora_dropout=0.1 with tp=2: a TP-split layer's adapter" in out["lora dropout, tp2"], out
        assert "has LoRA dropout and tp=2 would split it: a split adapter" in out["user LoRA dropout, tp2"], out


def test_lora_under_fp8_and_sp_is_refused_where_a_cast_would_take_a_part_of_a_gradient(two_ranks):
    for out in two_ranks:
        message = out["lora fp8 sp, tp2"]
        assert "fp8 with sequence parallelism: the LoRA A adapters of column-split layers" in message, message
        assert "q_proj.lora_A.default" in message and "o_proj" not in message, message  # o_proj is row-split
        assert "fp8_exclude=['*.lora_A.*']" in message, message


def test_an_undeclared_loss_is_refused_where_a_split_would_change_it(two_ranks):
    first, other = two_ranks
    for layout in ("dp2", "cp2", "pp2"):
        message = first[f"undeclared mean on padding, {layout}"]
        assert message.startswith("BatchError: DictLM does not say how its loss reduces over tokens"), message
        assert "loss_reduction = 'mean'" in message and "loss_items(target)" in message, message
        assert other[f"undeclared mean on padding, {layout}"] == "SystemExit: 1"
    assert first["declared mean on padding, dp2"] == "ran"
    for out in (first, other):
        assert "adds up over the batch like a sum" in out["undeclared sum, dp2"], out["undeclared sum, dp2"]
        assert "loss_items does not count the items its loss_fn averages over" in out["miscounted loss items, dp2"]
    # Under pp the last stage finds it and every pipeline rank raises it after the schedule.
    assert first["miscounted loss items, pp2"] == other["miscounted loss items, pp2"]
    assert "loss_items does not count the items" in first["miscounted loss items, pp2"]


def test_a_last_batch_the_ranks_cannot_share_as_one_device_reads_it_is_refused(two_ranks):
    first, other = two_ranks
    message = first["a last batch dp2 cannot share"]
    assert message.startswith("ValueError: The training loader's 63 samples (in their order: ByLastToken) do not "
                              "split over the 2 data-parallel ranks: one device reads the last 7"), message
    assert "drop_last=True" in message and "use_distributed_sampler=False" in message, message
    assert other["a last batch dp2 cannot share"] == "SystemExit: 1"


def test_peers_that_get_different_batches_are_an_error_naming_them(two_ranks):
    first, other = two_ranks
    for layout, how in (("tp2", "tensor-parallel"), ("pp2", "pipeline stage")):
        message = first[f"rank-split stream, {layout}"]
        assert message.startswith("BatchError: The ranks that must train on the same batch got different ones"), message
        assert f"they differ as {how} peers" in message and "trainer.strategy.dp_rank" in message, message
        assert other[f"rank-split stream, {layout}"] == "SystemExit: 1"
    assert first["dp-split stream, tp2"] == other["dp-split stream, tp2"] == "ran"
    message = first["unsplit stream, dp2"]
    assert message.startswith("BatchError: The data-parallel ranks got the same batch (train batch 0): rank 0"
                              " (data-parallel rank 0) and rank 1 (data-parallel rank 1) hold identical"), message
    assert "trainer.strategy.dp_rank" in message and other["unsplit stream, dp2"] == "SystemExit: 1", message
    assert first["dp-split stream, dp2"] == other["dp-split stream, dp2"] == "ran"


def test_a_batch_fingerprint_sees_every_byte_and_the_structure():
    rows = token_rows()
    batch = (rows[:4, :-1], rows[:4, 1:])
    base = fingerprint(batch, rows.device)
    assert base.equal(fingerprint((rows[:4, :-1].clone(), rows[:4, 1:].clone()), rows.device))
    changed = rows[:4, 1:].clone()
    changed[3, 7] += 1
    assert not base.equal(fingerprint((rows[:4, :-1], changed), rows.device))
    assert not base.equal(fingerprint({"input_ids": batch[0], "labels": batch[1]}, rows.device))
    assert not base.equal(fingerprint((batch[0], batch[1].float()), rows.device))
    assert not base.equal(fingerprint((batch[1], batch[0]), rows.device))


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_gradients_changed_in_hooks_match_one_device(two_ranks, name):
    _, make, trainer_kwargs = HOOKS[name]
    reference = _state(_fit("auto", make(), lambda t: pairs_loader(GLOBAL_BATCH), steps=3, devices=1,
                            **trainer_kwargs))
    for rank, out in enumerate(two_ranks):
        for key, value in reference.items():
            assert torch.allclose(out[f"hooks: {name}"][key], value, rtol=0, atol=PARAM_ATOL), (name, rank, key)


def test_gradients_a_rank_holds_pieces_of_are_not_normed_by_hand(two_ranks):
    for out in two_ranks:
        for case in ("hand clipping, tp2", "hand clipping, pp2", "norm by hand, tp2", "norm by hand, pp2",
                     "clipping after backward, dp2, accumulation"):
            message = out[case]
            assert message.startswith("RuntimeError: an op on parameters' gradients computed on this rank alone"), \
                (case, message)
            assert "gradient_clip_val" in message and "parameter_grad_norms()" in message, message
        message = out["hand clipping, dp2 ZeRO-1"]
        assert "under zero_stage=1 the reduced gradient is split over the data-parallel ranks" in message, message
        assert out["hand clipping, dp2"] == "ran"  # whole gradients on every rank: its norm is one device's


def test_backward_hooks_run_per_batch_and_gradients_no_rank_holds_refuse_use(two_ranks):
    for out in two_ranks:
        # Once per batch as on one device (the schedule runs the backward inside training_step).
        assert out["backward hooks called, pp2, accumulation"] == {"on_before_backward": 4, "on_after_backward": 4}
        message = out["scaled after backward, dp2 ZeRO-3, accumulation"]
        assert "mul_" in message and "grad_reduce='micro_batch'" in message, message
        message = out["gradient assigned before the step, dp2 ZeRO-2"]
        assert "p.grad of ['head.weight'] was assigned after the gradients were reduced" in message, message
        message = out["unfrozen at the second step, dp2 ZeRO-1"]
        assert "['embed.weight'] got a gradient but was not trainable in the optimizer when training" in message, \
            message


def test_a_tie_zero3_cannot_keep_in_one_unit_is_refused_by_name(two_ranks):
    for out in two_ranks:
        message = out["tied head held directly, dp2 ZeRO-3"]
        assert message.startswith("ValueError: zero_stage=3 shards each of TiedLM's children"), message
        assert "['embed', 'head'] share one parameter" in message, message


def test_random_ops_that_cannot_draw_one_devices_values_are_refused_by_name(two_ranks):
    first, other = two_ranks
    for layout, where in (("dp2", "blocks.0.drop_whole"), ("split by tp2", "blocks.0.drop_split (inside a TP split"),
                          ("pp2", "drop_whole")):
        message = first[f"dropout, {layout}"]
        assert message.startswith("ValueError: DropoutLM runs random ops in training that cannot draw"), message
        assert where in message and "randomness='independent'" in message, message
        assert other[f"dropout, {layout}"] == message


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


def test_independent_streams_never_draw_one_mask_for_other_data(two_ranks):
    """Masks of p=0.5 (equal draws agree on 1.0 of the elements, independent ones on about 0.5): data-parallel ranks
    hold other samples; TP ranks hold the same activations outside the split spans (identical masks, or the replicas
    would diverge) and other heads inside them; under SP other tokens everywhere."""
    first, other = two_ranks
    for name, layout in (("blocks.0.drop_split", "dp2"), ("blocks.0.drop_whole", "dp2"),
                         ("blocks.0.drop_split", "tp2"), ("blocks.1.drop_split", "tp2"),
                         ("model.blocks.0.attn.resid_dropout", "tp2 SP"), ("model.blocks.0.mlp.dropout", "tp2 SP")):
        a, b = first[f"masks, {layout}"][name], other[f"masks, {layout}"][name]
        assert abs(_agreement(a, b) - 0.5) < 0.1, (name, layout, _agreement(a, b))
    for name in ("blocks.0.drop_whole", "blocks.1.drop_whole"):
        assert first["masks, tp2"][name].equal(other["masks, tp2"][name]), name
    # Two spans of one rank (two layers) draw other masks too.
    assert abs(_agreement(first["masks, tp2"]["blocks.0.drop_split"],
                          first["masks, tp2"]["blocks.1.drop_split"]) - 0.5) < 0.1


def test_an_auxiliary_loss_of_the_batch_is_refused_where_accumulation_would_weigh_it_otherwise(two_ranks):
    for out in two_ranks:
        message = out["moe aux loss, padding, accumulation, dp2"]
        assert message.startswith("ValueError: CausalLM adds an auxiliary loss of the whole batch"), message
        assert "accumulate_grad_batches=2" in message and "1/2" in message, message


def test_what_splitting_the_sequence_or_the_rows_would_change_is_refused_by_name(two_ranks):
    first, other = two_ranks
    for case, where in (("a window mask of its own", "blocks.0 differs"),
                        ("a convolution along the sequence", "blocks.0 differs"),
                        ("positions from torch.arange", "the input of blocks.0"),
                        ("dynamic RoPE", "differs"), ("attention temperature", "differs")):
        for out in (first, other):
            message = out[f"cp2: {case}"]
            assert message.startswith("ValueError: cp=2 would train another model than one device"), (case, message)
            assert where in message and "Train this model with cp=1" in message, (case, message)
    assert first["cp2: positions from the batch"] == other["cp2: positions from the batch"] == "ran"
    for out in (first, other):
        for case in ("dp2: dynamic RoPE on padded rows", "dp2: BatchNorm"):
            message = out[case]
            assert message.startswith("ValueError: dp=2 would train another model than one device"), (case, message)
            assert "output for a row depends on the other rows of its batch" in message, (case, message)


class GlobalInitDropoutLM(UserLM):
    """As users write it: the default inits draw from the global random state after ``seed_everything`` (here one
    draw stands for them), and dropout runs on the TP group's replicated activations."""

    def __init__(self) -> None:
        super().__init__(dropout=0.2)
        torch.randn(3)


def _dropout_losses(one_device: bool) -> list:
    L.seed_everything(0, verbose=False)
    module = GlobalInitDropoutLM()
    losses = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, *args) -> None:
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(accelerator="cpu", devices=1 if one_device else 2, max_steps=3, callbacks=[Losses()],
                        strategy="auto" if one_device else HybridStrategy(tp=2), **QUIET_TRAINER)
    trainer.fit(module, pairs_loader(4))
    return losses


def test_dropout_after_a_script_drew_from_the_global_state_draws_one_devices_masks():
    """The random state a rank trains from is the one its script left (no re-seeding at set-up): the same masks,
    the losses of one device (within the TP reductions' rounding; other masks move them by ~1e-3)."""
    assert run_distributed(_dropout_losses, 2, False)[0] == pytest.approx(_dropout_losses(True), rel=1e-6, abs=0)
