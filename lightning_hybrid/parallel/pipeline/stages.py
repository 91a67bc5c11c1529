"""Cut a LightningModule into this rank's pipeline stages, in place, and bind its steps to the executor."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_hybrid.core.protocol import PROTOCOL_HELP, LayerwiseInit
from lightning_hybrid.parallel.pipeline.executor import PipelineExecutor
from lightning_hybrid.parallel.pipeline.partition import partition_layers, stage_ranks


class RemoteLayer(nn.Module):
    """Stands in the module tree for a layer that another pipeline rank holds (it has no parameters). Other
    dimensions recognise it by ``pipeline_standin``, not by its name."""

    pipeline_standin = True

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"pipeline layer {self.index} lives on another pipeline rank")

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # a hook reading the layer's weights: they are on the rank that holds it
            raise AttributeError(
                f"{name!r}: pipeline layer {self.index} lives on another pipeline rank, which holds its parameters"
                " and buffers; this rank has a stand-in. Code run on every rank (hooks, callbacks) reaches the"
                " layers this rank holds with self.pipeline_layers(), skipping stand-ins (`pipeline_standin`), and"
                " whole-model values with trainer.strategy (parameter_grad_norms(), full_state_dict())."
            ) from None


@dataclass
class StageLayout:
    """Which pipeline layers this rank holds, grouped by stage, and the PP rank of every stage."""

    ranges: list[range]  # stage -> layer indices
    owners: list[int]  # stage -> PP rank
    local_stages: list[int]
    remote_prefixes: list[str]  # module-tree names of the layers held elsewhere

    def local_layers(self) -> list[int]:
        return [i for s in self.local_stages for i in self.ranges[s]]


def plan_stages(
    module: nn.Module, pp: int, pp_rank: int, stages_per_rank: int, style: str, split_points: list[int] | None
) -> StageLayout:
    layers = module.pipeline_layers()
    sizes = [sum(p.numel() for p in layer.parameters()) or 1 for layer in layers]
    num_stages = pp * stages_per_rank
    ranges = partition_layers(sizes, num_stages, split_points)
    owners = stage_ranks(num_stages, pp, style)
    local = [s for s in range(num_stages) if owners[s] == pp_rank]
    local_layers = {i for s in local for i in ranges[s]}
    names = {id(m): n for n, m in module.named_modules()}
    remote = [names[id(layer)] for i, layer in enumerate(layers) if i not in local_layers]
    return StageLayout(ranges, owners, local, remote)


def keep_local_layers(module: nn.Module, layout: StageLayout, device: torch.device) -> None:
    """Replace the layers other ranks hold by `RemoteLayer`s, and materialise the local ones on ``device``.

    A model built on the meta device gets each local layer initialised by ``module.init_pipeline_layer``, which
    must give the values a one-device init gives; a materialised model is moved as it is.
    """
    drop_remote_layers(module, layout)
    layers = module.pipeline_layers()
    for index in layout.local_layers():
        layer = layers[index]
        if any(t.is_meta for t in [*layer.parameters(), *layer.buffers()]):
            if not isinstance(module, LayerwiseInit):
                raise TypeError(f"Layer {index} was built on the meta device but the module has no"
                                f" `init_pipeline_layer`. {PROTOCOL_HELP}")
            layer.to_empty(device=device)
            module.init_pipeline_layer(index, layer)
        else:
            layer.to(device)
    check_materialised(module)


def drop_remote_layers(module: nn.Module, layout: StageLayout) -> None:
    """Replace the layers other pipeline ranks hold by `RemoteLayer`s (the local ones are left as they are)."""
    layers = module.pipeline_layers()
    for name in layout.remote_prefixes:
        index = next(i for i, layer in enumerate(layers) if layer is module.get_submodule(name))
        parent_name, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, leaf, RemoteLayer(index))


def check_materialised(module: nn.Module) -> None:
    """``TypeError`` naming parameters still on the meta device once the local layers are materialised."""
    leftover = [n for n, p in module.named_parameters() if p.is_meta]
    if leftover:
        raise TypeError(
            f"Parameters {leftover[:5]} are outside the layers listed by `pipeline_layers()`, so no pipeline stage"
            " owns them. Every parameter must belong to exactly one pipeline layer."
        )


class _DeferredOutput:
    """What ``self(x)`` returns in a pipelined training step: only ``self.loss_fn(self(x), y)`` may use it."""

    def __init__(self, inputs: Tensor, side: dict[str, Tensor]) -> None:
        self.inputs = inputs
        self.side = side

    def __getattr__(self, name):
        raise TypeError(f"Under pp > 1 the model output of a training step is not a tensor. {PROTOCOL_HELP}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # e.g. F.cross_entropy(self(x), y)
        raise TypeError(
            f"Under pp > 1 the model output of a training step is not a tensor ({func.__name__} received it)."
            f" {PROTOCOL_HELP}"
        )


class TrainingStepBinding:
    """``forward`` and ``loss_fn`` of the module during one pipelined training step (see `PipelineModule`).

    ``loss_fn`` runs the executor's whole schedule once and keeps the loss it returns, so that `check_output`
    can verify that the training step returned exactly that loss.
    """

    def __init__(self, executor: PipelineExecutor) -> None:
        self.executor = executor
        self.loss: Tensor | None = None

    def forward(self, inputs: Tensor, *args, **kwargs) -> _DeferredOutput:
        return _DeferredOutput(inputs, _side_inputs(args, kwargs))

    def loss_fn(self, output: _DeferredOutput, target: Tensor) -> Tensor:
        if not isinstance(output, _DeferredOutput):
            raise TypeError(f"loss_fn received {type(output).__name__}, not the output of self(x). {PROTOCOL_HELP}")
        if self.loss is not None:
            raise TypeError(f"loss_fn was called twice in one training step: each call runs the whole schedule."
                            f" {PROTOCOL_HELP}")
        self.loss = self.executor.train_step(output.inputs, target, **output.side)
        return self.loss

    def check_output(self, output: object) -> None:
        """``TypeError`` unless the training step returned the loss of ``loss_fn`` unchanged (as it is or under
        ``"loss"`` of a dict). ``None`` (Lightning's "skip this batch") passes."""
        if output is None:
            return
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if self.loss is None:
            raise TypeError(f"training_step did not call self.loss_fn(self(x), y), so no schedule ran. {PROTOCOL_HELP}")
        if loss is not self.loss:
            raise TypeError(
                "training_step returned another loss than self.loss_fn(self(x), y): under pp > 1 the schedule has"
                " already run the backward of that loss, so whatever was added to it or multiplied with it would"
                f" not reach the gradients. Put the whole loss into loss_fn. {PROTOCOL_HELP}"
            )


@contextmanager
def bind_training(module: nn.Module, executor: PipelineExecutor) -> Iterator[TrainingStepBinding]:
    """During a training step, ``self(x)`` defers and ``self.loss_fn(output, y)`` runs the whole schedule."""
    binding = TrainingStepBinding(executor)
    with instance_attributes(module, forward=binding.forward, loss_fn=binding.loss_fn):
        yield binding


@contextmanager
def bind_evaluation(module: nn.Module, executor: PipelineExecutor) -> Iterator[None]:
    """Outside training steps, ``self(x)`` is the pipeline's output (forward only) on every pipeline rank: a
    `PipelineOutput` whose data stays on the last stage (validation, test, callbacks), or, while predicting
    (Lightning keeps the predictions), the whole output broadcast to every pipeline rank."""

    def forward(inputs: Tensor, *args, **kwargs) -> Tensor:
        output = executor.eval_forward(inputs, **_side_inputs(args, kwargs))
        trainer = getattr(module, "_trainer", None)
        return output.materialize() if trainer is not None and trainer.predicting else output

    with instance_attributes(module, forward=forward):
        yield


def _side_inputs(args: tuple, kwargs: dict) -> dict[str, Tensor]:
    """The keyword tensors of ``self(x, **side)`` (``None`` values left out); ``TypeError`` for more than one
    positional input."""
    if args:
        raise TypeError(
            f"Under pp > 1, self(...) takes one positional input tensor (one tensor flows between stages) and"
            f" keyword tensors for every stage; it got {1 + len(args)} positional argument(s). {PROTOCOL_HELP}"
        )
    return {name: value for name, value in kwargs.items() if value is not None}


@contextmanager
def instance_attributes(module: nn.Module, **attributes: Callable[..., Any]) -> Iterator[None]:
    """Within the block, ``module``'s methods named in ``attributes`` are the functions given (set on the instance,
    as Lightning's own strategies redirect ``forward`` for a step: ``_ForwardRedirection``); afterwards what they
    were. The one place a step redirects what the user's ``training_step`` calls (``self(x)``, ``self.loss_fn``),
    used by `lightning_hybrid.steps` and this module's bindings; the module's class is never touched."""
    saved = {name: vars(module)[name] for name in attributes if name in vars(module)}
    for name, value in attributes.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name in attributes:
            if name in saved:
                setattr(module, name, saved[name])
            else:
                delattr(module, name)
