"""LoRA through peft (``CausalLM(lora=...)``): what is refused by name, the adapters' init and the frozen base, the
exports (the merged model loads in transformers, the adapter in peft, both giving the trained module's logits).
Parity under every layout: tests/hf/test_finetune_parity.py; adapter dropout under tp2 refused on every rank:
tests/strategy/test_user_code.py."""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytest.importorskip("peft")

import lightning as L  # noqa: E402

from lightning_hybrid.data.corpus import ByteCorpusDataModule  # noqa: E402
from lightning_hybrid.hf import CausalLM, export_adapter, export_pretrained  # noqa: E402
from lightning_hybrid.hf.lora import check_lora_layout, lora_config  # noqa: E402
from tests.families import tiny_config  # noqa: E402
from tests.helpers import QUIET_TRAINER, run_distributed  # noqa: E402

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.mark.parametrize("lora, message", [
    ({"r": 4}, r"lora: name the modules to adapt \(target_modules"),
    ({"r": 4, "target_modules": ["q_proj"], "use_dora": True}, r"\['use_dora'\] are not supported: plain LoRA"),
    ({"r": 4, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, r"\['modules_to_save'\] are not"),
    ({"rank": 4, "target_modules": ["q_proj"]}, r"lora=\{'rank': 4, .*\} is invalid: .*rank"),
    ("r=4", r"lora='r=4' is invalid: use a peft.LoraConfig or a mapping of its fields"),
    ({"r": 4, "target_modules": ["q_proj"], "init_lora_weights": "pissa"}, r"init_lora_weights='pissa' is not supp"),
])
def test_what_lora_cannot_train_is_refused_at_construction(lora, message):
    with pytest.raises(ValueError, match=message):
        CausalLM(tiny_config("llama"), lora=lora)


def test_adapters_alone_train_and_every_process_draws_them_alike():
    module = CausalLM(tiny_config("llama"), lora=LORA)
    module.configure_model()
    assert module.adapted == [f"model.layers.{i}.{m}" for i in range(2)
                              for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")]
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    again = CausalLM(tiny_config("llama"), lora=LORA)
    torch.manual_seed(123)  # the global random state does not matter: the init_seed does
    again.configure_model()
    for (name, p), q in zip(module.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name
    # The frozen weights are those of the model without adapters; A is drawn as nn.Linear's init, B is zero (peft's
    # default), each tensor from its own name (whichever rank builds it, whichever piece it keeps).
    plain = CausalLM(tiny_config("llama"))
    plain.configure_model()
    weights = dict(plain.named_parameters())
    for name, p in module.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, weights[name.replace(".base_layer.", ".")]), name
    a = module.model.model.layers[1].mlp.down_proj.lora_A.default.weight
    assert a.abs().max() <= 1 / a.size(1) ** 0.5 and a.std() > 0
    assert not module.model.model.layers[1].mlp.down_proj.lora_B.default.weight.any()
    # The hyperparameters hold a mapping that builds the same config (a checkpoint's, YAML-safe).
    assert CausalLM(tiny_config("llama"), lora=module.hparams["lora"]).lora == module.lora
    with pytest.raises(ValueError, match=r"target_modules=.*'wq'.* matches no module"):
        CausalLM(tiny_config("llama"), lora={"r": 4, "target_modules": ["wq"]}).configure_model()


def test_what_a_layout_cannot_split_exactly_is_refused():
    """Adapter dropout under TP (a user module's peft wrappers: tests/strategy/test_user_code.py)."""
    check_lora_layout(2, lora_config(LORA))
    check_lora_layout(1, lora_config({**LORA, "lora_dropout": 0.1}))
    with pytest.raises(ValueError, match=r"lora_dropout=0.1 with tp=2: .* set lora_dropout=0 under tp > 1"):
        check_lora_layout(2, lora_config({**LORA, "lora_dropout": 0.1}))


@pytest.mark.parametrize("family, lora", [
    ("llama", LORA),
    # all-linear on an MoE: peft's ParamWrapper on the router's weight and on the experts' two packed parameters
    # (nested), each merged expert by expert
    ("mixtral", {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False}),
])
def test_exports_give_the_trained_modules_logits(tmp_path, family, lora):
    """One device: the merged folder loads in transformers, the adapter folder in peft onto the base folder."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(family)).float().save_pretrained(tmp_path / "base")
    L.seed_everything(0, verbose=False)
    module = CausalLM(str(tmp_path / "base"), lr=1e-2, lora=lora)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, limit_val_batches=0, **QUIET_TRAINER)
    trainer.fit(module, ByteCorpusDataModule(max_bytes=10_000, block_size=16, batch_size=2))
    export_pretrained(trainer, tmp_path / "merged")
    export_adapter(trainer, tmp_path / "adapter")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    module.eval()
    with torch.no_grad():
        want = module(ids)
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base").float().eval()
        assert not torch.allclose(base(input_ids=ids).logits, want, atol=1e-4), "the adapters were trained"
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").float().eval()
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=0, atol=1e-5)
        for folder in (tmp_path / "adapter", tmp_path / "merged" / "adapter"):
            peft_model = PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(tmp_path / "base").float(), folder).eval()
            torch.testing.assert_close(peft_model(input_ids=ids).logits, want, rtol=0, atol=1e-6)


def _adapter_lm(folder: str) -> CausalLM:
    return CausalLM(folder, lr=1e-2, lora=LORA, checkpoint_frozen=False)


def _save_and_resume_adapters(folder: str, ckpt: str) -> dict:
    from tests.strategy.test_checkpoint import fit_and_resume

    return fit_and_resume(ckpt, dict(tp=2, sequence_parallel=True), {"dp2-zero3": dict(dp=2, zero_stage=3)},
                          partial(_adapter_lm, folder), world=2, steps=4)


def test_adapter_checkpoints_hold_the_adapters_alone_and_resume_exactly(tmp_path):
    """``checkpoint_frozen=False``: the checkpoint holds the adapters and their optimizer state (the TP-split ones
    whole), not the frozen base; resuming reads the base from the folder again -- bit for bit under the saved
    layout (tp2 + SP), and resharded to dp2 ZeRO-3."""
    from transformers import AutoModelForCausalLM

    from lightning_hybrid.checkpoint import read_meta
    from tests.strategy.test_checkpoint import assert_resumed_exactly

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).float().save_pretrained(tmp_path / "base")
    ckpt = str(tmp_path / "adapters.ckpt")
    by_rank = run_distributed(_save_and_resume_adapters, 2, str(tmp_path / "base"), ckpt)
    assert_resumed_exactly(by_rank, {"dp2-zero3": None}, steps=4)
    tensors = read_meta(ckpt)["lightning_hybrid"]["tensors"]
    saved = {k.split("/")[1] if k.startswith("model/") else k.split("/")[2] for k in tensors}
    assert saved and all(".lora_A." in name or ".lora_B." in name for name in saved), sorted(saved)[:5]
    a = "model.model.layers.0.self_attn.q_proj.lora_B.default.weight"  # column-split: saved whole
    assert tensors[f"model/{a}"][1] == [32, 4], tensors[f"model/{a}"]  # (hidden 32; each rank holds 16 rows)
    with pytest.raises(ValueError, match="checkpoint_frozen=False leaves a LoRA run's frozen base out"):
        CausalLM(tiny_config("llama"), checkpoint_frozen=False)
