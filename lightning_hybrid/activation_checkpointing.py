"""Activation checkpointing per layer, full or selective.

Full: a checkpointed layer keeps only its input during forward and recomputes all its activations in backward
(``torch.utils.checkpoint``, non-reentrant, RNG state preserved, so dropout masks are the same in the
recomputation). Selective (Korthikanti et al. 2022), on torch's selective checkpointing
(`create_selective_checkpoint_contexts`): the named ops are recomputed, and with them what costs no FLOPs worth
keeping memory for -- element-wise ops, views, new buffers and what fills them in place (dropout masks, from
the same random state); the outputs of everything else (matmuls, norms) are kept. (Under tensor parallelism
the strategy refuses selective recompute: its recomputation of the TP layers' collectives did not reproduce
the gradients exactly.) ``"attention"`` names the attention core -- the scores ``Q K^T``, softmax, attention
dropout and the product with ``V``, or a fused scaled-dot-product kernel -- whose activations grow with the
square of the sequence (the ``5 a s / h`` term of Korthikanti's per-layer activation memory). An op that
would change a kept output in place is an error (torch's check), never a silently different recomputation.
"""

from __future__ import annotations

import fnmatch
from functools import partial
from typing import Sequence, Union

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

#: The attention core's ops (eager attention's batched matmuls, softmax and dropout; the fused SDPA kernels).
ATTENTION_OPS = (
    "aten.bmm", "aten.baddbmm", "aten._softmax", "aten.softmax", "aten.native_dropout", "aten.dropout",
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_fused_attention_overrideable",
)
_FACTORIES = ("aten.empty", "aten.zeros", "aten.ones", "aten.full", "aten.new_", "aten.scalar_tensor")

Recompute = Union[str, Sequence[str]]


def recompute_ops(recompute: Recompute) -> frozenset[str] | None:
    """The ops a selective checkpoint recomputes beyond the cheap ones (``aten.<name>``), or ``None`` for full
    recomputation.
    Raises ``ValueError`` for an unknown mode or op name."""
    if recompute == "full":
        return None
    if recompute == "attention":
        return frozenset(ATTENTION_OPS)
    if isinstance(recompute, str) or not recompute:
        raise ValueError(
            f"recompute={recompute!r} is invalid: use 'full' (the whole layer), 'attention' (the attention core only)"
            " or a list of aten op names to recompute (e.g. ['aten.gelu', 'aten._softmax'])."
        )
    names = frozenset(name if name.startswith("aten.") else f"aten.{name}" for name in recompute)
    unknown = sorted(n for n in names if not hasattr(torch.ops.aten, n[len("aten."):]))
    if unknown:
        raise ValueError(f"recompute names unknown aten ops {unknown}; names look like 'aten.gelu' or '_softmax'.")
    return names


def checkpoint_targets(module: nn.Module, target: bool | str, pipelined: bool = False) -> list[str]:
    """Names of the modules to checkpoint: ``True`` -> every layer (the pipeline layers when the module is
    ``pipelined``, else the elements of its ``nn.ModuleList``s); a glob pattern -> the modules whose names match."""
    names = {id(m): n for n, m in module.named_modules()}
    if isinstance(target, str):
        chosen = [n for n in names.values() if n and fnmatch.fnmatchcase(n, target)]
        if not chosen:
            raise ValueError(f"activation_checkpointing={target!r} matches no module; names look like {list(names.values())[1:8]}")
        return chosen
    if pipelined:
        return [names[id(layer)] for layer in module.pipeline_layers() if id(layer) in names]
    return [names[id(m)] for sub in module.modules() if isinstance(sub, nn.ModuleList) for m in sub]


#: Functional collectives that make a new tensor: sequence parallelism's all-gather and its wait.
def _policy(recomputed: frozenset[str], ctx, op, *args, **kwargs) -> CheckpointPolicy:
    name = str(op.overloadpacket)
    # In-place ops (collectives into their buffers included) run again on the recomputed buffers they fill.
    cheap = (
        torch.Tag.pointwise in op.tags or op.is_view or op._schema.is_mutable or name == "aten._unsafe_view"
        or name.startswith(_FACTORIES)
    )
    return CheckpointPolicy.PREFER_RECOMPUTE if cheap or name in recomputed else CheckpointPolicy.MUST_SAVE


def apply_activation_checkpointing(module: nn.Module, names: list[str], ops: frozenset[str] | None = None) -> None:
    """Checkpoint each named submodule (in place; parameter names and state dicts do not change): fully, or
    selectively, recomputing ``ops`` besides the cheap ones (see `recompute_ops`)."""
    context = partial(create_selective_checkpoint_contexts, partial(_policy, ops))
    options = {} if ops is None else {"context_fn": context}
    for name in names:
        layer = module.get_submodule(name)
        if getattr(layer, "_activation_checkpointed", False):
            continue
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False, **options)
        layer._activation_checkpointed = True
