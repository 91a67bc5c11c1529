"""Every DP x TP x ZeRO layout reproduces the one-device run: losses, gradient norms, validation metrics
(a torchmetrics metric included) and final weights, over 10 AdamW steps in fp32 with clipping active.

The one-device reference runs in the test process; each world size is one group of spawned ranks that
runs several layouts one after another on the same process group.
"""

from __future__ import annotations

import os
from functools import partial

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_hybrid import HybridStrategy
from lightning_hybrid.data import ByteCorpusDataModule
from lightning_hybrid.models import GPTConfig, GPTLightningModule
from tests.helpers import QUIET_TRAINER, Recorder, run_distributed, storage_bytes

STEPS = 10
GLOBAL_BATCH = 8
CLIP = 0.5
BLOCK = 32
RTOL = 1e-5
PARAM_ATOL = 1e-5


class OneDeviceInDistributedOrder(ByteCorpusDataModule):
    """Lightning shuffles the training data of every distributed run with ``DistributedSampler(seed=0)``
    (whatever the DataLoader says). The one-device reference reads the samples in that same order."""

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.train_dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(self.train_dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True)


def fit_and_record(strategy, devices: int, make_module, dp: int = 1, **trainer_kwargs) -> dict:
    """Train STEPS steps on the stdlib byte corpus; return what the parity checks compare (same on all ranks)."""
    L.seed_everything(0, verbose=False)
    module = make_module()
    data_class = OneDeviceInDistributedOrder if strategy == "auto" else ByteCorpusDataModule
    data = data_class(max_bytes=80_000, block_size=BLOCK, batch_size=GLOBAL_BATCH // dp)
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        **QUIET_TRAINER,
        callbacks=[recorder],
        **{"val_check_interval": STEPS * trainer_kwargs.get("accumulate_grad_batches", 1), **trainer_kwargs},
    )
    trainer.fit(module, data)
    full = trainer.strategy.full_state_dict() if isinstance(trainer.strategy, HybridStrategy) else module.state_dict()
    return {
        "losses": recorder.losses,
        "grad_norms": recorder.grad_norms,
        "grad_reductions": getattr(trainer.strategy, "_test_reductions", None),
        "param_bytes": storage_bytes(module.parameters()),
        "val_loss": trainer.callback_metrics["val_loss"].item(),
        "val_acc": trainer.callback_metrics["val_acc"].item(),
        "state": {k: v.cpu() for k, v in full.items()},
    }


class CountingHybridStrategy(HybridStrategy):
    """Counts DP gradient reductions (the real ones run unchanged)."""

    _test_reductions = 0

    def reduce_gradients(self) -> None:
        self._test_reductions += 1
        super().reduce_gradients()


def gpt(**overrides):
    base = dict(vocab_size=256, block_size=BLOCK, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp="swiglu", dropout=0.0)
    base.update(overrides)
    return partial(GPTLightningModule, config=GPTConfig(**base), lr=5e-4, weight_decay=0.1)


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


def _fit_runs(runs: dict[str, tuple]) -> dict[str, dict]:
    world = int(os.environ["WORLD_SIZE"])
    results = {}
    for name, (kwargs, make_module, trainer_kwargs, *_) in runs.items():
        dp = kwargs.get("dp", world // (kwargs.get("tp", 1) * kwargs.get("pp", 1)))
        results[name] = fit_and_record(CountingHybridStrategy(**kwargs), world, make_module, dp=dp, **trainer_kwargs)
    return results


def assert_matches(name: str, got: dict, ref: dict, rtol: float = RTOL, param_atol: float = PARAM_ATOL) -> None:
    assert len(got["losses"]) == len(ref["losses"]) > 0, name
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=0, msg=f"{name}: losses")
    torch.testing.assert_close(
        torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=rtol, atol=0, msg=f"{name}: grad norms"
    )
    torch.testing.assert_close(got["val_loss"], ref["val_loss"], rtol=rtol, atol=0, msg=f"{name}: val_loss")
    assert got["val_acc"] == pytest.approx(ref["val_acc"], rel=rtol), f"{name}: val_acc"
    assert got["state"].keys() == ref["state"].keys()
    for key, value in ref["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=0, atol=param_atol, msg=f"{name}: parameter {key}")


def check_world(world: int, runs: dict[str, tuple]) -> list[dict]:
    """``runs``: name -> (strategy kwargs, module factory, trainer kwargs[, (loss/norm rtol, parameter atol)])."""
    references = {}
    for name, (_, make_module, trainer_kwargs, *_) in runs.items():
        references[name] = fit_and_record("auto", 1, make_module, **trainer_kwargs)
        assert min(references[name]["grad_norms"]) > CLIP, "clipping must be active for the norm check to mean anything"
    results = run_distributed(_fit_runs, world, runs)
    for rank, per_run in enumerate(results):
        for name, (*_, tolerances) in ((n, (*r, (RTOL, PARAM_ATOL))[:4]) for n, r in runs.items()):
            assert_matches(f"{name} (rank {rank})", per_run[name], references[name], *tolerances)
            assert per_run[name]["grad_reductions"] == STEPS, f"{name}: one gradient reduction per optimizer step"
    return results


def test_world2_layouts_match_one_device():
    model = gpt()
    check_world(2, {name: (kwargs, model, {}) for name, kwargs in {
        "dp2": dict(dp=2),
        "tp2": dict(tp=2),
        "dp2-zero1": dict(dp=2, zero_stage=1),
        "dp2-zero2": dict(dp=2, zero_stage=2),
        "dp2-zero3": dict(dp=2, zero_stage=3),
    }.items()})


def test_world4_layouts_match_one_device():
    model = gpt(n_kv_head=4, mlp="gelu")  # plain MHA + fc1/fc2 MLP; tp4 splits 4 heads
    check_world(4, {name: (kwargs, model, {}) for name, kwargs in {
        "tp4": dict(tp=4),
        "dp2xtp2": dict(dp=2, tp=2),
        "dp2xtp2-zero1": dict(dp=2, tp=2, zero_stage=1),
        "dp2xtp2-zero2": dict(dp=2, tp=2, zero_stage=2),
        "dp2xtp2-zero3": dict(dp=2, tp=2, zero_stage=3),
    }.items()})


def test_accumulation_foreign_model_and_bf16_match_one_device():
    """Gradient accumulation (reduced once per optimizer step), a transformers Llama split by the auto plan,
    and bf16-mixed (against the one-device bf16-mixed run, at bf16 tolerance: TP sums partial products in bf16)."""
    check_world(4, {
        "dp2xtp2-zero2-accumulate2": (dict(dp=2, tp=2, zero_stage=2), gpt(), {"accumulate_grad_batches": 2}),
        "dp2xtp2-zero0-accumulate2": (dict(dp=2, tp=2), gpt(), {"accumulate_grad_batches": 2}),
        "llama-dp2xtp2-zero1": (dict(dp=2, tp=2, zero_stage=1), partial(TinyLlama, lr=5e-4), {}),
        "bf16-dp2xtp2-zero3": (dict(dp=2, tp=2, zero_stage=3), gpt(), {"precision": "bf16-mixed"}, (2e-2, 1e-2)),
        "bf16-pp2xtp2": (dict(pp=2, tp=2), gpt(), {"precision": "bf16-mixed"}, (2e-2, 1e-2)),
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
    })


def test_pipeline_with_dp_and_tp_match_one_device():
    model = gpt(n_layer=2, n_kv_head=4, mlp="gelu")
    check_world(4, {
        "pp4-1f1b": (dict(pp=4, schedule="1f1b"), model, {}),
        "pp2xdp2": (dict(pp=2, dp=2), model, {}),
        "pp2xtp2": (dict(pp=2, tp=2, split_points=[2]), model, {}),
    })


def test_3d_with_every_zero_stage_matches_one_device():
    """pp2 x dp2 x tp2 on 8 ranks with ZeRO 0-3; each rank holds about 1/(pp*tp) of the model (1/dp more
    under ZeRO-3)."""
    config = gpt(n_layer=2, n_embd=64)
    results = check_world(8, {f"3d-zero{stage}": (dict(pp=2, dp=2, tp=2, zero_stage=stage), config, {}) for stage in range(4)})
    one_device = config()
    one_device.configure_model()
    total = sum(p.numel() * p.element_size() for p in one_device.parameters())
    for rank, per_run in enumerate(results):
        for stage in range(4):
            share = per_run[f"3d-zero{stage}"]["param_bytes"] / (total / (2 * 2))
            # Norms, position embeddings and row-parallel biases are replicated over TP: a few percent more.
            expected = 0.5 if stage == 3 else 1.0
            assert expected * 0.9 <= share <= expected * 1.15, (rank, stage, share)
