"""Pretrained folders as transformers' ``save_pretrained`` writes mixture-of-experts models: one tensor per expert
(``experts.0.w1.weight`` ...), which its loader stacks into the model's packed experts. `Safetensors` composes
them with transformers' own conversion mapping: whole, or only the experts of a dim-0 slice."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_hybrid.hf import CausalLM
from lightning_hybrid.hf.weights import Safetensors
from tests.families import build

PER_EXPERT = ("mixtral", "olmoe", "qwen3_moe", "deepseek_v3")  # the tiny MoE families saved one tensor per expert


class _Counted(Safetensors):
    """Records every tensor read from the folder: ``(key, dim, start, length)``."""

    def __init__(self, folder) -> None:
        super().__init__(folder)
        self.reads: list[tuple] = []

    def _get(self, key, dim=None, start=0, length=0):
        self.reads.append((key, dim, start, length))
        return super()._get(key, dim, start, length)


def _saved(family: str, folder):
    model = build(family)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("family", PER_EXPERT)
def test_per_expert_folders_read_as_transformers_loads_them(family, tmp_path):
    from transformers import AutoModelForCausalLM

    model = _saved(family, tmp_path)
    folder = _Counted(tmp_path)
    assert any(".experts.0." in key for key in folder.files), "save_pretrained wrote packed experts"
    folder.check(model)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    packed = [n for n, p in model.named_parameters() if ".experts." in n and p.ndim == 3]
    assert packed and all(n not in folder._stored for n in packed)
    for name, p in model.named_parameters():
        assert name in folder.files and folder.shapes[name] == tuple(p.shape), name
        assert torch.equal(folder.read(name), p) and torch.equal(loaded.get_parameter(name), p), name
    for name in packed:
        p = model.get_parameter(name)
        folder.reads.clear()
        assert torch.equal(folder.read(name, 0, 1, 2), p[1:3]), name
        # Only experts 1 and 2 are read, each whole, one per source (gate and up for gate_up_proj).
        experts = {int(key.split(".experts.")[1].split(".")[0]) for key, *_ in folder.reads}
        assert experts == {1, 2} and all(dim is None for _, dim, *_ in folder.reads), folder.reads
        assert len(folder.reads) == 2 * len(folder._parts[name].sources), folder.reads
        for dim in (1, 2):  # other dims: a slice of each expert's tensor, or composed whole then sliced
            assert torch.equal(folder.read(name, dim, 1, 3), p.narrow(dim, 1, 3)), (name, dim)


@pytest.mark.parametrize("family", ("gpt_oss", "gpt_neox"))
def test_folders_stored_packed_or_renamed(family, tmp_path):
    """GPT-OSS is saved with its packed experts as they are; GPT-NeoX's head as ``embed_out`` (renamed on load)."""
    model = _saved(family, tmp_path)
    folder = Safetensors(tmp_path)
    folder.check(model)
    for name, p in model.named_parameters():
        assert torch.equal(folder.read(name), p), name
        if p.ndim == 3:
            assert torch.equal(folder.read(name, 0, 1, 2), p[1:3]), name


@pytest.mark.parametrize("family", ("mixtral", "qwen3_moe"))
def test_causal_lm_builds_from_a_per_expert_folder(family, tmp_path):
    model = _saved(family, tmp_path)
    module = CausalLM(str(tmp_path))
    module.configure_model()
    state = module.model.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(state[name], value), name


def _renamed(folder, old: str, new: str) -> None:
    """The folder's expert tensors renamed: ``old`` replaced by ``new`` in their keys."""
    tensors = load_file(folder / "model.safetensors")
    renamed = {k.replace(old, new) if ".experts." in k else k: v for k, v in tensors.items()}
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})


def test_an_unconvertible_per_expert_layout_is_refused_clearly(tmp_path):
    model = _saved("qwen3_moe", tmp_path)
    _renamed(tmp_path, "_proj.weight", ".w.weight")  # experts.0.gate.w.weight ...: no converter matches
    with pytest.raises(KeyError, match=r"no tensor 'model\.layers\.0\.mlp\.experts\.\w+_proj'.*one tensor per expert"):
        Safetensors(tmp_path).check(model)
    _renamed(tmp_path, ".gate.w.", ".gate_proj.")  # the gate's tensors match again, not the up's
    with pytest.raises(KeyError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj'.*none matching"):
        Safetensors(tmp_path).check(model)


class _ShapeDependent(Safetensors):
    """The model's conversion mapping with an operation that reads the model's shapes added to each converter."""

    def _conversions(self, model):
        from transformers.core_model_loading import Transpose, WeightConverter

        return [c.copy(c._original_source_patterns, c._original_target_patterns,
                       operations=[*c.operations, Transpose(1, 2, check_dims=True)])
                if isinstance(c, WeightConverter) else c for c in super()._conversions(model)]


def test_a_converter_that_needs_the_model_is_refused_clearly(tmp_path):
    model = _saved("olmoe", tmp_path)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.\w+_proj'.* Transpose .*needs the model"):
        _ShapeDependent(tmp_path).check(model)
