"""ZeRO-3: FSDP2 (``fully_shard``) over the DP sub-mesh, or HSDP's 2-D ``(dp_replicate, dp_shard_cp)`` mesh.

`apply_fsdp` shards every layer of a module and then each of its children that holds parameters (the FSDP roots);
`apply_fsdp_units` shards given units (and their parts) under one root; `apply_fsdp_experts` shards expert-parallel
experts over their own data-parallel mesh first. On gloo (`_COPYING_COLLECTIVES`) FSDP2's all-gather and
reduce-scatter become the in-place `_InPlaceAllGather` and `_InPlaceReduceScatter`, and it prefetches nothing
(`_fsdp_on_gloo`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from lightning_hybrid.parallel.zero.buckets import _COPYING_COLLECTIVES

#: ``grad_reduce="auto"``: ZeRO-3 keeps an accumulation window's gradients unsharded (one reduce-scatter per optimizer
#: step) while they take at most this fraction of the device's memory, else reduce-scatters every batch of the window
#: (`lightning_hybrid.grad_sync.resolve_grad_reduce`; the planner's `resolve_grad_reduce` alike).
AUTO_WINDOW_FRACTION = 0.1
#: The values of ``grad_reduce`` (the strategy's option and the planner's `Layout` field).
GRAD_REDUCE = ("auto", "micro_batch", "window")


class _InPlaceAllGather(AllGather):
    """FSDP2's parameter all-gather on gloo, whose ``all_gather_single`` fills a temporary as large as its output
    (one gathered layer) inside the call: as `_Bucket.gather_parameters`, one in-place broadcast per rank of its
    slot of ``output_tensor`` (copies: the same result bit for bit). FSDP2 writes this rank's shards straight into
    its slot (``input_tensor`` is a view of it).

    It returns the ``Work`` of the last broadcast (the others are waited for here), even when FSDP2 asks for a
    synchronous all-gather: FSDP2 waits for it before copying the layer's parameters out of ``output_tensor``,
    and, the all-gather being asynchronous, frees ``output_tensor`` right after that copy. After a synchronous
    all-gather in forward it would keep ``output_tensor`` until the next layer's parameters have been copied out
    (so that, on a GPU, that copy overlaps the next all-gather on its stream): on CPU, a second gathered layer at
    every layer's gather, with the activations of the whole forward -- the peak of a ZeRO-3 step."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work:
        n, rank = input_tensor.numel(), dist.get_rank(group)
        mine = output_tensor.narrow(0, rank * n, n)
        if input_tensor.data_ptr() != mine.data_ptr():
            mine.copy_(input_tensor)
        if output_tensor.dtype.itemsize == 1 and output_tensor.dtype != torch.uint8:  # float8 (gloo has no such type)
            output_tensor = output_tensor.view(torch.uint8)
        works = [dist.broadcast(output_tensor.narrow(0, r * n, n), group_src=r, group=group, async_op=True)
                 for r in range(dist.get_world_size(group))]
        for work in works[:-1]:
            work.wait()
        return works[-1]


class _InPlaceReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter on gloo, whose ``reduce_scatter_single`` all-reduces a clone of its input
    (one layer's gradients) inside the call: that all-reduce, in place in ``input_tensor`` (FSDP2's flat copy of
    the layer's gradients, which it does not read again), then this rank's part copied out. The same op FSDP2
    asks for (``AVG`` for float32), the same sums, bit for bit (tests/zero/test_zero.py compares them)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op,
                 async_op: bool = False) -> None:
        dist.all_reduce(input_tensor, op=op, group=group)
        n = output_tensor.numel()
        output_tensor.copy_(input_tensor.narrow(0, dist.get_rank(group) * n, n))


def apply_fsdp(module: nn.Module, dp_mesh: DeviceMesh, parts: bool = True,
               tied: frozenset[int] | set[int] = frozenset()) -> list[nn.Module]:
    """ZeRO-3: ``fully_shard`` every layer of ``module`` (the elements of its ``nn.ModuleList``s), then each of
    its children that holds parameters (the elements of a child that is a container without ``forward``,
    such as an ``nn.ModuleList`` held by the LightningModule itself). Returns those children: the FSDP roots.

    Parameters held directly by ``module`` itself cannot be sharded this way and are an error, as is a parameter
    shared by two roots (``tied``: ids of the shared parameters, `lightning_hybrid.parallel.tied`): each root would
    shard its own copy and the tie would break.
    """
    direct = [name for name, _ in module.named_parameters(recurse=False)]
    if direct:
        raise ValueError(
            f"zero_stage=3 shards parameters per submodule, but {type(module).__name__} holds {direct} directly."
            " Move them into a submodule (e.g. an nn.Module attribute)."
        )
    layers = [layer for sub in module.modules() if isinstance(sub, nn.ModuleList) for layer in sub]
    roots = _fsdp_roots(module)
    names = {id(m): n for n, m in module.named_modules()}
    for p_id in tied:
        holding = [names[id(root)] for root in roots if any(id(p) == p_id for p in root.parameters())]
        if len(holding) > 1:
            raise ValueError(
                f"zero_stage=3 shards each of {type(module).__name__}'s children that hold parameters as an FSDP root"
                f" of its own, and {holding} share one parameter (tied weights, e.g. an LM head tied to the"
                " embedding): each root would shard its own copy and the tie would break. Hold the modules that share"
                " it in one submodule (e.g. self.model), or use zero_stage 0-2."
            )
    return [apply_fsdp_units([layer for layer in layers if layer is not root and _holds(layer, root)], root, dp_mesh,
                             parts, tied) for root in roots]


def _fsdp_roots(module: nn.Module) -> list[nn.Module]:
    """The children of ``module`` that hold parameters; a container that has no ``forward`` of its own (FSDP2
    cannot wrap it) is replaced by its own children."""
    out = []
    for child in module.children():
        if not any(True for _ in child.parameters()):
            continue
        if type(child).forward is nn.Module.forward:
            out.extend(_fsdp_roots(child))
        else:
            out.append(child)
    return out


def apply_fsdp_units(units: list[nn.Module], root: nn.Module, dp_mesh: DeviceMesh, parts: bool = True,
                     tied: frozenset[int] | set[int] = frozenset()) -> nn.Module:
    """``fully_shard`` each unit that has parameters (gathered one at a time), then ``root`` (the rest); with
    ``parts`` (not under ``torch.compile``, whose layer graphs FSDP2's hooks inside a layer would break) a unit's
    children that hold parameters (its attention, its MLP, its norms) are units of their own, gathered one at a
    time: a unit's gather holds it twice for a moment (FSDP2's flat buffer and the parameters copied out of it),
    and a part is a fraction of a layer. Every element's sum over the ranks is the same. A unit or part holding a
    parameter that other modules share (``tied``: their ids) is left to ``root``, which then shards it once for all
    of them. On gloo (`_COPYING_COLLECTIVES`) each also gets the in-place collectives and no backward prefetch
    (`_fsdp_on_gloo`)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    def shardable(module: nn.Module) -> bool:
        held = [id(p) for p in module.parameters()]
        return bool(held) and not any(p in tied for p in held)

    sharded = []
    for unit in units:
        if not shardable(unit):
            continue
        if parts:
            sharded += [fully_shard(child, mesh=dp_mesh, reshard_after_forward=True) for child in unit.children()
                        if not isinstance(child, FSDPModule) and type(child).forward is not nn.Module.forward
                        and shardable(child)]
        sharded.append(fully_shard(unit, mesh=dp_mesh, reshard_after_forward=True))
    sharded.append(fully_shard(root, mesh=dp_mesh, reshard_after_forward=True))
    if dist.get_backend(dp_mesh.get_group(dp_mesh.ndim - 1)) in _COPYING_COLLECTIVES:  # (HSDP: the shard group)
        for module in sharded:
            _fsdp_on_gloo(module)
    return root


def apply_fsdp_experts(experts: list[nn.Module], edp_mesh: DeviceMesh, dp: int) -> None:
    """ZeRO-3 of expert-parallel experts modules (`lightning_hybrid.parallel.expert_parallel`): each is
    ``fully_shard``-ed over its own data-parallel mesh -- the ``dp / ep`` ranks holding the same experts -- before
    the layers that hold it are sharded over DP (FSDP2 then leaves its parameters to it, as TorchTitan does). Their
    gradients, summed over that mesh, are divided by the whole ``dp`` as every other gradient is: they met the tokens
    of the whole expert-parallel group."""
    from torch.distributed.fsdp import fully_shard

    backend = dist.get_backend(edp_mesh.get_group())
    for module in experts:
        fully_shard(module, mesh=edp_mesh, reshard_after_forward=True)
        module.set_gradient_divide_factor(float(dp))
        # A divide factor is NCCL's PREMUL_SUM otherwise, which gloo does not have. Not on one rank: there
        # FSDP2 (torch 2.13) divides by the factor while copying, and would then post-divide by it again.
        if backend != "nccl" and edp_mesh.size() > 1:
            module.set_force_sum_reduction_for_comms(True)
        if backend in _COPYING_COLLECTIVES:
            _fsdp_on_gloo(module)


def _fsdp_on_gloo(module: nn.Module) -> None:
    """FSDP2 on gloo (CPU): its all-gather and reduce-scatter become `_InPlaceAllGather` and
    `_InPlaceReduceScatter`, and it prefetches nothing in backward.

    FSDP2's default backward prefetch gathers the next layer (in backward order) as soon as a layer's backward
    starts, so that the all-gather runs on its own stream while this layer computes. Gloo on CPU has no streams:
    the all-gather runs then and there, before the layer's backward, and the only effect is that two layers are
    gathered at once -- the running one (with its unsharded gradients) and the next: one more layer of memory at
    the peak, for no overlap. FSDP2 has no switch to turn it off (an empty list of modules to prefetch means "the
    default"), so each FSDP module is told to prefetch only itself: FSDP2 takes the explicit list instead of its
    default prefetch, and ``unshard`` of a module whose ``pre_backward`` has just gathered it returns at once.
    On NCCL none of this is done: there the prefetch overlaps communication with compute, and NCCL's collectives
    write in place.
    """
    module.set_custom_all_gather(_InPlaceAllGather())
    module.set_custom_reduce_scatter(_InPlaceReduceScatter())
    module.set_modules_to_backward_prefetch([module])


def _holds(module: nn.Module, root: nn.Module) -> bool:
    return any(module is sub for sub in root.modules())
