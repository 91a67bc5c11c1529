"""Hugging Face causal LMs under every layout, unchanged: `CausalLM` wraps any ``AutoModelForCausalLM``.

Built from a config (random init) or from a local pretrained folder (safetensors, as ``save_pretrained``
writes it), `CausalLM` trains under DP x TP x PP x ZeRO without edits to the model:

* **Pipeline layers from the model's own structure.** The decoder layers are the model's ``nn.ModuleList``
  (``base_model_pp_plan``'s ``layers``, or the one list of ``num_hidden_layers`` blocks); the modules before it
  (token and position embeddings, embedding norm or dropout) and after it (final norm) are layers of their
  own, in the model's order, and the output head is the last. Parameter-free modules outside them (rotary
  embeddings) are kept on every stage. The modules keep their places and names in the model, so the model's
  TP plan, checkpoints and ``save_pretrained`` names are unchanged.
* **What a decoder layer needs besides the hidden states** (attention mask, position ids, rotary or ALiBi
  tensors, which depend on the shape only) is what the model's own forward passes it: each stage runs the
  base model's forward once per input shape with stand-ins for every layer (no weights, no compute) and
  keeps the arguments the stand-ins received. A layer called by the pipeline with the hidden states alone
  gets those arguments from a forward pre-hook; the model's own forward, which passes them itself, is left
  as it is. A position embedding that follows the token embedding (GPT-2's ``wpe``) adds its embedding of
  the positions to the hidden states it receives.
* **Exact or refused.** At setup the pipeline's decomposition is checked against the model's own forward on
  small stand-ins of the embedding, norm and head modules (the code between modules -- a scaling of the
  embeddings, a soft cap of the logits -- is what can differ): a model whose forward does something the
  layers do not is refused with an error before the first step, as are tied input and output embeddings
  under ``pp > 1``.
* **Initialisation and loading per layer, and per TP slice.** The model is built on the meta device; each
  pipeline layer is materialised by `init_pipeline_layer`: from the pretrained folder (each rank reads only the
  tensors of its own layers, one safetensors tensor at a time), or with the model's own ``_init_weights`` under
  a seed of its own (so the same values come out under every layout and on one device). Under ``tp > 1`` (any
  ``pp``; at ``pp=1`` too, for a model its pipeline layers reproduce) the strategy splits the layers on the
  meta device first, and `load_pipeline_layer_slices` fills each with this rank's pieces only
  (``safe_open().get_slice``); a random init keeps this rank's slices of one unsplit layer at a time. The
  folder's names and shapes are checked against the model when it is built, on every rank.
* `export_pretrained` writes a trained run back to a folder that ``AutoModelForCausalLM.from_pretrained``
  loads.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import Tensor, nn

from lightning_hybrid.devices import module_device

__all__ = ["CausalLM", "ExportPretrained", "PipelineDecompositionError", "export_pretrained", "pipeline_structure"]

Batch = tuple[Tensor, Tensor]
_CHECK_TOKENS = 8  # the decomposition check's sequence length
_CHECK_VOCAB = 16  # rows of the embedding / head stand-ins in that check


class PipelineDecompositionError(ValueError):
    """The model's forward does something that its pipeline layers, applied in order, do not."""


# ---------------------------------------------------------------------------------------------- structure
class _Structure:
    """Where a causal LM's pipeline layers are: the path to the trunk (the module holding the decoder-layer
    list), the trunk's modules before and after that list, and the head (a child of the root)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        config = model.config
        n_layers = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0))
        head = model.get_output_embeddings()
        if head is None:
            raise PipelineDecompositionError(f"{type(model).__name__} has no output embeddings (get_output_embeddings() is None).")
        root_children = dict(model.named_children())
        self.head_name = next(n for n, m in root_children.items() if m is head)
        self.path: list[str] = []  # root -> trunk
        trunk = model
        while True:
            lists = [n for n, m in trunk.named_children() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
            if len(lists) == 1:
                break
            holders = [n for n, m in trunk.named_children() if any(True for _ in m.parameters()) and m is not head]
            if len(holders) != 1 or len(lists) > 1:
                raise PipelineDecompositionError(
                    f"cannot find the decoder layers of {type(model).__name__}: no single nn.ModuleList of"
                    f" num_hidden_layers={n_layers} modules under {'.'.join(self.path) or 'the model'}."
                )
            self.path.append(holders[0])
            trunk = getattr(trunk, holders[0])
        self.trunk = trunk
        self.layers_name = lists[0]
        children = list(trunk.named_children())
        at = [n for n, _ in children].index(self.layers_name)
        # The model's own pipeline plan names the trunk's layers (when the trunk is the base model); without
        # one, the trunk's children holding parameters (and dropouts) are layers, the rest is shared.
        plan = getattr(config, "base_model_pp_plan", None) or {}
        planned = [n for n in plan if n != self.layers_name] if self.path == [model.base_model_prefix] else []

        def placed(name: str, module: nn.Module) -> bool:
            if planned:
                return name in planned
            return any(True for _ in module.parameters()) or isinstance(module, nn.Dropout)

        self.prologue = [n for n, m in children[:at] if placed(n, m)]
        self.epilogue = [n for n, m in children[at + 1 :] if placed(n, m)]
        self.shared = [n for n, m in children if n != self.layers_name and n not in self.prologue + self.epilogue]
        # Embeddings among them, by their output size (known here: TP may replace the modules later).
        self.embeddings = {n: int(_embedding_dim(m)) for n, m in children if n in self.prologue and _embedding_dim(m)}
        unplaced = [n for n in self.shared if any(True for _ in getattr(trunk, n).parameters())]
        unplaced += [
            f"{'.'.join(self.path[: i + 1])}~{n}" for i, owner in enumerate(self._path_modules()[:-1])
            for n, m in owner.named_children() if n != self.path[i] and m is not head and any(True for _ in m.parameters())
        ]
        if unplaced or not self.prologue:
            raise PipelineDecompositionError(
                f"cannot place {unplaced or 'the token embedding'} of {type(model).__name__} in a pipeline layer"
                " (parameters outside the embeddings, decoder layers, final norm and head)."
            )

    def _path_modules(self) -> list[nn.Module]:
        out, m = [self.model], self.model
        for n in self.path:
            m = getattr(m, n)
            out.append(m)
        return out

    def prefix(self, name: str) -> str:
        return ".".join([*self.path, name])

    def layer_names(self) -> list[str]:
        n = len(getattr(self.trunk, self.layers_name))
        return (
            [self.prefix(p) for p in self.prologue] + [self.prefix(f"{self.layers_name}.{i}") for i in range(n)]
            + [self.prefix(e) for e in self.epilogue] + [self.head_name]
        )

    def layers(self) -> list[nn.Module]:
        return [self.model.get_submodule(n) for n in self.layer_names()]


def pipeline_structure(model: nn.Module) -> list[str]:
    """The pipeline layers `CausalLM` makes of a ``transformers`` causal LM: their module names, in order."""
    return _Structure(model).layer_names()


def _embedding_dim(module: nn.Module) -> int:
    """The output size of an embedding (``nn.Embedding`` or a module with ``embedding_dim``); 0 otherwise."""
    return int(getattr(module, "embedding_dim", 0) or 0)


class _Stop(Exception):
    pass


class _Standin(nn.Module):
    """In a shell of the trunk: a layer that only records what it is called with (the last one stops the
    forward), or a prologue / epilogue module without weights (an embedding gives zeros, others pass on)."""

    def __init__(self, kind: str, dim: int = 0, calls: Optional[list] = None, last: bool = False,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.kind, self.dim, self.calls, self.last, self.dtype = kind, dim, calls, last, dtype

    def forward(self, *args, **kwargs):
        if self.kind == "layer":
            assert self.calls is not None
            self.calls.append((args[1:], kwargs))
            if self.last:
                raise _Stop
            return args[0]
        first = args[0] if args else next(iter(kwargs.values()))
        if self.kind == "embedding":
            return torch.zeros(*first.shape, self.dim, device=first.device, dtype=self.dtype)
        return first


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def _shell(module: nn.Module, replace: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of ``module`` whose children ``replace`` names are others, without the module's hooks
    (those of TP verification, FSDP2 ...); nothing is copied or moved."""
    shell = copy.copy(module)
    shell._modules = dict(module._modules)
    shell._modules.update(replace)
    for name in _HOOK_DICTS:
        if name in shell.__dict__:
            setattr(shell, name, OrderedDict())
    return shell


def _trunk_kwargs(structure: _Structure, hidden: Tensor) -> list[tuple[tuple, dict]]:
    """The extra arguments (beyond the hidden states) the model's trunk passes each decoder layer, for an
    input of ``hidden``'s shape, dtype and device: the trunk's own forward run on stand-ins."""
    trunk = structure.trunk
    calls: list = []
    n = len(getattr(trunk, structure.layers_name))
    standins = nn.ModuleList([_Standin("layer", calls=calls, last=i == n - 1) for i in range(n)])
    replace: dict[str, nn.Module] = {structure.layers_name: standins}
    for name in structure.prologue + structure.epilogue:
        dim = structure.embeddings.get(name)
        replace[name] = _Standin("embedding", dim=dim, dtype=hidden.dtype) if dim else _Standin("pass")
    shell = _shell(trunk, replace)
    try:
        shell(inputs_embeds=torch.zeros_like(hidden), use_cache=False)
    except _Stop:
        pass
    if len(calls) != n:
        raise PipelineDecompositionError(
            f"the forward of {type(trunk).__name__} called {len(calls)} of its {n} decoder layers on stand-ins."
        )
    return calls


# ---------------------------------------------------------------------------------------------- hooks
class _PipelineCalls:
    """The hooks that let the model's modules be called as pipeline layers with one tensor."""

    #: Input shapes whose decoder-layer arguments are kept (the most recent ones: training and evaluation
    #: micro-batches; variable-length data would otherwise grow the cache without end).
    CACHED_SHAPES = 8

    def __init__(self, structure: _Structure) -> None:
        self.structure = structure
        # Under sequence parallelism a decoder layer receives 1/sequence_split of the sequence; its arguments
        # (rotary tables, masks) are those of the whole sequence, which its attention gathers.
        self.sequence_split = 1
        self._cache: "OrderedDict[tuple, list]" = OrderedDict()
        self._hooked: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self._handles: list = []  # of the hooks installed, to remove them from a model its layers cannot reproduce
        self._filled: set[int] = set()

    def kwargs_for(self, index: int, hidden: Tensor) -> tuple[tuple, dict]:
        shape = (hidden.size(0), hidden.size(1) * self.sequence_split, *hidden.shape[2:])
        key = (shape[:-1], hidden.dtype, hidden.device)
        if key not in self._cache:
            with torch.no_grad():
                self._cache[key] = _trunk_kwargs(self.structure, hidden.new_zeros(shape))
            while len(self._cache) > self.CACHED_SHAPES:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return self._cache[key][index]

    def install(self, layers: list[nn.Module]) -> None:
        s = self.structure
        n_pro = len(s.prologue)
        n_layers = len(getattr(s.trunk, s.layers_name))
        for i, layer in enumerate(layers):
            if layer in self._hooked:
                continue
            if n_pro <= i < n_pro + n_layers:
                self._hook_decoder_layer(layer, i - n_pro)
            elif 0 < i < n_pro and s.prologue[i] in s.embeddings:
                self._hook_position_embedding(layer)
            self._hooked.add(layer)

    def uninstall(self) -> None:
        """Remove every hook `install` put on the layers (the model's own forward is then exactly its own)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._hooked = weakref.WeakSet()

    def _hook_decoder_layer(self, layer: nn.Module, index: int) -> None:
        def pre(module, args, kwargs):
            if kwargs or len(args) != 1:
                return None  # the model's own forward: it passes the arguments itself
            rest, extra = self.kwargs_for(index, args[0])
            self._filled.add(id(module))
            return (args[0], *rest), dict(extra)

        def post(module, args, kwargs, output):
            if id(module) in self._filled:
                self._filled.discard(id(module))
                return output[0] if isinstance(output, tuple) else output
            return None

        self._handles += [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_hook(post, with_kwargs=True)]

    def _hook_position_embedding(self, layer: nn.Module) -> None:
        stash: list[Tensor] = []

        def pre(module, args):
            hidden = args[0]
            if not (isinstance(hidden, Tensor) and hidden.is_floating_point()):
                return None
            stash.append(hidden)
            return (torch.arange(hidden.size(1), device=hidden.device).unsqueeze(0),)

        def post(module, args, output):
            if stash:
                return stash.pop() + output
            return None

        self._handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]


# ---------------------------------------------------------------------------------------------- the check
def _standin_copy(module: nn.Module, generator: torch.Generator, head: bool = False) -> nn.Module:
    """A small materialised stand-in of a prologue / epilogue / head module with the same class, hooks and
    behaviour (in eval mode): embeddings and the head keep `_CHECK_VOCAB` rows, other modules their shapes
    (norms: the hidden size). The module itself is left as it is."""
    out = copy.copy(module)
    out.training = False
    out._parameters = dict(module._parameters)
    out._buffers = dict(module._buffers)
    out._modules = {n: _standin_copy(c, generator) for n, c in module._modules.items()}
    rows = None
    if _embedding_dim(module):
        rows = _CHECK_VOCAB
        out.padding_idx = None
        out.num_embeddings = rows
    elif head:
        rows = _CHECK_VOCAB
        if hasattr(out, "out_features"):
            out.out_features = rows
    for name, p in module._parameters.items():
        if p is None:
            continue
        shape = list(p.shape)
        if rows is not None and shape:
            shape[0] = min(shape[0], rows)
        t = torch.randn(shape, generator=generator, device=generator.device) * 0.5 + (1.0 if p.dim() == 1 and "weight" in name else 0.0)
        out._parameters[name] = nn.Parameter(t, requires_grad=False)
    for name, b in module._buffers.items():
        if b is not None and b.is_meta:
            out._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=generator.device)
    return out


def check_decomposition(model: nn.Module, structure: _Structure) -> None:
    """`PipelineDecompositionError` unless the prologue modules applied in order give what the model's trunk
    hands its first decoder layer, and the epilogue modules and head give the model's logits from what its
    last decoder layer returns -- both on small random stand-ins of those modules (same classes and hooks)."""
    try:
        with torch.device("cpu"):  # the stand-ins are on the CPU, whatever the ambient device (Lightning's init context)
            _check_decomposition(model, structure)
    except PipelineDecompositionError:
        raise
    except Exception as e:  # the model's code does not run on its layers as the pipeline calls them
        raise PipelineDecompositionError(
            f"{type(model).__name__} cannot be cut into pipeline layers exactly: applying its modules"
            f" {structure.layer_names()[:2]}...{structure.layer_names()[-2:]} in order fails ({type(e).__name__}: {e})."
        ) from e


def _check_decomposition(model: nn.Module, s: _Structure) -> None:
    generator = torch.Generator(device="cpu").manual_seed(0)
    trunk = s.trunk
    pro = {n: _standin_copy(getattr(trunk, n), generator) for n in s.prologue}
    epi = {n: _standin_copy(getattr(trunk, n), generator) for n in s.epilogue}
    head = _standin_copy(getattr(model, s.head_name), generator, head=True)
    ids = torch.randint(0, _CHECK_VOCAB, (2, _CHECK_TOKENS), generator=generator, device=generator.device)
    n = len(getattr(trunk, s.layers_name))
    with torch.no_grad():
        # Prologue: the model's own forward up to its first decoder layer ...
        seen: list = []

        class First(nn.Module):
            def forward(self, hidden, *args, **kwargs):
                seen.append(hidden)
                raise _Stop

        try:
            _shell(trunk, {s.layers_name: nn.ModuleList([First() for _ in range(n)]), **pro, **epi})(input_ids=ids, use_cache=False)
        except _Stop:
            pass
        # ... against the prologue modules in order (as the pipeline calls them, hooks included).
        x: Any = ids
        for name in s.prologue:
            x = pro[name](x)
        if len(seen) != 1 or not isinstance(x, Tensor) or x.shape != seen[0].shape or not torch.equal(seen[0], x):
            raise PipelineDecompositionError(
                f"{type(model).__name__}: its forward does more between {s.prologue} and its first decoder layer"
                " than those modules do (e.g. a scaling of the embeddings), so its pipeline layers would not"
                " reproduce it."
            )
        # Epilogue: whatever the last decoder layer returns, the model's logits from it ...
        last = torch.randn(*x.shape, generator=generator, device=generator.device)
        y: Any = last
        for name in s.epilogue:
            y = epi[name](y)
        got = head(y)
        want = None
        for as_tuple in (False, True):  # a decoder layer returns its hidden states, or a tuple of them first
            try:
                want = _logits_from_last_layer(model, s, pro, epi, head, ids, last, as_tuple)
                break
            except Exception:
                if as_tuple:
                    raise
        if want is None or want.shape != got.shape or not torch.equal(want, got):
            raise PipelineDecompositionError(
                f"{type(model).__name__}: its forward does more after its last decoder layer than {s.epilogue}"
                f" and {s.head_name} do (e.g. a scaling or soft cap of the logits), so its pipeline layers would"
                " not reproduce it."
            )


def _logits_from_last_layer(model, s: _Structure, pro, epi, head, ids: Tensor, last: Tensor, as_tuple: bool) -> Tensor:
    """The model's own logits when every decoder layer returns ``last``, on shells holding the stand-ins."""

    class Inject(nn.Module):
        def forward(self, hidden, *args, **kwargs):
            return (last,) if as_tuple else last

    n = len(getattr(s.trunk, s.layers_name))
    root = _shell(model, {s.head_name: head})
    owner = root
    for i, name in enumerate(s.path):  # shells along the path to the trunk
        if i == len(s.path) - 1:
            child = _shell(s.trunk, {s.layers_name: nn.ModuleList([Inject() for _ in range(n)]), **pro, **epi})
        else:
            child = _shell(owner._modules[name], {})
        owner._modules[name] = child
        owner = child
    return root(input_ids=ids, use_cache=False).logits


# ---------------------------------------------------------------------------------------------- loading
class _Safetensors:
    """The tensors of a local Hugging Face folder (``model.safetensors`` or an index): their shapes (from the
    headers), and each read on its own, whole or a slice along one dimension."""

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
            raise FileNotFoundError(f"{folder} holds no model.safetensors (nor its index): save it with save_pretrained.")
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in dict.fromkeys(self.files.values()):
            with safe_open(file, "pt") as f:
                self.shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})

    def read(self, key: str, dim: Optional[int] = None, start: int = 0, length: int = 0) -> Tensor:
        """The tensor ``key``, or with ``dim`` only its ``[start, start + length)`` along ``dim`` (only those bytes
        are read)."""
        from safetensors import safe_open

        if key not in self.files:
            raise KeyError(key)
        with safe_open(self.files[key], "pt") as f:
            if dim is None:
                return f.get_tensor(key)
            return f.get_slice(key)[(slice(None),) * dim + (slice(start, start + length),)]

    def check(self, model: nn.Module) -> None:
        """``KeyError`` / ``ValueError`` unless the folder holds every parameter of ``model`` (but tied copies) with
        the model's shape: raised on every rank at ``configure_model``, before any collective."""
        tied = set(_tied_keys(model))
        for name, p in model.named_parameters(remove_duplicate=False):
            if name not in self.shapes:
                if name in tied:
                    continue
                raise KeyError(f"{self.folder} holds no tensor {name!r} (a parameter of {type(model).__name__}).")
            if self.shapes[name] != tuple(p.shape):
                raise ValueError(f"{name}: the folder's tensor is {self.shapes[name]}, the model's {tuple(p.shape)}.")


# ---------------------------------------------------------------------------------------------- module
class CausalLM(L.LightningModule):
    """Next-token training of a ``transformers`` causal LM under any layout.

    Args:
        model: a local pretrained folder (``save_pretrained``'s output: config.json + safetensors), a model
            type of ``transformers`` (``"llama"``) with ``config`` overrides, or a ``PretrainedConfig``.
        config: fields of the config that override the folder's or the model type's defaults (random init
            when ``model`` is not a folder).
        lr, weight_decay, betas, warmup_steps: AdamW (decay on parameters with ``dim >= 2``), linear warmup.
        init_seed: seed of the random init (each pipeline layer its own, derived from it).
        attn_implementation: passed to ``transformers`` (``None``: its default for the model, SDPA where supported).

    Batches are ``(x, y)`` token tensors ``(B, T)``, ``y`` being ``x`` shifted by one (as the package's data
    modules give them). ``self(x)`` is the logits ``(B, T, V)``.
    """

    def __init__(
        self,
        model: Union[str, os.PathLike, Any],
        config: Optional[Mapping[str, Any]] = None,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        init_seed: int = 0,
        attn_implementation: Optional[str] = None,
    ) -> None:
        super().__init__()
        from transformers import PretrainedConfig

        spec = model.to_dict() if isinstance(model, PretrainedConfig) else (str(model) if isinstance(model, os.PathLike) else model)
        if isinstance(model, PretrainedConfig):
            spec = {"model_type": model.model_type, **spec}
        self.save_hyperparameters({
            "model": spec, "config": dict(config or {}), "lr": lr, "weight_decay": weight_decay,
            "betas": tuple(betas), "warmup_steps": warmup_steps, "init_seed": init_seed,
            "attn_implementation": attn_implementation,
        })
        self.hf_config = _resolve_config(spec, dict(config or {}))
        self.folder: Optional[Path] = Path(spec) if isinstance(spec, str) and Path(spec).is_dir() else None
        self.model: Optional[nn.Module] = None
        vocab = int(self.hf_config.vocab_size)
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=vocab, average="micro")
        self._structure: Optional[_Structure] = None
        self._calls: Optional[_PipelineCalls] = None
        self._weights: Optional[_Safetensors] = None
        self._n_params = 0

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        """Build the model on the meta device. Its layers are materialised here unless the strategy builds them
        per rank, calling `init_pipeline_layer` (or `load_pipeline_layer_slices`) itself: when its init context
        is the meta device (``pp > 1``), or under ``tp > 1`` (the model's device mesh), where each rank
        materialises only its TP slices of its layers -- for a model the pipeline layers reproduce (untied
        embeddings; see `check_decomposition`), the others are materialised whole here."""
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        per_layer = torch.get_default_device().type == "meta"  # the strategy's init context under pp > 1
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                self.hf_config, attn_implementation=self.hparams.attn_implementation, dtype=torch.float32
            )
        model.config.use_cache = False
        self.model = model
        self._n_params = sum(p.numel() for p in model.parameters())  # the whole model's (for MFU)
        self._structure = _Structure(model)
        self._calls = _PipelineCalls(self._structure)
        if self.folder is not None:
            self._weights = _Safetensors(self.folder)
            self._weights.check(model)
        with torch.device("cpu"):
            for name in self._structure.shared:  # rotary embeddings and the like: on every stage
                self._materialise(getattr(self._structure.trunk, name), torch.device("cpu"))
            for owner in self._structure._path_modules():  # buffers held by the model and its trunk themselves
                self._materialise_own_buffers(owner)
            if not (per_layer or (self._tp_size() > 1 and self._layerwise())):
                for index, layer in enumerate(self._structure.layers()):
                    layer.to_empty(device="cpu")
                    self.init_pipeline_layer(index, layer)
                if getattr(model.config, "tie_word_embeddings", False):
                    model.tie_weights()

    def _tp_size(self) -> int:
        mesh = self._device_mesh  # set by HybridStrategy before configure_model
        return mesh["tp"].size() if mesh is not None and "tp" in (mesh.mesh_dim_names or ()) else 1

    def _layerwise(self) -> bool:
        """Whether the strategy can materialise the model layer by layer: its pipeline layers reproduce it (the
        hooks `pipeline_layers` installs leave the model's own forward as it is)."""
        try:
            self.pipeline_layers()
        except PipelineDecompositionError:
            return False
        return True

    def _split_sequence_calls(self) -> None:
        """Once the strategy has set up sequence parallelism (after its setup-time checks, which run on whole
        sequences), decoder layers the pipeline calls with part of the sequence get the arguments of the whole
        (`_PipelineCalls.sequence_split`)."""
        strategy = self.trainer.strategy
        if self._calls is not None:
            self._calls.sequence_split = strategy.parallel_dims.tp if getattr(strategy, "sequence_parallel", False) else 1

    def on_fit_start(self) -> None:
        self._split_sequence_calls()

    def on_validation_start(self) -> None:
        self._split_sequence_calls()

    def on_test_start(self) -> None:
        self._split_sequence_calls()

    def on_predict_start(self) -> None:
        self._split_sequence_calls()

    def _materialise(self, module: nn.Module, device: torch.device) -> None:
        if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            module.to_empty(device=device)
            with torch.no_grad():
                for m in module.modules():
                    self.model._init_weights(m)

    @torch.no_grad()
    def _materialise_own_buffers(self, module: nn.Module) -> None:
        """The buffers ``module`` holds directly (GPT-BigCode's causal mask on its trunk), on the CPU, with the values
        the model's own init gives them (every stage has them, as the parameter-free shared modules)."""
        meta = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if meta:
            for name in meta:
                module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
            self.model._init_weights(module)

    def _names(self, index: int, layer: nn.Module) -> dict[str, str]:
        """``{folder name: name in the layer}`` of pipeline layer ``index``'s parameters and buffers."""
        assert self._structure is not None
        prefix = self._structure.layer_names()[index]
        return {f"{prefix}.{k}": k for k, _ in _tensors(layer)}

    # ------------------------------------------------------------------ pipeline protocol
    def pipeline_layers(self) -> list[nn.Module]:
        """The model's modules in order: embeddings, decoder layers, final norm, head (see the module doc).
        Raises `PipelineDecompositionError` where the model's forward does more than those layers do."""
        if self.model is None or self._structure is None or self._calls is None:
            raise RuntimeError("call configure_model() before pipeline_layers()")
        layers = self._structure.layers()
        if getattr(self.model.config, "tie_word_embeddings", False) and getattr(self.model, "_tied_weights_keys", None):
            raise PipelineDecompositionError(
                f"{type(self.model).__name__} ties its input and output embeddings (tie_word_embeddings=True), which"
                " pipeline stages cannot share: train it with pp=1, or untie them (config tie_word_embeddings=False)."
            )
        first = not self._calls._hooked
        self._calls.install(layers)
        if first:
            try:
                check_decomposition(self.model, self._structure)
            except PipelineDecompositionError:
                self._calls.uninstall()  # refused: the model keeps its own forward, untouched (pp=1 trains it whole)
                raise
        return layers

    def init_pipeline_layer(self, index: int, layer: nn.Module, pretrained: bool = True) -> None:
        """Materialised layer ``index``: the folder's tensors for it, or (no folder, or ``pretrained=False``) the
        model's init under its own seed."""
        assert self.model is not None
        if self._weights is not None and pretrained:
            self._load(index, layer)
            return
        # The model's init draws from the global generator of the tensors' device: it runs on a CPU twin of the
        # layer, so that the values are those of a CPU run on every device (a CUDA generator draws others).
        on_cpu = module_device(layer).type == "cpu"
        target = layer if on_cpu else _cpu_twin(layer)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(self.hparams.init_seed * 1_000_003 + index)
            for m in target.modules():
                self.model._init_weights(m)
            if not on_cpu:
                for (_, t), (_, value) in zip(_tensors(layer), _tensors(target)):
                    t.copy_(value)

    def load_pipeline_layer_slices(self, index: int, layer: nn.Module) -> bool:
        """Fill the materialised, TP-split layer ``index`` from the folder, reading only this rank's pieces of
        each split tensor (``safe_open().get_slice``; a fused tensor's parts are several pieces). ``False``
        without a folder (the strategy then initialises an unsplit copy of the layer and keeps its slices)."""
        if self._weights is None:
            return False
        self._load(index, layer)
        return True

    @torch.no_grad()
    def _load(self, index: int, layer: nn.Module) -> None:
        """Layer ``index``'s tensors from the folder: whole, or this rank's pieces of those TP split."""
        assert self.model is not None and self._weights is not None
        from lightning_hybrid.tensor_parallel.layers import tp_shard_specs

        specs = tp_shard_specs(layer)
        params = dict(layer.named_parameters(remove_duplicate=False))
        missing_buffers = []
        for full, local in self._names(index, layer).items():
            target = params[local] if local in params else layer.get_buffer(local)
            if full not in self._weights.files:
                if local not in params:  # a buffer the folder does not hold (rotary inv_freq ...)
                    missing_buffers.append(local.rpartition(".")[0])
                    continue
                if full in _tied_keys(self.model):  # the input embedding's, tied after loading (pp=1)
                    continue
                raise KeyError(f"{self.folder} holds no tensor {full!r} (pipeline layer {index}).")
            if local not in specs:
                value = self._weights.read(full)
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(f"{full}: the folder's tensor is {tuple(value.shape)}, the model's {tuple(target.shape)}.")
                target.copy_(value)
                continue
            spec, group = specs[local]
            for at, start, n in spec.chunks(torch.distributed.get_rank(group), torch.distributed.get_world_size(group)):
                target.narrow(spec.dim, at, n).copy_(self._weights.read(full, spec.dim, start, n))  # one piece at a time
        for owner in dict.fromkeys(missing_buffers):  # the model's init computes them
            self.model._init_weights(layer.get_submodule(owner))

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> "CausalLM":
        """Lightning's ``load_from_checkpoint``; a sharded checkpoint folder is consolidated in memory first."""
        from lightning_hybrid.checkpoint import lightning_checkpoint

        return super().load_from_checkpoint(lightning_checkpoint(checkpoint_path), *args, **kwargs)

    def forward(self, idx: Tensor) -> Tensor:
        if self.model is None:
            raise RuntimeError("call configure_model() before using the model")
        return self.model(input_ids=idx, use_cache=False).logits

    @staticmethod
    def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
        """Mean cross entropy (fp32); ``logits (B, T, V)``, ``targets (B, T)``."""
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    # ------------------------------------------------------------------ steps
    def on_train_batch_start(self, batch: Batch, batch_idx: int) -> None:
        # Read by Lightning's ThroughputMonitor (MFU): 6 N per token for the matmuls of forward and backward,
        # plus attention's 12 L H T (Kaplan et al. 2020; PaLM's appendix B), on the whole model.
        x, _ = batch
        config = self.hf_config
        layers = int(getattr(config, "num_hidden_layers", 0) or 0)
        hidden = int(getattr(config, "hidden_size", 0) or 0)
        self.flops_per_batch = (6 * self._n_params + 12 * layers * hidden * x.size(1)) * x.numel()

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = self.loss_fn(logits, y)
        self.val_acc.update(logits.argmax(-1).flatten(), y.flatten())
        self.log("val_loss", loss, prog_bar=True, sync_dist=True, on_epoch=True)
        self.log("val_acc", self.val_acc, on_epoch=True)
        return loss

    def test_step(self, batch: Batch, batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("test_loss", loss, sync_dist=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> Any:
        """AdamW (`lightning_hybrid.optim.adamw`: decay on matrices, fused on CUDA), linear warmup."""
        from lightning_hybrid.optim import adamw

        assert self.model is not None
        optimizer = adamw(self.model, self.hparams.lr, self.hparams.weight_decay, tuple(self.hparams.betas))
        warmup = int(self.hparams.warmup_steps)
        if warmup <= 0:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def _cpu_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are new, uninitialised CPU tensors (nothing of the
    original's values is copied)."""
    memo: dict[int, Any] = {}
    for _, t in _tensors(module):
        if id(t) not in memo:
            empty = torch.empty_like(t, device="cpu")
            memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(module, memo)


def _resolve_config(spec: Any, overrides: dict[str, Any]):
    """The config transformers makes from ``spec`` (a folder, a model type, or a config's dict with its
    ``model_type``) with ``overrides`` given to its own constructor, so that the fields it derives from others
    follow them (llama's ``head_dim`` from ``hidden_size`` and the head count). An override the config class does
    not know is an error naming it (a typo would otherwise be stored and ignored)."""
    import difflib

    from transformers import AutoConfig

    if isinstance(spec, Mapping):
        spec = dict(spec)
        model_type = spec.pop("model_type")
        make = lambda **kw: AutoConfig.for_model(model_type, **{**spec, **kw})  # noqa: E731
    elif isinstance(spec, str) and Path(spec).is_dir():
        folder = spec
        make = lambda **kw: AutoConfig.from_pretrained(folder, **kw)  # noqa: E731
    elif isinstance(spec, str):
        model_type = spec
        make = lambda **kw: AutoConfig.for_model(model_type, **kw)  # noqa: E731
    else:
        raise TypeError(f"model={spec!r}: give a local pretrained folder, a model type such as 'llama', or a PretrainedConfig.")
    try:
        default = make()
    except ValueError as err:
        raise ValueError(
            f"model={spec!r} is neither a local folder (save_pretrained's output) nor a model type of"
            f" transformers (such as 'llama', 'qwen2', 'gpt2')."
        ) from err
    config = make(**overrides) if overrides else default
    # The constructor consumes what it knows (legacy names too: gpt_neox's rotary_pct); what it does not know, it
    # stores as it is, an attribute the default config lacks.
    unknown = [key for key in overrides if key in vars(config) and not hasattr(default, key)]
    if unknown:
        known = sorted(default.to_dict())
        hints = {key: difflib.get_close_matches(key, known, n=3) for key in unknown}
        raise ValueError(
            f"config overrides {unknown} are not fields of {type(default).__name__}"
            + "".join(f"; {key!r}: did you mean {close}?" for key, close in hints.items() if close)
            + f". Its fields: {known}."
        )
    return config


# ---------------------------------------------------------------------------------------------- export
def export_pretrained(trainer: "L.Trainer", folder: Union[str, os.PathLike], max_shard_bytes: int = 2 * 2**30) -> Path:
    """Write the trained `CausalLM` of ``trainer`` to ``folder`` as ``save_pretrained`` does (``config.json`` and
    safetensors, names as ``transformers`` writes them; shards of at most ``max_shard_bytes`` with their index
    when the model is larger), from any layout. Every rank calls it. The weights go through a sharded
    checkpoint (each tensor unsplit once, by one rank); rank 0 then reads it back part by part, so it holds
    one shard at a time, never the whole model. The source folder's tokenizer files are copied along."""
    from safetensors.torch import save_file

    from lightning_hybrid.checkpoint import model_parts

    module = trainer.lightning_module
    if not isinstance(module, CausalLM) or module.model is None:
        raise TypeError("export_pretrained exports a trained lightning_hybrid.hf.CausalLM")
    folder = Path(folder)
    staging = folder / ".export-checkpoint"
    trainer.save_checkpoint(staging, weights_only=True)  # the weights only: no optimizer state
    if trainer.is_global_zero:
        tied = set(_tied_keys(module.model))
        shard: dict[str, Tensor] = {}
        written: list[tuple[Path, list[str]]] = []  # (file, its tensors)
        total = 0

        def flush() -> None:
            path = folder / f".shard-{len(written)}.safetensors"
            save_file(shard, str(path), metadata={"format": "pt"})
            written.append((path, list(shard)))
            shard.clear()

        parts = model_parts(staging) if staging.is_dir() else [torch.load(staging, map_location="cpu")["state_dict"]]
        held = 0
        for part in parts:
            for key, value in part.items():
                name = key[len("model."):]
                if not key.startswith("model.") or name in tied:
                    continue
                size = value.numel() * value.element_size()
                if shard and held + size > max_shard_bytes:
                    flush()
                    held = 0
                shard[name] = value.contiguous()
                held += size
                total += size
        flush()
        _name_shards(folder, written, total)
        module.model.config.save_pretrained(folder)
        if module.folder is not None:  # the tokenizer and generation settings of the folder it came from
            for f in module.folder.iterdir():
                if f.is_file() and not (f.name.endswith(".safetensors") or f.name in ("config.json", "model.safetensors.index.json")):
                    shutil.copy2(f, folder / f.name)
        shutil.rmtree(staging, ignore_errors=True) if staging.is_dir() else staging.unlink(missing_ok=True)
    trainer.strategy.barrier("export_pretrained")
    return folder


def _name_shards(folder: Path, written: list[tuple[Path, list[str]]], total: int) -> None:
    """``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``."""
    if len(written) == 1:
        written[0][0].rename(folder / "model.safetensors")
        return
    weight_map = {}
    for k, (path, keys) in enumerate(written, start=1):
        name = f"model-{k:05d}-of-{len(written):05d}.safetensors"
        path.rename(folder / name)
        weight_map.update(dict.fromkeys(keys, name))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _tied_keys(model: nn.Module) -> list[str]:
    if not getattr(model.config, "tie_word_embeddings", False):
        return []
    head = model.get_output_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    return [f"{names[id(head)]}.weight"] if head is not None and id(head) in names else []


class ExportPretrained(L.Callback):
    """At the end of training, `export_pretrained` the trained `CausalLM` to ``folder`` (the fine-tuning recipe's
    last step; every rank takes part)."""

    def __init__(self, folder: Union[str, os.PathLike]) -> None:
        self.folder = str(folder)

    def on_train_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        export_pretrained(trainer, self.folder)
        if trainer.is_global_zero:
            print(f"exported the trained model to {self.folder} (AutoModelForCausalLM.from_pretrained loads it)", flush=True)
