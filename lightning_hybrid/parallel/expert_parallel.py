"""Expert parallelism (EP): the experts of a mixture-of-experts model split over ``ep`` ranks carved out of the
data-parallel ones, tokens dispatched to their experts' ranks and combined back with all-to-alls. Dropless: every
(token, expert) pair the router picks is computed, so training equals one device.

The mesh: data-parallel rank ``d`` is ``(edp, e) = divmod(d, ep)`` (`ParallelDims.build_meshes`: ``meshes["ep"]``,
``meshes["edp"]``); the ``ep`` ranks sharing ``edp`` (and the TP and pipeline coordinates) hold the ``ep`` slices
of every experts module and exchange tokens; the ``dp / ep`` ranks sharing ``e`` hold the same experts, and reduce
(ZeRO: shard) their gradients among themselves -- the experts' own data-parallel group, as in TorchTitan and
Megatron-Core.

**Which modules** (`find_experts`): any module in the form ``transformers`` gives every MoE family since v5
(``@use_experts_implementation``: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, GraniteMoE, ...): a module with
an integer ``num_experts`` whose parameters are its own, all ``(num_experts, ...)`` (the packed 3D expert weights),
called as ``experts(hidden_states (N, H), top_k_index (N, k), top_k_weights (N, k)) -> (N, H)`` (the last two
may have other names: GPT-OSS's ``router_indices``, ``routing_weights``). The router,
shared experts and everything else stay as they are: the model's own code runs them.

**How** (`ExpertParallel`): each experts module keeps the ``num_experts / ep`` experts of its EP rank (its
parameters become those slices; ``num_experts`` says so), and two hooks around its own ``forward``:

* before: each (token, expert) pair goes to the expert's rank (one all-to-all of the split sizes, a host sync per
  layer, then one of the tokens); the module then runs on the rows it received, each with one local expert and
  weight 1 -- the model's own expert code;
* after: the outputs go back (a second all-to-all), and each token's are weighted by its routing weights and summed.

Both all-to-alls are differentiable (the backward of one is the other), and the routing weights are applied on the
sender, so their gradient never travels. That is exact when the module computes each (token, expert) pair on its
own, linearly in its weight: `check_experts` verifies it on the module itself (local experts, random rows) at
setup, and refuses, naming the module, where it does not hold.

Checkpoints and full state dicts see the experts whole: each experts module declares its parameters split along
dim 0 over the EP group (``shard_specs``, as the TP layers do), so saving gathers them, loading takes each rank's
slice, and a checkpoint saved under one ``ep`` resumes under another.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hybrid.core.collectives import ShardSpec, split_shard
from lightning_hybrid.core.linears import lora_wrapper

__all__ = ["ExpertParallel", "apply_ep", "check_experts", "expert_parameter_names", "expert_units", "find_experts"]

_EXPERTS_ARGUMENTS = ("hidden_states", "top_k_index", "top_k_weights")


def find_experts(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every experts module of ``module`` (see the module docstring for the form)."""
    found = []
    for name, sub in module.named_modules():
        count = getattr(sub, "num_experts", None)
        own = list(sub.named_parameters(recurse=False))
        if not isinstance(count, int) or isinstance(count, bool) or count < 1 or not own:
            continue
        if any(True for child in sub.children() for _ in child.parameters()):
            continue
        if not all(p.dim() >= 2 and p.size(0) == count for _, p in own):
            continue
        if len(_argument_names(sub)) == 3:
            found.append((name, sub))
    return found


def _argument_names(experts: nn.Module) -> tuple[str, ...]:
    """The names of the experts' three inputs (hidden states, expert indices, routing weights: GPT-OSS calls the
    last two ``router_indices`` and ``routing_weights``); fewer where the forward does not take three."""
    try:
        parameters = list(inspect.signature(type(experts).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return ()
    plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = tuple(p.name for p in parameters if p.kind in plain)
    return names if len(names) == 3 and names[0] == "hidden_states" else ()


def expert_parameter_names(module: nn.Module) -> frozenset[str]:
    """Qualified names of the parameters of ``module``'s expert-parallel experts modules (`apply_ep` ran), and of
    the LoRA adapters on their parameters (each rank holds its experts' rows of them)."""
    return frozenset(
        f"{name}.{p}" if name else p
        for name, sub in module.named_modules()
        if isinstance(getattr(sub, "_expert_parallel", None), ExpertParallel) or getattr(sub, "_expert_adapter", False)
        for p, _ in sub.named_parameters(recurse=False)
    )


def _adapter_wrappers(root: nn.Module, experts: nn.Module) -> list[nn.Module]:
    """peft's LoRA wrappers of ``experts``' packed parameters (``ParamWrapper``: ``base_layer`` chains that end at
    the experts module; ``all-linear`` nests one per parameter), outermost first."""
    chains = []
    for sub in root.modules():
        inner, depth = sub, 0
        while lora_wrapper(inner):
            inner, depth = inner.base_layer, depth + 1
        if depth and inner is experts:
            chains.append((depth, sub))
    return [sub for _, sub in sorted(chains, key=lambda c: -c[0])]


def _split_adapters(wrapper: nn.Module, count: int, group: dist.ProcessGroup, rank: int, size: int) -> None:
    """The adapters of a wrapper of an experts module's parameter cut to this rank's experts, as peft lays them out
    (``ParamWrapper.get_delta_weight``): A ``(E r, in)`` holds each expert's ``r`` rows in turn, B ``(out, r E)`` its
    columns ``k E + e``; the wrapper's ``num_experts`` becomes the local count."""
    for key in wrapper.lora_A:
        a, b = wrapper.lora_A[key], wrapper.lora_B[key]
        r = a.weight.size(0) // count
        for linear, spec in ((a, ShardSpec(0, (count * r,))), (b, ShardSpec(1, (count,) * r))):
            piece = split_shard(linear.weight.detach(), spec, rank, size)
            linear.weight = nn.Parameter(piece, requires_grad=linear.weight.requires_grad)
            linear.shard_specs, linear.group, linear._expert_adapter = {"weight": spec}, group, True
    wrapper.num_experts = count // size


def expert_units(module: nn.Module) -> list[nn.Module]:
    """What ZeRO-3 shards over the experts' own data-parallel group: each split experts module, or the outermost
    LoRA wrapper of its parameters (whose forward reads the adapters' weights itself)."""
    units = []
    for experts in iter_expert_modules(module):
        wrappers = _adapter_wrappers(module, experts)
        units.append(wrappers[0] if wrappers else experts)
    return units


def _local_slice(tensor: Tensor, rank: int, ep: int) -> Tensor:
    per_rank = tensor.size(0) // ep
    return tensor.narrow(0, rank * per_rank, per_rank)


@torch.no_grad()
def check_experts(name: str, experts: nn.Module) -> Optional[str]:
    """Why the dispatch would change ``experts``' results (``None``: it would not): on random rows, the output of
    top-k routing must be the weighted sum of each pair's output with weight 1, computed row by row."""
    params = list(experts.parameters())
    device, dtype = params[0].device, params[0].dtype
    hidden = int(getattr(experts, "hidden_dim", 0) or getattr(experts, "hidden_size", 0) or 0)
    if hidden <= 0:  # the input width: the last dimension the weights share with the hidden states
        candidates = [p.shape[-1] for p in params] + [p.shape[-2] for p in params if p.dim() >= 3]
        hidden = max(set(candidates), key=candidates.count)
    generator = torch.Generator(device="cpu").manual_seed(0)
    count = int(experts.num_experts)
    rows = 3
    cpu = generator.device  # a generator's tensors are made on its device, then moved
    x = torch.randn(rows, hidden, generator=generator, dtype=torch.float64, device=cpu).to(device=device, dtype=dtype)
    if count > 1:
        picks = [torch.randperm(count, generator=generator, device=cpu)[:2] for _ in range(rows)]
        index = torch.stack(picks).to(device)
    else:
        index = torch.zeros(rows, 1, dtype=torch.long, device=device)
    weights = torch.rand(tuple(index.shape), generator=generator, dtype=torch.float64, device=cpu)
    weights = weights.to(device=device, dtype=dtype)
    run = type(experts).forward  # the module's own code, without the hooks of a split module
    try:
        together = run(experts, x, index, weights)
        ones = torch.ones(rows, 1, device=device, dtype=dtype)
        apart = sum(run(experts, x, index[:, j: j + 1], ones) * weights[:, j: j + 1] for j in range(index.size(1)))
        row_by_row = torch.cat([run(experts, x[i: i + 1], index[i: i + 1], weights[i: i + 1]) for i in range(rows)])
    except Exception as error:  # noqa: BLE001 -- any failure is a refusal with its reason
        return f"{name} ({type(experts).__name__}) failed on stand-in rows: {type(error).__name__}: {error}"
    tolerance = 1e-5 if dtype == torch.float32 else (1e-12 if dtype == torch.float64 else 2e-2)
    scale = together.abs().max().clamp_min(1e-30)
    for what, other in (("pair by pair with weight 1, weighted after", apart), ("row by row", row_by_row)):
        if other.shape != together.shape or float((other - together).abs().max() / scale) > tolerance:
            return (f"{name} ({type(experts).__name__}) does not give the same output {what}: its tokens cannot be"
                    " sent to their experts' ranks exactly")
    return None


@dataclass
class ExpertParallel:
    """The EP state of one experts module: its EP group, size and rank, the global number of experts, and the
    dispatch of the forward running now (a stack: activation checkpointing re-runs a forward inside backward)."""

    group: dist.ProcessGroup
    size: int
    rank: int
    num_experts: int
    arguments: tuple[str, ...] = _EXPERTS_ARGUMENTS
    _pending: list[Any] = field(default_factory=list)

    def dispatch(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook: the rows this rank's experts run on, with their local expert and weight 1."""
        hidden, index, weights = _arguments(args, kwargs, self.arguments)
        tokens = hidden.size(0)
        k = index.size(-1)
        local = self.num_experts // self.size
        experts = index.reshape(-1)
        order = torch.argsort(experts, stable=True)  # grouped by expert, hence by the rank that holds it
        send = hidden[order // k]
        counts = torch.bincount(experts, minlength=self.num_experts)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # each rank's count for each of my experts
        send_sizes = counts.view(self.size, local).sum(1).tolist()
        recv_sizes = received.view(self.size, local).sum(1).tolist()
        rows = all_to_all(send, recv_sizes, send_sizes, self.group)
        local_index = torch.arange(local, device=index.device).repeat(self.size)
        local_index = local_index.repeat_interleave(received, output_size=sum(recv_sizes)).unsqueeze(-1)
        ones = torch.ones(local_index.shape, dtype=weights.dtype, device=weights.device)
        self._pending.append((order, send_sizes, recv_sizes, weights, tokens, sum(recv_sizes) == 0))
        if sum(recv_sizes) == 0:
            # No rows for this rank's experts: one stand-in row keeps the experts (and the all-to-all's backward,
            # which every rank of the group must join) in the graph; its output is dropped in `combine`.
            rows = rows.sum(0, keepdim=True)  # zeros, from the all-to-all's output
            local_index, ones = local_index.new_zeros((1, 1)), ones.new_ones((1, 1))
        return (rows, local_index, ones), {}

    def combine(self, module: nn.Module, args: tuple, kwargs: dict, output: Tensor) -> Tensor:
        """Forward hook: the outputs back to their tokens' ranks, weighted and summed per token."""
        order, send_sizes, recv_sizes, weights, tokens, empty = self._pending.pop()
        if empty:
            output = output[:0]
        back = all_to_all(output, send_sizes, recv_sizes, self.group)
        per_pair = torch.empty_like(back)
        per_pair[order] = back
        per_pair = per_pair.view(tokens, weights.size(-1), back.size(-1))
        return (per_pair * weights.unsqueeze(-1).to(per_pair.dtype)).sum(1).to(output.dtype)


def _arguments(args: tuple, kwargs: dict, names: tuple[str, ...]) -> tuple[Tensor, Tensor, Tensor]:
    values = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
    if len(values) != 3:
        raise TypeError(f"an experts module is called as experts{names}, got {len(args)} positional"
                        f" and {sorted(kwargs)} keyword arguments")
    return values[0], values[1], values[2]


def apply_ep(module: nn.Module, group: dist.ProcessGroup, verify: bool = True) -> list[str]:
    """Split every experts module of ``module`` over the EP ``group``: this rank keeps its experts (contiguous,
    ``num_experts / ep`` of them), and the hooks of `ExpertParallel` dispatch and combine the tokens. Verified
    first (`check_experts`) unless ``verify=False`` (experts still on the meta device, split before they are
    materialised so that each rank fills or reads only its own: the caller checks them afterwards); returns the
    errors (empty: done), naming the modules, so that the caller raises them on every rank."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    found = find_experts(module)
    if not found:
        return [f"ep={size}: {type(module).__name__} has no experts module of the form transformers gives MoE models"
                " (an integer num_experts, packed (num_experts, ...) weights, called as"
                " experts(hidden_states, top_k_index, top_k_weights)): nothing to split over expert parallelism."
                " Use ep=1."]
    errors = []
    for name, experts in found:
        if experts.num_experts % size:
            errors.append(f"{name} holds {experts.num_experts} experts, which do not split over ep={size}: choose an"
                          f" ep that divides {experts.num_experts}.")
        elif getattr(experts, "shard_specs", None):
            errors.append(f"{name} is already split over tensor parallelism: leave its experts out of tp_plan.")
        elif verify and any(p.is_meta for p in experts.parameters()):
            errors.append(f"{name} is still on the meta device: expert parallelism splits built experts.")
        elif verify:
            reason = check_experts(name, experts)
            if reason is not None:
                errors.append(reason)
    if errors:
        return errors
    for _, experts in found:
        count = experts.num_experts
        for param_name, param in list(experts.named_parameters(recurse=False)):
            piece = nn.Parameter(_local_slice(param.detach(), rank, size).clone(), requires_grad=param.requires_grad)
            setattr(experts, param_name, piece)
        state = ExpertParallel(group, size, rank, count, _argument_names(experts))
        experts.num_experts = count // size
        experts._expert_parallel = state
        # Checkpoints, full state dicts and exports see the experts whole (`tp_shard_specs`'s form: dim 0 over
        # `group`); the strategy keeps them out of the TP-sharded parameters.
        experts.shard_specs = {
            param_name: ShardSpec(0, (count,)) for param_name, _ in experts.named_parameters(recurse=False)
        }
        experts.group = group
        experts.register_forward_pre_hook(state.dispatch, with_kwargs=True)
        experts.register_forward_hook(state.combine, with_kwargs=True)
        for wrapper in _adapter_wrappers(module, experts):
            if getattr(wrapper, "num_experts", 1) == count:
                _split_adapters(wrapper, count, group, rank, size)
    return []


def iter_expert_modules(module: nn.Module) -> Iterator[nn.Module]:
    """The experts modules `apply_ep` split."""
    for sub in module.modules():
        if isinstance(getattr(sub, "_expert_parallel", None), ExpertParallel):
            yield sub


def all_to_all(tensor: Tensor, output_sizes: list[int], input_sizes: list[int], group: dist.ProcessGroup) -> Tensor:
    """Rows of ``tensor`` (``input_sizes[r]`` of them to rank ``r``, in order) exchanged over ``group``; rank ``r``
    sends this rank ``output_sizes[r]`` rows. Differentiable: the backward is the reverse exchange."""
    return _AllToAll.apply(tensor, output_sizes, input_sizes, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, output_sizes: list[int], input_sizes: list[int],
                group: dist.ProcessGroup) -> Tensor:
        ctx.sizes, ctx.group = (output_sizes, input_sizes), group
        out = tensor.new_empty((sum(output_sizes), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), output_sizes, input_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None, None]:
        output_sizes, input_sizes = ctx.sizes
        out = grad.new_empty((sum(input_sizes), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), input_sizes, output_sizes, group=ctx.group)
        return out, None, None, None
