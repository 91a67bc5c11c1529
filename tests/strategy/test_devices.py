"""Every tensor the package creates names its device (or comes from a ``*_like``): a CPU generator never meets a
tensor made on the ambient device, which inside Lightning's init context is the GPU. CPU runs cannot show the
crash itself, so the source is scanned (every call site) and the package runs under an audit of factory calls
(every call made, also with a device passed on as ``None``): model construction, the decomposition check, TP
verification and layer-by-layer materialisation, the pipeline cut, ZeRO, gradient norms and checkpoints."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_hybrid import HybridStrategy
from lightning_hybrid.data.corpus import ByteCorpusDataModule
from lightning_hybrid.models import GPTConfig, GPTLightningModule
from lightning_hybrid.testing.device_audit import AmbientDeviceAudit, package_sources, scan_source
from tests.helpers import QUIET_TRAINER, run_distributed

TINY_GPT = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp="swiglu",
                     dropout=0.0)


def test_no_factory_call_in_the_package_leaves_its_device_to_the_ambient_one():
    assert scan_source(package_sources()) == []


def _factory(device):
    return torch.zeros(2, device=device)


def test_the_scan_and_the_audit_find_a_device_left_to_the_ambient_one(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\n"
        "g = torch.Generator()\n"
        "x = torch.empty(3).normal_(generator=g)\n"
        "y = torch.randn(3, generator=g, device=g.device)\n"
        "z = torch.Generator(device='cpu')\n"
    )
    assert [line.split(":")[1] for line in scan_source([bad])] == ["2", "3"]
    with AmbientDeviceAudit(roots=[Path(__file__).parent]) as audit:
        _factory("cpu")
        torch.nn.Linear(2, 2)  # a module built where the ambient device says: by design, not counted
        _factory(None)  # a device passed on as None: the ambient one
    assert len(audit.calls) == 1 and "_factory()" in audit.calls[0], audit.calls


def test_models_are_built_and_checked_with_every_device_stated():
    pytest.importorskip("transformers")
    from lightning_hybrid.hf import CausalLM
    from tests.families import tiny_config

    with AmbientDeviceAudit() as audit:
        GPTLightningModule(config=TINY_GPT).configure_model()
        for family in ("llama", "gpt2", "gpt_neox", "qwen2", "mixtral"):
            module = CausalLM(tiny_config(family))
            module.configure_model()
            module.pipeline_layers()  # the decomposition check on stand-ins
    assert audit.calls == []


def _fits_under_the_audit(tmp: str) -> list[str]:
    from lightning_hybrid.hf import CausalLM
    from tests.families import tiny_config

    layouts = [
        (dict(tp=2), lambda: GPTLightningModule(config=TINY_GPT)),  # TP verification on the example input
        (dict(tp=2), lambda: CausalLM(tiny_config("llama"))),  # split on meta, materialised layer by layer
        (dict(pp=2, micro_batches=2), lambda: GPTLightningModule(config=TINY_GPT)),
        (dict(dp=2, zero_stage=1), lambda: GPTLightningModule(config=TINY_GPT)),
        (dict(dp=2, zero_stage=3), lambda: CausalLM(tiny_config("gpt2"))),
        # experts split on meta and exchanged with all-to-alls; the load-balancing loss gathered over DP
        (dict(dp=2, ep=2, zero_stage=1), lambda: CausalLM(tiny_config("mixtral"))),
        # sequences split over CP ranks (positions, the mask of the whole sequence), keys and values gathered
        (dict(dp=1, cp=2), lambda: CausalLM(tiny_config("llama"))),
    ]
    with AmbientDeviceAudit() as audit:
        for i, (kwargs, make) in enumerate(layouts):
            L.seed_everything(0, verbose=False)
            trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(**kwargs), max_steps=2,
                                gradient_clip_val=1.0, limit_val_batches=1, num_sanity_val_steps=0, **QUIET_TRAINER)
            trainer.fit(make(), ByteCorpusDataModule(max_bytes=10_000, block_size=16, batch_size=2))
            trainer.save_checkpoint(f"{tmp}/layout{i}.ckpt")
    return audit.calls


def test_every_layout_runs_with_every_device_stated(tmp_path):
    pytest.importorskip("transformers")
    for calls in run_distributed(_fits_under_the_audit, 2, str(tmp_path)):
        assert calls == []
