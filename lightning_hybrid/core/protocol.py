"""What a LightningModule implements to train under pipeline parallelism, and what ``self(x)`` and
``self.loss_fn`` mean once the strategy has cut it into stages.

`PipelineModule` is the protocol (`check_protocol` enforces it at setup); `LayerwiseInit` is the optional
part that lets each rank build only its own layers, `DeferredLayers` the explicit signal that a module left
them for the strategy to build, and `SliceLoading` the part that lets each rank read only its TP slices of them.
The binding that `HybridStrategy` gives these methods under ``pp > 1`` is part of the contract and is written down
in `PipelineModule`'s docstring.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ContextManager, Optional, Protocol, runtime_checkable

from torch import Tensor, nn

from lightning_hybrid.core.devices import is_meta

__all__ = [
    "PROTOCOL_HELP", "DeferredLayers", "LayerwiseInit", "PipelineAuxLoss", "PipelineLayers", "PipelineModule",
    "PipelineLayerContext", "RebuiltInCheckpoints", "SliceLoading",
    "builds_per_rank", "check_protocol", "checkpoint_excludes",
]

PROTOCOL_HELP = (
    "To train with pp > 1, the LightningModule must implement `pipeline_layers(self) -> list[nn.Module]` (its"
    " layers in order: forward(x) == layers[-1](...layers[0](x))) and `loss_fn(self, output, target) -> Tensor`"
    " (the mean loss of one micro-batch); training_step must compute its loss as `self.loss_fn(self(x), y)`,"
    " with one input tensor x (and optionally keyword tensors of x's batch size, e.g. position_ids, which reach"
    " every layer as layer(h, **kwargs)), call loss_fn once, and return that loss unchanged (or {'loss': loss,"
    " ...})."
    " Optionally `init_pipeline_layer(self, index, layer)` lets each rank build only its own layers."
)


@runtime_checkable
class PipelineLayers(Protocol):
    """The layer part of `PipelineModule` alone: a module that lists its layers in order
    (``forward(x) == layers[-1](...layers[0](x))``), with or without a ``loss_fn`` (what TP's examples and
    activation checkpointing need)."""

    def pipeline_layers(self) -> list[nn.Module]: ...


@runtime_checkable
class PipelineModule(PipelineLayers, Protocol):
    """A LightningModule that can be cut into pipeline stages.

    ``pipeline_layers()`` lists the layers in order: ``forward(x) == layers[-1](...layers[0](x))``, one tensor
    flowing between consecutive layers, every parameter inside exactly one layer. ``loss_fn(output, target)``
    is the mean loss of one micro-batch (``output`` is the last layer's).

    **Side inputs.** ``self(x, **side)`` may also take keyword tensors whose first dimension is the batch's
    (``position_ids`` of padded or packed data): they are split into micro-batches with ``x`` and every layer of
    every stage is called as ``layer(h, **side)`` with its micro-batch's part, so
    ``forward(x, **side) == layers[-1](...layers[0](x, **side)..., **side)``.

    **Token weighting** (optional): ``loss_items(target) -> Tensor``, the number of items ``loss_fn`` averages
    over (`lightning_hybrid.models.language_model.LanguageModel.loss_items`: the labels other than -100). With
    it, ``HybridStrategy`` makes the loss the mean over every item of the global batch -- all data-parallel
    ranks, micro-batches and batches of an accumulation window -- as one device gives it for that batch, not
    a mean of per-micro-batch or per-rank means; under every ``pp``, not only ``pp > 1``.

    **The binding under pp > 1.** After setup each rank holds only its stages, so `HybridStrategy` binds two
    methods of the module instance (and restores them when the run ends):

    * in ``training_step``, ``self(x)`` returns a deferred handle and ``self.loss_fn(handle, y)`` runs the whole
      schedule -- forward and backward of every micro-batch -- and returns the batch's loss (a detached float32
      scalar, the same on every pipeline rank: the mean over its items with ``loss_items``, else the mean of
      the micro-batch means). Supported: ``self.loss_fn(self(x), y)`` in one
      expression or through a variable, any batch structure, logging the loss, returning it or
      ``{"loss": loss, ...}``. Errors (``TypeError`` naming the rule): using the handle as a tensor
      (``self(x).argmax()``, ``F.cross_entropy(self(x), y)``), passing ``self(...)`` more than one positional
      input or a keyword input that is not a tensor of the batch's size,
      calling ``loss_fn`` twice or not at all, and returning anything but that loss (``2 * loss``,
      ``loss + aux``), whose extra gradient the schedule would silently lack;
    * everywhere else -- validation, test, predict, callbacks, the model summary's ``example_input_array`` --
      ``self(x)`` sends the batch through the stages in order without gradients and returns the last layer's
      output on every pipeline rank. It is a collective over the pipeline group: every rank calls it.
    """

    def loss_fn(self, output: Tensor, target: Tensor) -> Tensor: ...


@runtime_checkable
class PipelineAuxLoss(Protocol):
    """Optional: an auxiliary loss of the whole batch, computed from what modules inside the layers output (the
    load-balancing loss of a mixture-of-experts model, from its routers' logits), exact under ``pp > 1``.

    ``pipeline_aux_sources(layer)`` lists the modules inside pipeline layer ``layer`` whose outputs the loss reads,
    in order, each with the element of its output tuple it reads (``None``: the output itself, a tensor whose
    first dimension runs over the batch's rows: samples, or tokens in sample-major order). An empty list for
    every layer: no auxiliary loss. ``pipeline_aux_loss(outputs)`` is the term added to the loss of the whole
    batch: ``outputs`` holds, for every source of every layer in order, its output over the global batch (the
    rows of every data-parallel rank, in rank order; each rank's rows in its batch's order); it runs on every
    rank, may call collectives, and must be differentiable in ``outputs``.

    Under ``pp > 1`` (``schedule='gpipe'``, where every forward precedes the first backward; the other
    schedules are refused at setup) the strategy records the sources' outputs during the forwards, gathers them
    between the forward and the backward phase, and adds the term's exact gradient to each micro-batch's
    backward; ``self.loss_fn(self(x), y)`` then returns the loss plus the term. Under ``pp == 1`` the module
    adds its term itself, in ``training_step`` (`lightning_hybrid.hf.CausalLM` does both).
    """

    def pipeline_aux_sources(self, layer: nn.Module) -> list[tuple[nn.Module, Optional[int]]]: ...

    def pipeline_aux_loss(self, outputs: list[Tensor]) -> Tensor: ...


@runtime_checkable
class PipelineLayerContext(Protocol):
    """Optional: ``pipeline_layer_context(layer, hidden, side)`` returns a context manager that the strategy enters
    around each call of pipeline layer ``layer`` on one micro-batch under ``pp > 1`` (``hidden``: the layer's input,
    ``side``: the micro-batch's keyword tensors), outside the layer -- so outside what ``compile=True`` compiles of
    it. For what a module does around its layers in its own forward, eagerly (`lightning_hybrid.hf.CausalLM`: a
    decoder layer's other arguments computed, and its first packed forward run eagerly)."""

    def pipeline_layer_context(self, layer: nn.Module, hidden: Tensor,
                               side: Mapping[str, Tensor]) -> ContextManager[None]: ...


@runtime_checkable
class LayerwiseInit(Protocol):
    """Optional: with ``init_pipeline_layer``, the module is built on the meta device under ``pp > 1`` and each
    rank materialises and initialises only its own layers, with the values a one-device init gives. Under
    ``tp > 1`` the layers are split on the meta device first and each rank keeps its slices of an unsplit copy
    of one layer at a time (`lightning_hybrid.parallel.tensor_parallel.layerwise`)."""

    def init_pipeline_layer(self, index: int, layer: nn.Module) -> None: ...


@runtime_checkable
class SliceLoading(Protocol):
    """Optional, beside `LayerwiseInit`: ``load_pipeline_layer_slices(index, layer)`` fills a materialised,
    TP-split layer (split parameters hold this rank's pieces; their modules' ``shard_specs`` say which) from the
    module's stored weights, reading only those pieces, and returns ``True``; ``False`` when the module has no
    stored weights. Such a module's ``init_pipeline_layer`` also takes ``pretrained=False`` (initialise without
    the stored weights: the blocks TP verification materialises and throws away)."""

    def load_pipeline_layer_slices(self, index: int, layer: nn.Module) -> bool: ...


@runtime_checkable
class DeferredLayers(Protocol):
    """Optional, beside `LayerwiseInit`: the module says, after ``configure_model``, whether it left its pipeline
    layers unbuilt (on the meta device) for the strategy to build per rank with ``init_pipeline_layer``
    (``layers_deferred = True``) -- as `lightning_hybrid.hf.CausalLM` does under ``tp > 1`` on its own. A
    `LayerwiseInit` module without the attribute is built per rank when the strategy's init context built it on
    the meta device (``pp > 1``), the one case the strategy asks for it."""

    layers_deferred: bool


@runtime_checkable
class RebuiltInCheckpoints(Protocol):
    """Optional, for any module: ``checkpoint_excludes()`` names the state-dict entries its ``configure_model`` gives
    back exactly as they are (frozen weights read from a pretrained folder, or drawn from a fixed seed). Checkpoints
    leave them out -- `lightning_hybrid.hf.CausalLM` with ``lora`` and ``checkpoint_frozen=False``: the adapters and
    their optimizer state alone -- and resuming takes them from the module as built; a checkpoint that holds them
    loads too."""

    def checkpoint_excludes(self) -> frozenset[str]: ...


def checkpoint_excludes(module: nn.Module) -> frozenset[str]:
    """`RebuiltInCheckpoints`'s names of ``module`` (none for a module without the method)."""
    return frozenset(module.checkpoint_excludes()) if isinstance(module, RebuiltInCheckpoints) else frozenset()


def builds_per_rank(module: nn.Module) -> bool:
    """Whether the strategy builds ``module``'s pipeline layers per rank (`DeferredLayers`; without the signal,
    a `LayerwiseInit` module still on the meta device, where the strategy's init context put it). ``TypeError``
    for a module on the meta device that cannot initialise its layers."""
    if isinstance(module, DeferredLayers):
        deferred = bool(module.layers_deferred)
    else:
        deferred = is_meta(module)
    if deferred and not isinstance(module, LayerwiseInit):
        raise TypeError(f"{type(module).__name__} was built on the meta device but has no `init_pipeline_layer`."
                        f" {PROTOCOL_HELP}")
    return deferred


def check_protocol(module: nn.Module) -> None:
    """Raise ``TypeError`` naming what a module lacks for pipeline parallelism."""
    missing = [name for name in ("pipeline_layers", "loss_fn") if not callable(getattr(module, name, None))]
    if missing:
        raise TypeError(f"{type(module).__name__} does not implement {missing}. {PROTOCOL_HELP}")
