"""Tensor-parallel layers that hold plain local shards (Megatron / picotron style).

Each layer is built from the unsplit module it replaces and copies this rank's slice of its weights, so a TP
model starts from exactly the one-device initialisation. ``shard_specs`` names, for each split parameter, its
`ShardSpec`: all that `gather_full_state_dict` (below) and checkpoints need to re-assemble unsplit tensors.

Linear-like modules are ``nn.Linear`` (weight ``[out, in]``) and ``transformers``' ``Conv1D`` (GPT-2; weight
``[in, out]``, ``y = x W + b``): the TP layers keep the original weight layout, so parameter names and unsplit
shapes are those of the original model. Embeddings are split in place (`shard_embedding`), keeping their class,
so a subclass's own forward (Gemma's scaled embedding) still runs on the local rows.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.distributed_c10d import _resolve_process_group

from lightning_hybrid.core.autocast import autocast_inputs
from lightning_hybrid.core.collectives import (
    SEQ_DIM,
    ShardSpec,
    all_reduce,
    copy_to_tp,
    functional_collectives,
    functional_collectives_active,
    gather_from_tp,
    gather_shard,
    reduce_from_tp,
    reduce_scatter_sequence,
    scatter_to_tp,
    seq_all_gather,
    seq_reduce_scatter,
    split_shard,
    start_all_reduce,
)
from lightning_hybrid.core.devices import local_tensor
from lightning_hybrid.core.linears import linear_shape, lora_base
from lightning_hybrid.core.split_logits import SplitLogits
from lightning_hybrid.parallel.tensor_parallel.unit_backward import deferred_column, linear_weight_grad, sequence_row


def _shard(t: Tensor, spec: ShardSpec, group: dist.ProcessGroup) -> nn.Parameter:
    local = split_shard(t.detach(), spec, dist.get_rank(group), dist.get_world_size(group))
    return nn.Parameter(local.clone(), requires_grad=t.requires_grad)


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split by output features: local output ``[..., out_local]``.

    Input ``[..., in]`` (replicated over TP); output this rank's features (``[q_r; k_r; v_r]`` for a fused
    projection of ``parts``) or, with ``gather_output``, the full ``[..., out]`` (all-gather over the TP group;
    with ``split_logits`` a `SplitLogits`: the shard, gathered only where code needs the whole, so that an LM
    head's logits stay split for the vocab-parallel cross entropy). With ``sequence_parallel`` the input was
    all-gathered along the sequence by its unit, whose backward reduce-scatters the input gradient: no
    all-reduce here.
    """

    sequence_parallel = False
    float8 = None  # a `lightning_hybrid.parallel.float8.Float8Matmul`: the GEMMs in float8 (``fp8``)
    float8_split = "out"  # which features TP splits: what `lightning_hybrid.parallel.float8` reads
    #: The input gradient's reduction runs under weight-gradient GEMMs: fed its unit's input, the unit's one
    #: reduction (an all-reduce; with sequence parallelism a reduce-scatter) under all the unit's column layers'
    #: (`lightning_hybrid.parallel.tensor_parallel.unit_backward`); fed anything else without sequence parallelism,
    #: the layer's all-reduce under its own (`_ColumnLinear`). ``False``: after the backward of each layer (without
    #: SP) or of the unit's every consumer (with it) -- `benchmarks/bench_overlap.py --cpu` compares the two.
    overlap_backward = True
    #: Set by the unit's entry for the length of its forward: a
    #: `lightning_hybrid.parallel.tensor_parallel.unit_backward.UnitGrads` that takes this layer's weight gradients
    #: (and, without sequence parallelism, reduces its input gradient with the unit's other column layers').
    unit_grads = None

    def __init__(
        self,
        linear: nn.Module,
        group: dist.ProcessGroup,
        gather_output: bool,
        part_sizes: tuple[int, ...],
        split_logits: bool = False,
    ):
        super().__init__()
        shape = linear_shape(linear)
        assert shape is not None, type(linear)
        self.group = group
        self.in_features, self.out_features, self.transposed = shape
        self.gather_output = gather_output
        self.split_logits = split_logits and gather_output
        self.part_sizes = tuple(part_sizes) or (shape.out_features,)
        self.output_spec = ShardSpec(-1, self.part_sizes)
        self.shard_specs = {"weight": ShardSpec(1 if self.transposed else 0, self.part_sizes)}
        self.weight = _shard(linear.weight, self.shard_specs["weight"], group)
        if linear.bias is not None:
            self.shard_specs["bias"] = ShardSpec(0, self.part_sizes)
            self.bias = _shard(linear.bias, self.shard_specs["bias"], group)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.t() if self.transposed else self.weight
        if self.unit_grads is not None and self.unit_grads.feeds(x) and torch.is_grad_enabled():
            y = deferred_column(self, x, self.unit_grads)  # its weight's gradient (and reduction) the unit's
        elif self.float8 is None and not self.sequence_parallel and self.overlap_backward and (
                torch.is_grad_enabled() and not functional_collectives_active()):
            # Eager, without sequence parallelism: one op whose backward all-reduces the input's gradient while it
            # computes the weight's (under compile and a selective checkpoint the op-by-op form below).
            weight, *bias = autocast_inputs(weight, *([] if self.bias is None else [self.bias]))
            y = _ColumnLinear.apply(x, weight, bias[0] if bias else None, self.group)
        else:
            x = x if self.sequence_parallel else copy_to_tp(x, self.group)
            if self.float8 is not None:
                y = self.float8(x, self.weight if self.transposed else self.weight.t())
                y = y if self.bias is None else y + self.bias.to(y.dtype)
            else:
                y = F.linear(x, weight, self.bias)
        if self.split_logits:
            return SplitLogits.wrap(y, self.group, self.output_spec)
        if self.gather_output:
            y = gather_from_tp(y, self.group, self.output_spec)
        return y

    def extra_repr(self) -> str:
        local = self.weight.size(1 if self.transposed else 0)
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (local {local}),"
            f" parts={list(self.part_sizes)},"
            f" gather_output={'on demand' if self.split_logits else self.gather_output}"
            f"{', Conv1D layout' if self.transposed else ''}"
        )


def deferrable_columns(unit: nn.Module, sequence_parallel: bool) -> list[ColumnParallelLinear]:
    """The column layers of ``unit`` whose weight gradients its entry can take over
    (`lightning_hybrid.parallel.tensor_parallel.unit_backward`): with ``overlap_backward``, trained, not float8."""
    return [c for c in unit.modules() if isinstance(c, ColumnParallelLinear) and c.overlap_backward
            and c.sequence_parallel == sequence_parallel and c.float8 is None and c.weight.requires_grad]


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split by input features; bias ``[out]`` replicated.

    Input ``[..., in/tp]`` (``input_is_parallel``) or ``[..., in]`` (this rank's slice is taken); the partial
    products are all-reduced (sum) over the TP group before the bias is added; output ``[..., out]``. With
    ``sequence_parallel`` they are reduce-scattered along the sequence instead: output ``[B, T/tp, out]``.
    """

    sequence_parallel = False
    float8 = None  # as `ColumnParallelLinear.float8`
    float8_split = "in"
    #: Under sequence parallelism, eager: the backward's all-gather of the output gradient runs under this rank's part
    #: of the input gradient (`lightning_hybrid.parallel.tensor_parallel.unit_backward.sequence_row`); ``False``:
    #: before the layer's backward, as `benchmarks/bench_overlap.py --cpu` compares.
    overlap_backward = True

    def __init__(self, linear: nn.Module, group: dist.ProcessGroup, input_is_parallel: bool):
        super().__init__()
        shape = linear_shape(linear)
        assert shape is not None, type(linear)
        self.group = group
        self.in_features, self.out_features, self.transposed = shape
        self.input_is_parallel = input_is_parallel
        self.shard_specs = {"weight": ShardSpec(0 if self.transposed else 1, (self.in_features,))}
        self.weight = _shard(linear.weight, self.shard_specs["weight"], group)
        self.bias = None if linear.bias is None else nn.Parameter(
            linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad
        )

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        weight = self.weight.t() if self.transposed else self.weight
        if self.float8 is not None:  # op by op (the reductions are functional where they must be)
            partial = self.float8(x, weight.t())
        elif functional_collectives_active():
            # Selective checkpoint or compile: one op whose output alone is kept (same collectives; its own backward).
            # Autocast casts none of a custom op's inputs: cast them as it casts F.linear's (the bias stays, added
            # after the reduction, as below).
            x, weight = autocast_inputs(x, weight)
            return row_parallel_linear(x, weight, self.bias, self.group, self.sequence_parallel)
        elif self.sequence_parallel and self.overlap_backward and torch.is_grad_enabled():
            y = sequence_row(*autocast_inputs(x, weight), self.group)
            return y if self.bias is None else y + self.bias
        else:
            partial = F.linear(x, weight)
        reduce = reduce_scatter_sequence if self.sequence_parallel else reduce_from_tp
        y = reduce(partial, self.group)
        if self.bias is None:
            return y
        return y + (self.bias.to(y.dtype) if self.float8 is not None else self.bias)

    def extra_repr(self) -> str:
        local = self.weight.size(0 if self.transposed else 1)
        return (
            f"in_features={self.in_features} (local {local}), out_features={self.out_features},"
            f" input_is_parallel={self.input_is_parallel}{', Conv1D layout' if self.transposed else ''}"
        )


# ------------------------------------------------- a column layer's backward: its all-reduce under the weight's GEMM
class _ColumnLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` of a column layer whose input is replicated over TP (no sequence parallelism).
    Backward: the input's gradient first, its all-reduce over ``group`` started, then the weight's and the bias's
    gradients computed while it runs (Megatron's asynchronous all-reduce; the op-by-op form -- `copy_to_tp`, then
    ``F.linear`` -- reduces after the layer's whole backward). Each gradient is computed by the same products, in the
    same operand layouts, as ``F.linear``'s own backward (torch's ``mm_mat1_backward`` / ``mm_mat2_backward``), and
    under autocast the input's gradient is reduced in the input's dtype, as autocast's cast hands it to `copy_to_tp`:
    bit for bit the op-by-op form's. ``weight`` and ``bias`` come cast as autocast casts them, ``x`` as it is."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], group: dist.ProcessGroup) -> Tensor:
        ctx.x_dtype = x.dtype
        x = autocast_inputs(x)[0]
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad2d = grad.reshape(-1, grad.size(-1))
        grad_x = finish = None
        if ctx.needs_input_grad[0]:
            grad_x = grad2d.mm(weight).view(x.shape).to(ctx.x_dtype)
            finish = start_all_reduce(grad_x, ctx.group)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = linear_weight_grad(grad2d, x.reshape(-1, x.size(-1)), weight)
        grad_bias = grad2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if finish is not None:
            grad_x = finish()
        return grad_x, grad_weight, grad_bias, None


# ------------------------------------------------------------ a row layer as one op (selective checkpoint, compile)
# A custom op because a selective checkpoint must see the row layer as one op, to keep its output alone.
@torch.library.custom_op("lightning_hybrid::row_parallel_linear", mutates_args=())
def _row_parallel_linear(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], group_name: str, sequence_parallel: bool
) -> Tensor:
    partial, group = F.linear(x, weight), _resolve_process_group(group_name)
    # Functional inside (its outputs are its own), as in the backward, which AOTAutograd traces under compile.
    with functional_collectives():
        out = seq_reduce_scatter(partial, group) if sequence_parallel else all_reduce(partial.contiguous(), group)
    return out if bias is None else out + bias


@_row_parallel_linear.register_fake
def _(x, weight, bias, group_name, sequence_parallel):
    shape = [*x.shape[:-1], weight.size(0)]
    if sequence_parallel:
        shape[SEQ_DIM] //= dist.get_world_size(_resolve_process_group(group_name))
    return x.new_empty(shape)


def _row_setup_context(ctx, inputs, output) -> None:
    x, weight, bias, group_name, sequence_parallel = inputs
    ctx.save_for_backward(x, weight)
    ctx.group_name, ctx.sequence_parallel = group_name, sequence_parallel
    ctx.has_bias = bias is not None


def _row_backward(ctx, grad: Tensor):
    x, weight = ctx.saved_tensors
    grad_bias = grad.sum(dim=tuple(range(grad.dim() - 1))) if ctx.has_bias else None
    # Under autocast the product is in its dtype and an fp32 bias makes the output fp32: the product's gradient in the
    # product's dtype, as the op-by-op form's addition hands it back.
    grad = grad.to(x.dtype)
    if ctx.sequence_parallel:  # the reduce-scatter's backward: all-gather the sequence
        with functional_collectives():
            grad = seq_all_gather(grad, _resolve_process_group(ctx.group_name))
    grad_x = grad.matmul(weight)
    grad_weight = grad.reshape(-1, grad.size(-1)).t().mm(x.reshape(-1, x.size(-1)))
    return grad_x, grad_weight, grad_bias, None, None


_row_parallel_linear.register_autograd(_row_backward, setup_context=_row_setup_context)


def row_parallel_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], group: dist.ProcessGroup,
                        sequence_parallel: bool) -> Tensor:
    """A row layer's ``reduce(x W^T) + b`` (all-reduce, or reduce-scatter along the sequence) as one op, for a
    selective checkpoint: it keeps the op's output only, where the partial product and the reduced sum of the
    op-by-op form would each be a kept, full-size tensor. Backward: ``x`` and ``W``'s gradients from the
    output's (all-gathered along the sequence first under SP)."""
    return _row_parallel_linear(x, weight, bias, group.group_name, sequence_parallel)


# ------------------------------------------------------------------------------------------------------ embeddings
def shard_embedding(embedding: nn.Embedding, group: dist.ProcessGroup) -> nn.Embedding:
    """Split ``embedding``'s rows (the vocabulary) over ``group``, in place: weight ``[vocab/tp, dim]``.

    Input ids ``[...]`` (replicated over TP): each rank runs the module's own forward on the ids of its
    vocabulary range (the others looked up at local row 0), zeros the rows of ids outside it, and the partial
    embeddings are all-reduced (sum) over the group: output ``[..., dim]``. Exact for any forward that maps
    each id's row on its own (a lookup, then scaling or per-row normalisation). The module keeps its class,
    parameter names and buffers.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    vocab = embedding.num_embeddings
    local = vocab // world
    start, end = rank * local, (rank + 1) * local
    embedding.shard_specs = {"weight": ShardSpec(0, (vocab,))}
    embedding.group = group
    embedding.vocab_range = (start, end)
    embedding.weight = _shard(embedding.weight, embedding.shard_specs["weight"], group)
    embedding.num_embeddings = local
    pad = embedding.padding_idx
    embedding.padding_idx = pad - start if pad is not None and start <= pad < end else None
    outside: list[Tensor] = []  # set by the pre-hook, used by the hook of the same call

    def to_local_ids(module: nn.Module, args: tuple) -> tuple:
        ids, *rest = args
        mask = (ids < start) | (ids >= end)
        outside.append(mask)
        return ((ids - start).masked_fill(mask, 0), *rest)

    def reduce(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        return reduce_from_tp(out.masked_fill(outside.pop().unsqueeze(-1), 0.0), group)

    embedding.register_forward_pre_hook(to_local_ids)
    embedding.register_forward_hook(reduce)
    return embedding


def is_tp_split(module: nn.Module) -> bool:
    """Whether ``module`` is already a TP layer (or a split embedding, or a LoRA wrapper of a TP layer)."""
    split = (ColumnParallelLinear, RowParallelLinear)
    return isinstance(module, split) or isinstance(getattr(module, "base_layer", None), split) or hasattr(
        module, "vocab_range"
    )


def split_shape(module: nn.Module):
    """The shape TP splits ``module`` by: a linear-like module's, or (a LoRA wrapper) its base layer's."""
    return linear_shape(lora_base(module) or module)


def split_adapted(wrapper: nn.Module, style: str, group: dist.ProcessGroup, gather_output: bool = False,
                  part_sizes: tuple[int, ...] = (), input_is_parallel: bool = True) -> list[nn.Module]:
    """Split a LoRA-adapted linear (`lightning_hybrid.core.linears.lora_base`) with its adapters, in place: its base
    layer as ``style`` says; for a column-split base each adapter's ``B`` is split as the base's output (the same
    parts, gathered alike) and ``A`` stays whole; for a row-split base ``A`` is split as the base's input and ``B``
    stays whole. Then ``base(x) + s B(A(x))`` is the unsplit layer's output piece, at the cost of one collective of
    ``r``-wide activations per layer (a row layer's ``A`` output reduced; a column layer's ``B`` input gradient,
    without sequence parallelism); the parameters whose gradients are per-rank parts (the whole matrix of each pair
    under sequence parallelism) are found by the verification. Returns the TP layers made."""
    if style == "colwise":
        wrapper.base_layer = ColumnParallelLinear(wrapper.base_layer, group, gather_output, part_sizes)
        for key, b in list(wrapper.lora_B.items()):
            wrapper.lora_B[key] = ColumnParallelLinear(b, group, gather_output, part_sizes)
        return [wrapper.base_layer, *wrapper.lora_B.values()]
    wrapper.base_layer = RowParallelLinear(wrapper.base_layer, group, input_is_parallel)
    for key, a in list(wrapper.lora_A.items()):
        wrapper.lora_A[key] = RowParallelLinear(a, group, input_is_parallel)
    return [wrapper.base_layer, *wrapper.lora_A.values()]


# ---------------------------------------------------------------------------------------------- unsplit tensors
def tp_sharded_parameter_names(model: nn.Module) -> set[str]:
    """Qualified names of the parameters that hold a TP shard (the rest are replicated over TP)."""
    return set(tp_shard_specs(model))


def tp_shard_specs(model: nn.Module) -> dict[str, tuple[ShardSpec, dist.ProcessGroup]]:
    """``{qualified parameter name: (spec, TP group)}`` of every split parameter of ``model``."""
    specs = {}
    for module_name, module in model.named_modules():
        for param_name, spec in getattr(module, "shard_specs", {}).items():
            specs[f"{module_name}.{param_name}" if module_name else param_name] = (spec, module.group)
    return specs


def unsplit_shape(name: str, tensor: Tensor, specs: dict) -> list[int]:
    """The unsplit shape of a model tensor (a ZeRO-3 DTensor's global shape is the TP-local one)."""
    shape = list(tensor.shape)
    if name in specs:
        shape[specs[name][0].dim] = sum(specs[name][0].part_sizes)
    return shape


def unsplit(name: str, tensor: Tensor, specs: dict) -> Tensor:
    """A TP-local tensor (a DTensor made full first) -> the unsplit tensor. Collective over the TP group
    (and the DTensor's mesh)."""
    tensor = tensor.detach()
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    if name in specs:
        spec, group = specs[name]
        tensor = gather_shard(tensor, spec, group)
    return tensor


def local_piece(name: str, full: Tensor, target: Tensor, specs: dict) -> Tensor:
    """The piece of the unsplit ``full`` that ``target`` holds: its TP piece and, for a ZeRO-3 DTensor, its
    rows of that piece (FSDP2 chunks dim 0 over each sharded dimension of its mesh as ``torch.chunk`` does: the DP
    mesh, or HSDP's shard dimension, the replicate dimension holding it whole)."""
    if name in specs:
        spec, group = specs[name]
        full = split_shard(full, spec, dist.get_rank(group), dist.get_world_size(group))
    if hasattr(target, "_local_tensor"):
        from torch.distributed.tensor import Shard

        mesh = target.device_mesh
        for i, placement in enumerate(target.placements):
            if isinstance(placement, Shard):
                chunks, rank = full.chunk(mesh.size(i), dim=placement.dim), mesh.get_local_rank(i)
                full = chunks[rank] if rank < len(chunks) else full.narrow(placement.dim, 0, 0)
    return full


@torch.no_grad()
def gather_full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The state dict of the unsplit model: TP shards all-gathered over their group, DTensors made full.

    Collective over the TP group (and over the DTensors' meshes): every rank of them must call it.
    """
    specs = tp_shard_specs(model)
    return {name: unsplit(name, tensor, specs).clone() for name, tensor in model.state_dict(keep_vars=True).items()}


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, Tensor], strict: bool = True) -> None:
    """Load an unsplit state dict into a (possibly) TP-split, ZeRO-3-sharded ``model``: each rank copies its piece.

    Raises ``KeyError`` naming missing/unexpected keys (with ``strict``) and ``ValueError`` naming a key whose
    shape differs from the model's unsplit shape.
    """
    specs = tp_shard_specs(model)
    own = model.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if strict and (missing or unexpected):
        raise KeyError(f"The state dict does not fit the model: missing keys {missing}, unexpected keys {unexpected}.")
    for name, target in own.items():
        if name not in state_dict:
            continue
        source, expected = state_dict[name], unsplit_shape(name, target, specs)
        if list(source.shape) != expected:
            raise ValueError(f"State dict entry {name!r} has shape {list(source.shape)}, the model expects {expected}.")
        local = local_tensor(target)
        local.copy_(local_piece(name, source, target, specs).to(device=local.device, dtype=local.dtype))
