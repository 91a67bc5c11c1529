"""TP on a model built on the meta device: split first, then materialise each layer holding only its slices.

A LightningModule that initialises single pipeline layers (``init_pipeline_layer``) and was built on the meta
device is split over TP while still on meta (the TP layers split meta tensors as they split real ones), so a
rank never holds a layer unsplit beyond the one it is filling. In order:

1. each kind of block is verified on a materialised copy (`Representatives`: a copy of its pipeline layer,
   initialised with ``init_pipeline_layer``; the module's stored weights are not read for it where it can avoid
   them), called with its pipeline layer's input or what that layer hands it;
2. `apply_tp` splits the meta model;
3. `materialise_split_layers` fills each local layer: from the module's stored weights, slice by slice, when it
   implements ``load_pipeline_layer_slices`` (a pretrained folder), else from an unsplit copy of that one layer
   initialised as on one device (``init_pipeline_layer``), of which it keeps its pieces.

Peak per rank while loading: its own TP slices plus the tensor a slice is read from (safetensors maps it; only the
slice's pages are read) or one unsplit layer (random init).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_hybrid.core.devices import is_meta
from lightning_hybrid.core.protocol import SliceLoading
from lightning_hybrid.parallel.tensor_parallel.examples import synthetic_call
from lightning_hybrid.parallel.tensor_parallel.layers import local_piece, tp_shard_specs
from lightning_hybrid.parallel.tensor_parallel.verify import Captured, capture_inputs


def init_unsplit_layer(module: nn.Module, index: int, layer: nn.Module, stored: bool = True) -> None:
    """``module.init_pipeline_layer(index, layer)`` on a materialised unsplit layer. ``stored=False``: without the
    module's stored weights (the module takes ``pretrained=False`` when it implements ``load_pipeline_layer_slices``),
    for a layer whose values only need to be plausible (a block verified and thrown away)."""
    if not stored and isinstance(module, SliceLoading):
        module.init_pipeline_layer(index, layer, pretrained=False)
    else:
        module.init_pipeline_layer(index, layer)


class Representatives:
    """The blocks TP verification runs in place of a model's blocks on the meta device.

    Called as ``(block name, block) ->`` a materialised copy of that block: a copy of its pipeline layer
    (initialised without the stored weights), or the block itself where it is not on the meta device.
    `example_call` then gives the block's input: the pipeline layer's own input (``first_input`` for layer 0,
    random hidden states for the others, as `synthetic_call` makes them) and, for a block inside a pipeline
    layer, what that layer copy hands the block when it runs on it (a pipeline layer takes one tensor; the
    blocks inside it may take more)."""

    def __init__(self, module: nn.Module, layers: Sequence[nn.Module], layer_names: Sequence[str], device: torch.device,
                 first_input: Tensor | None, multiple: int = 1) -> None:
        self.module, self.layers, self.layer_names, self.device, self.first_input = (
            module, layers, layer_names, device, first_input
        )
        self.multiple = multiple  # synthetic sequences are a multiple of this long (sequence parallelism)
        self._layer_of: dict[int, tuple[int, nn.Module]] = {}  # id(materialised block) -> (layer index, layer copy)

    def __call__(self, name: str, block: nn.Module) -> nn.Module:
        self._layer_of = {}  # the previous kind's copy goes before this one is made
        if not is_meta(block):
            return block
        index = next((i for i, n in enumerate(self.layer_names) if name == n or name.startswith(n + ".")), None)
        if index is None:
            raise TypeError(f"{name} is on the meta device outside every pipeline layer: nothing can initialise it.")
        whole = copy.deepcopy(self.layers[index]).to_empty(device=self.device)
        init_unsplit_layer(self.module, index, whole, stored=False)
        rel = name[len(self.layer_names[index]) + 1:]
        made = whole.get_submodule(rel) if rel else whole
        self._layer_of = {id(made): (index, whole)}
        return made

    def example_call(self, name: str, block: nn.Module) -> Captured | None:
        index, whole = self._layer_of.get(id(block), (None, None))
        if whole is None:
            return synthetic_call(block, self.multiple)
        if index == 0 and self.first_input is not None:
            layer_input = Captured.of((self.first_input,), {})
        else:
            layer_input = synthetic_call(whole, self.multiple)
        if layer_input is None:
            return None
        # The block's call as the layer makes it, also where the block is the layer: what the layer's own
        # pre-hooks add (a decoder layer's rotary tables and mask) is part of the call.
        args, kwargs = layer_input.materialize(self.device)
        modes = {m: m.training for m in whole.modules()}
        whole.eval()
        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                captured = capture_inputs({name: block}, lambda: whole(*args, **kwargs))
        except Exception:  # the layer does not run on that input: the block's own synthetic input, if any
            captured = {}
        finally:
            for m, mode in modes.items():
                m.training = mode
        return captured.get(name) or (layer_input if whole is block else synthetic_call(block, self.multiple))


@torch.no_grad()
def copy_local_pieces(split: nn.Module, whole: nn.Module) -> None:
    """Fill the materialised TP-split ``split`` with this rank's pieces of the unsplit ``whole`` (same names)."""
    specs = tp_shard_specs(split)
    source = dict(whole.named_parameters()) | dict(whole.named_buffers())
    for name, target in [*split.named_parameters(), *split.named_buffers()]:
        target.copy_(local_piece(name, source[name], target, specs))


def materialise_split_layers(
    module: nn.Module, indices: Sequence[int], unsplit: dict[int, nn.Module], device: torch.device
) -> None:
    """Materialise the pipeline layers ``indices`` of ``module`` (TP-split on the meta device) on ``device`` with
    the values a one-device init (or load) gives, one layer at a time. ``unsplit``: meta copies of those layers
    made before the split (each is materialised, used and dropped in turn)."""
    layers = module.pipeline_layers()
    loads_slices = isinstance(module, SliceLoading)
    for index in indices:
        layer = layers[index]
        whole = unsplit.pop(index, None)
        if not is_meta(layer):
            layer.to(device)
            continue
        layer.to_empty(device=device)
        if not tp_shard_specs(layer):
            init_unsplit_layer(module, index, layer)
        elif not (loads_slices and module.load_pipeline_layer_slices(index, layer)):
            assert whole is not None, index
            whole.to_empty(device=device)
            init_unsplit_layer(module, index, whole)
            copy_local_pieces(layer, whole)
        del whole
