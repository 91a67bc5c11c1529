"""Weights into a `CausalLM`: the tensors of a local pretrained folder, read whole or one TP slice at a time
(`Safetensors`), and the names of tied weights (`tied_keys`). Writing a trained run back to a folder is
`lightning_hybrid.hf.export`'s."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

import torch
from torch import Tensor, nn

__all__ = ["Safetensors", "tied_keys"]


class Safetensors:
    """The tensors of a local Hugging Face folder (``model.safetensors`` or an index): their shapes (from the
    headers), and each read on its own, whole or a slice along one dimension.

    Once `check` has seen the model, ``files``, ``shapes`` and `read` also answer for the model's tensors that
    the folder stores under other names or in parts, as ``from_pretrained`` finds them (its conversion mapping):
    renamed keys, and the per-expert tensors of a mixture-of-experts checkpoint (``experts.0.w1.weight`` ...),
    which its converters stack (and concatenate) into the model's packed ``experts.gate_up_proj``. ``files``
    maps such a tensor to the file of its first part."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.exists():
            self.files = {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        elif (folder / "model.safetensors").exists():
            with safe_open(folder / "model.safetensors", "pt") as f:
                self.files = {k: folder / "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"{folder} holds no model.safetensors (nor its index): save it with save_pretrained."
            )
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in dict.fromkeys(self.files.values()):
            with safe_open(file, "pt") as f:
                self.shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        self._stored = dict(self.files)  # the folder's own keys
        self._parts: dict[str, Union[str, _Composed]] = {}  # model name -> its folder key, or how it is composed

    def read(self, key: str, dim: Optional[int] = None, start: int = 0, length: int = 0) -> Tensor:
        """The tensor ``key``, or with ``dim`` only its ``[start, start + length)`` along ``dim``. Only those bytes
        are read; of a composed tensor, only the parts of that slice (a dim-0 slice of packed experts: those
        experts' tensors), unless its converter mixes that dim (then it is composed whole and sliced)."""
        part = self._parts.get(key, key)
        if isinstance(part, str):
            return self._get(part, dim, start, length)
        where = None if dim is None else _slice_source(part.converter.operations, dim % len(self.shapes[key]))
        sources = part.sources
        if where == -1:  # the stacked dim: those tensors of each list
            sources = {pattern: keys[start:start + length] for pattern, keys in sources.items()}
        get = self._get if where is None or where < 0 else (lambda k: self._get(k, where, start, length))
        value = self._compose(part, sources, get)[key]
        return value.narrow(dim, start, length).contiguous() if dim is not None and where is None else value

    def _get(self, key: str, dim: Optional[int] = None, start: int = 0, length: int = 0) -> Tensor:
        """The folder's tensor ``key``, whole or its ``[start, start + length)`` along ``dim``: every read of the
        folder goes through here."""
        from safetensors import safe_open

        if key not in self._stored:
            raise KeyError(key)
        with safe_open(self._stored[key], "pt") as f:
            if dim is None:
                return f.get_tensor(key)
            return f.get_slice(key)[(slice(None),) * dim + (slice(start, start + length),)]

    @staticmethod
    def _compose(part: _Composed, sources: dict[str, list[str]], get) -> dict[str, Tensor]:
        """Run ``part``'s converter (transformers' own code) on the folder tensors ``get(key)`` of ``sources``:
        ``{model name: tensor}``."""
        converter = copy.deepcopy(part.converter)
        for pattern, keys in sources.items():
            for key in keys:
                converter.add_tensor(part.first, key, pattern, functools.partial(get, key))
        return {k: v[0] if isinstance(v, list) else v for k, v in converter.convert(part.first).items()}

    def _conversions(self, model: nn.Module) -> list:
        """The weight transforms ``from_pretrained`` applies to ``model``'s checkpoints."""
        from transformers.conversion_mapping import get_model_conversion_mapping

        return get_model_conversion_mapping(model)

    def _resolve(self, model: nn.Module) -> None:
        """Map each folder key to the model's tensor transformers' loader puts it in (`rename_source_key`, as
        ``convert_and_load_state_dict_in_model`` does), and add the renamed and composed tensors to ``files`` and
        ``shapes`` (a composition's shapes from a run of its converter on the meta device)."""
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        wanted = dict.fromkeys(model.state_dict(keep_vars=True), True)
        transforms = self._conversions(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        prefix = model.base_model_prefix
        self._parts = {}
        for key in sorted(self._stored, key=dot_natural_key):  # the loader's order: experts 0, 1, ..., 10
            name, pattern = rename_source_key(key, renamings, converters, prefix, wanted)
            if name not in wanted and key in wanted:
                name, pattern = rename_source_key(key, [], [], prefix, wanted)
            if name not in wanted or (name == key and pattern is None):
                continue
            if pattern is None:  # renamed (the first key wins, as in the loader)
                if name not in self._parts:
                    self._parts[name] = key
                    self.files[name], self.shapes[name] = self._stored[key], self.shapes[key]
                continue
            part = self._parts.setdefault(name, _Composed(by_pattern[pattern], {}, name))
            part.sources.setdefault(pattern, []).append(key)
        for part in [p for p in self._parts.values() if isinstance(p, _Composed)]:
            first = next(iter(part.sources.values()))[0]
            absent = [pattern for pattern in part.converter.source_patterns if pattern not in part.sources]
            if absent:
                raise KeyError(f"{self.folder}: transformers composes {part.first!r} from the tensors matching"
                               f" {part.converter.source_patterns}; the folder holds {first!r} and the like, but"
                               f" none matching {absent}.")
            odd = [op for op in part.converter.operations if not _input_only(op)]
            if odd:
                raise ValueError(
                    f"{self.folder}: transformers loads {part.first!r} from {first!r} and the like with"
                    f" {type(odd[0]).__name__} ({part.converter}), an operation that needs the model or its config;"
                    " CausalLM reproduces only stacking, concatenating, chunking, interleaving and transposing."
                    " Convert the folder once: AutoModelForCausalLM.from_pretrained it and save its state_dict()"
                    " with safetensors.torch.save_file next to its config.json.")
            try:
                shapes = self._compose(part, part.sources, lambda k: torch.empty(self.shapes[k], device="meta"))
            except Exception as e:
                raise ValueError(f"{self.folder}: the tensors {first!r}, ... do not compose into {part.first!r}"
                                 f" ({part.converter}): {e}") from e
            for name, value in shapes.items():
                self._parts[name] = part
                self.files[name], self.shapes[name] = self._stored[first], tuple(value.shape)

    def _per_expert_hint(self, name: str) -> str:
        """Why a packed experts tensor may be missing: the folder stores one tensor per expert, in a layout that
        transformers' conversion mapping for the model does not turn into it."""
        prefix = name.rpartition(".")[0]
        if not any(key.startswith(prefix + ".0.") for key in self._stored):
            return ""
        return (f" The folder stores {prefix} one tensor per expert ({prefix}.0. ...), in a layout that transformers'"
                " conversion mapping for this model does not turn into the model's packed tensor. Convert the folder"
                " once: AutoModelForCausalLM.from_pretrained it (with a key_mapping where needed) and save its"
                " state_dict() with safetensors.torch.save_file next to its config.json.")

    def check(self, model: nn.Module) -> None:
        """``KeyError`` / ``ValueError`` unless the folder holds every parameter of ``model`` (but tied copies) with
        the model's shape, as it is or composed as transformers' loader would (then also in ``files``,
        ``shapes`` and `read`): raised on every rank at ``configure_model``, before any collective."""
        self._resolve(model)
        tied = set(tied_keys(model))
        for name, p in model.named_parameters(remove_duplicate=False):
            if name not in self.shapes:
                if name in tied:
                    continue
                raise KeyError(f"{self.folder} holds no tensor {name!r} (a parameter of {type(model).__name__})."
                               + self._per_expert_hint(name))
            if self.shapes[name] != tuple(p.shape):
                raise ValueError(f"{name}: the folder's tensor is {self.shapes[name]}, the model's {tuple(p.shape)}.")


class _Composed(NamedTuple):
    """A model tensor transformers' loader composes from several folder tensors: its ``converter``
    (a `transformers.core_model_loading.WeightConverter`), its folder keys by source pattern, in the loader's
    order, and the name of its first target (the converter's ``layer_name``)."""

    converter: Any
    sources: dict[str, list[str]]
    first: str


def _input_only(op: Any) -> bool:
    """Whether transformers' conversion op ``op`` computes from its input tensors alone (no model, config or
    dtype), so that running it here gives what the loader gives."""
    from transformers.core_model_loading import Chunk, Concatenate, Interleave, MergeModulelist, Transpose

    kind = type(op)
    return (kind in (MergeModulelist, Concatenate, Interleave) or (kind is Chunk and op.num_shards_attribute is None)
            or (kind is Transpose and not op.check_dims))


def _slice_source(ops: list, dim: int) -> Optional[int]:
    """Where a slice along ``dim`` of what ``ops`` compose comes from, when they first stack each source's list of
    tensors (``MergeModulelist``: the experts) and then only concatenate or transpose other dims: ``-1``, the same
    slice of each list (the stacked dim); ``d >= 0``, the same slice along ``d`` of each tensor; ``None``
    otherwise (compose whole, then slice)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose

    if not ops or type(ops[0]) is not MergeModulelist or ops[0].dim < 0:
        return None
    for op in reversed(ops[1:]):
        if type(op) is Transpose and min(op.dim0, op.dim1) >= 0:
            dim = {op.dim0: op.dim1, op.dim1: op.dim0}.get(dim, dim)
        elif type(op) is not Concatenate or op.dim < 0 or op.dim == dim:
            return None
    stacked = ops[0].dim
    return -1 if dim == stacked else dim - (dim > stacked)


def tied_keys(model: nn.Module) -> list[str]:
    if not getattr(model.config, "tie_word_embeddings", False):
        return []
    head = model.get_output_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    return [f"{names[id(head)]}.weight"] if head is not None and id(head) in names else []
