"""LoRA through peft (``CausalLM(lora=...)``): what is refused by name, the adapters' init and the frozen base, the
exports (the merged model loads in transformers, the adapter in peft, both giving the trained module's logits).
Parity under dp2 ZeRO-3 and cp2: tests/hf/test_finetune_parity.py; tp2 refused: tests/strategy/test_user_code.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

import lightning as L  # noqa: E402

from lightning_hybrid.data.corpus import ByteCorpusDataModule  # noqa: E402
from lightning_hybrid.hf import CausalLM, export_adapter, export_pretrained  # noqa: E402
from lightning_hybrid.hf.lora import check_lora_layout  # noqa: E402
from tests.families import tiny_config  # noqa: E402
from tests.helpers import QUIET_TRAINER  # noqa: E402

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.mark.parametrize("lora, message", [
    ({"r": 4}, r"lora: name the modules to adapt \(target_modules"),
    ({"r": 4, "target_modules": ["q_proj"], "use_dora": True}, r"\['use_dora'\] are not supported: plain LoRA"),
    ({"r": 4, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, r"\['modules_to_save'\] are not"),
    ({"rank": 4, "target_modules": ["q_proj"]}, r"lora=\{'rank': 4, .*\} is invalid: .*rank"),
    ("r=4", r"lora='r=4' is invalid: use a peft.LoraConfig or a mapping of its fields"),
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
    # The hyperparameters hold a mapping that builds the same config (a checkpoint's, YAML-safe).
    assert CausalLM(tiny_config("llama"), lora=module.hparams["lora"]).lora == module.lora
    with pytest.raises(ValueError, match=r"target_modules=.*'wq'.* matches no module"):
        CausalLM(tiny_config("llama"), lora={"r": 4, "target_modules": ["wq"]}).configure_model()


def test_layouts_that_split_layers_by_name_refuse_lora():
    """(A whole run under tp2 is refused on every rank: tests/strategy/test_user_code.py.)"""
    check_lora_layout(1, 1, 1)
    with pytest.raises(ValueError, match=r"lora with pp=2, ep=4: splitting the adapters .* \(tp = pp = ep = 1\)"):
        check_lora_layout(1, 2, 4)


def test_exports_give_the_trained_modules_logits(tmp_path):
    """One device: the merged folder loads in transformers, the adapter folder in peft onto the base folder."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).float().save_pretrained(tmp_path / "base")
    L.seed_everything(0, verbose=False)
    module = CausalLM(str(tmp_path / "base"), lr=1e-2, lora=LORA)
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
