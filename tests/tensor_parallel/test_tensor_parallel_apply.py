"""Tensor parallelism on 2 real gloo ranks: the TP layers, `apply_tp` and its setup-time verification.

The distributed checks run in ONE `run_distributed` call at world size 2 (a module-scoped fixture): each TP
layer and each split model is compared, in fp32, with the unsplit module built from the same seed (outputs,
input gradients, gathered weight gradients, full state dicts); the verification is shown to pick the exact
variant for layouts that look alike (fused [q; k; v] blocks, per-head fused, per-key/value-group fused),
to find the per-head inputs (alibi), the replicated parameters with per-rank gradients (per-head norms) and
the attributes to divide, and to reject a wrong explicit split by naming the module.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hybrid.core.collectives import gather_shard, split_shard, sum_grads_over_tp_
from lightning_hybrid.parallel.activation_checkpointing import apply_activation_checkpointing, recompute_selection
from lightning_hybrid.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    apply_tp,
    gather_full_state_dict,
    load_full_state_dict,
    resolve_tp_plan,
    tp_sharded_parameter_names,
)
from lightning_hybrid.parallel.tensor_parallel.layers import shard_embedding, tp_shard_specs
from tests.helpers import run_distributed
from tests.tensor_parallel.tp_models import (
    AlibiModel,
    ScaledEmbedding,
    TinyLM,
    TorchEncoderLM,
    tiny_gpt2,
    tiny_llama,
)

WORLD = 2
ATOL = 1e-5


# --------------------------------------------------------------------------------------------------------------
# 2. Distributed checks: one spawn of 2 gloo ranks, every check in `_tp_worker`
# --------------------------------------------------------------------------------------------------------------


def _err(a, b) -> float:
    if a is None or b is None or a.shape != b.shape:
        return math.inf
    return (a.detach().float() - b.detach().float()).abs().max().item()


def Conv1D(nf: int, nx: int) -> nn.Module:
    """transformers' own Conv1D as GPT-2 uses it (``y = x W + b``, ``W`` of shape ``[in, out]``; TP recognises the
    class itself), with random weights and bias."""
    from transformers.pytorch_utils import Conv1D as HFConv1D

    module = HFConv1D(nf, nx)
    with torch.no_grad():
        module.weight.copy_(torch.randn(nx, nf) * 0.1)
        module.bias.copy_(torch.randn(nf) * 0.1)
    return module


def _check_layer(res, key, group, make_ref, make_tp, in_split, out_split, in_f, out_f):
    """A TP layer against its unsplit original: outputs, input gradient, gathered weight gradients."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(1)
    ref = make_ref()
    tp = make_tp(copy.deepcopy(ref))
    x, g = torch.randn(3, 5, in_f), torch.randn(3, 5, out_f)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    (yr * g).sum().backward()
    xt = (split_shard(x, in_split, rank, world) if in_split else x.clone()).requires_grad_()
    yt = tp(xt)
    g_t = split_shard(g, out_split, rank, world) if out_split else g
    (yt * g_t).sum().backward()
    res["err"][f"{key}/out"] = _err(yt, split_shard(yr, out_split, rank, world) if out_split else yr)
    res["err"][f"{key}/dx"] = _err(xt.grad, split_shard(xr.grad, in_split, rank, world) if in_split else xr.grad)
    for name, (spec, grp) in tp_shard_specs(tp).items():
        res["err"][f"{key}/d{name}"] = _err(gather_shard(dict(tp.named_parameters())[name].grad, spec, grp),
                                            dict(ref.named_parameters())[name].grad)


def _layer_checks(res, group):
    for gather in (True, False):
        for parts in ((24,), (8, 8, 8)):
            out_split = None if gather else ShardSpec(-1, parts)
            _check_layer(res, f"col/gather={gather}/parts={parts}", group, lambda: nn.Linear(16, 24),
                         lambda m, g=gather, p=parts: ColumnParallelLinear(m, group, g, p), None, out_split, 16, 24)
            _check_layer(res, f"conv1d_col/gather={gather}/parts={parts}", group, lambda: Conv1D(24, 16),
                         lambda m, g=gather, p=parts: ColumnParallelLinear(m, group, g, p), None, out_split, 16, 24)
    for parallel in (True, False):
        in_split = ShardSpec(-1, (24,)) if parallel else None
        _check_layer(res, f"row/parallel={parallel}", group, lambda: nn.Linear(24, 16),
                     lambda m, p=parallel: RowParallelLinear(m, group, p), in_split, None, 24, 16)
        _check_layer(res, f"conv1d_row/parallel={parallel}", group, lambda: Conv1D(16, 24),
                     lambda m, p=parallel: RowParallelLinear(m, group, p), in_split, None, 24, 16)
    # Embeddings split in place, a subclass with its own forward (scaled) and a padding index included.
    for cls, pad in ((nn.Embedding, None), (ScaledEmbedding, 11)):
        torch.manual_seed(3)
        ref = cls(16, 8, padding_idx=pad)
        tp = shard_embedding(copy.deepcopy(ref), group)
        ids = torch.randint(0, 16, (4, 7))
        ids[0, :3] = torch.tensor([0, 7, 15])
        ids[1, 0] = 8
        g = torch.randn(4, 7, 8)
        (ref(ids) * g).sum().backward()
        yt = tp(ids)
        (yt * g).sum().backward()
        key = f"emb/{cls.__name__}"
        res["err"][f"{key}/out"] = _err(yt, ref(ids))
        res["err"][f"{key}/dW"] = _err(gather_shard(tp.weight.grad, ShardSpec(0, (16,)), group), ref.weight.grad)
        res["ok"][f"{key}/keeps_class"] = type(tp) is cls and tuple(tp.weight.shape) == (8, 8)


def _lm_loss(model, ids):
    logits = model(ids)
    return logits, F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def _hf_loss(model, ids):
    out = model(input_ids=ids, labels=ids)
    return out.logits, out.loss


def _check_model(res, key, group, make_model, loss_fn, vocab, run_example, tp_plan="auto", **options):
    """Verify and split a copy of the model (``options``: `apply_tp`'s sequence parallelism and split logits);
    compare logits, loss and every gradient with the unsplit model; the full state dict round trip. Returns the
    split model and `apply_tp`'s result."""
    err, ok = res["err"], res["ok"]
    ref = make_model()
    tpm = copy.deepcopy(ref)
    result = apply_tp(tpm, group, resolve_tp_plan(tpm, dist.get_world_size(group), tp_plan),
                      run_example=lambda: run_example(tpm), **options)
    res["results"][key] = result
    if result.errors:
        return tpm, result
    torch.manual_seed(4)
    ids = torch.randint(0, vocab, (2, 12))
    ids[0, :2] = torch.tensor([0, vocab - 1])  # token ids in every rank's vocabulary slice
    logits_r, loss_r = loss_fn(ref, ids)
    loss_r.backward()
    logits_t, loss_t = loss_fn(tpm, ids)
    loss_t.backward()
    sum_grads_over_tp_([tpm.get_parameter(n).grad for n in sorted(result.partial_grads)], group)  # as the strategy does
    err[f"{key}/logits"] = _err(logits_t, logits_r)
    err[f"{key}/loss"] = _err(loss_t, loss_r)
    specs = tp_shard_specs(tpm)
    grads_t = {n: (gather_shard(p.grad, specs[n][0], group) if n in specs else p.grad)
               for n, p in tpm.named_parameters()}
    err[f"{key}/grads"] = max(_err(grads_t.get(n), p.grad) for n, p in ref.named_parameters() if p.grad is not None)
    err[f"{key}/gathered_state_dict"] = max(_err(v, ref.state_dict()[k])
                                            for k, v in gather_full_state_dict(tpm).items())
    ok[f"{key}/split_something"] = bool(tp_sharded_parameter_names(tpm))
    # Idempotent: a second apply splits nothing more.
    ok[f"{key}/idempotent"] = apply_tp(tpm, group, resolve_tp_plan(tpm, dist.get_world_size(group))).chosen == {}
    # load_full_state_dict round trip: perturb the unsplit weights, load them, gather them back, same outputs.
    torch.manual_seed(5)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    new_sd = {k: v.clone() for k, v in ref.state_dict().items()}
    load_full_state_dict(tpm, new_sd)
    err[f"{key}/roundtrip_state_dict"] = max(_err(v, new_sd[k]) for k, v in gather_full_state_dict(tpm).items())
    with torch.no_grad():
        err[f"{key}/roundtrip_logits"] = _err(loss_fn(tpm, ids)[0], loss_fn(ref, ids)[0])
        # As validation and prediction run it: eval mode, no autograd (torch's inference fast paths).
        ref.eval(), tpm.eval()
        err[f"{key}/eval_logits"] = _err(loss_fn(tpm, ids)[0], loss_fn(ref, ids)[0])
        ref.train(), tpm.train()
    return tpm, result


def _tiny_lm(tie=False):
    torch.manual_seed(0)
    return TinyLM(tie=tie)


def _alibi_model():
    torch.manual_seed(0)
    return AlibiModel()


def _torch_encoder():
    torch.manual_seed(0)
    return TorchEncoderLM()


class ShuffledBetweenBlocks(TinyLM):
    """Mixes the tokens between two blocks: blocks that see part of the sequence cannot reproduce it."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1)))
        for index, block in enumerate(self.blocks):
            x = block(x.flip(1) if index == 3 else x)
        return self.lm_head(self.ln_f(x))


def _sequence_parallel_checks(res, group, ids, hf_ids):
    """Sequence parallelism with logits kept split: every block layout of TinyLM (incl. per-head norms and
    gathered activations), Llama and GPT-2 (Conv1D, a position embedding after the token embedding) equal the
    unsplit model; the blocks run on half the sequence; a model that mixes tokens between blocks is refused; a
    sequence that does not divide is an error naming it."""
    even = torch.cat([ids, ids[:, :5]], dim=1)  # 16 tokens: divides by tp
    options = dict(sequence_parallel=True, split_logits=True)
    tpm, result = _check_model(res, "sp_tiny_lm", group, _tiny_lm, _lm_loss, 64, lambda m: m(even), **options)
    res["ok"]["sp_tiny_lm/one_run"] = result.sequence_runs == [[f"blocks.{i}" for i in range(6)]]
    seen = []
    handle = tpm.blocks[2].register_forward_hook(lambda m, a, out: seen.append(out.shape[1]))
    tpm(even)
    handle.remove()
    res["ok"]["sp_tiny_lm/blocks_see_half"] = seen == [8]
    res["ok"]["sp_tiny_lm/logits_split"] = type(tpm(even)).__name__ == "SplitLogits"
    res["ok"]["sp_tiny_lm/norms_summed"] = {"blocks.0.ln_1.weight", "blocks.5.ln_2.bias"} <= set(result.partial_grads)
    try:
        tpm(ids)  # 11 tokens
        res["ok"]["sp_tiny_lm/odd_length_refused"] = False
    except ValueError as err:
        res["ok"]["sp_tiny_lm/odd_length_refused"] = ("sequence length divides by tp=2" in str(err)
                                                      and "[2, 11, 32]" in str(err))
    hf_even = torch.cat([hf_ids, hf_ids[:, :5]], dim=1)
    _check_model(res, "sp_llama", group, tiny_llama, _hf_loss, 128, lambda m: m(input_ids=hf_even), **options)
    _check_model(res, "sp_gpt2", group, tiny_gpt2, _hf_loss, 128, lambda m: m(input_ids=hf_even), **options)
    torch.manual_seed(0)
    shuffled = ShuffledBetweenBlocks()
    result = apply_tp(shuffled, group, resolve_tp_plan(shuffled, 2), run_example=lambda: shuffled(even), **options)
    res["results"]["sp_shuffled"] = result
    from tests.user_modules import UserLM  # attention and MLP in one module

    user = UserLM()
    res["results"]["sp_user"] = apply_tp(user, group, resolve_tp_plan(user, 2), run_example=lambda: user(even),
                                         **options)


class _CollectiveCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.namespace in ("c10d", "_c10d_functional") and func.__name__ != "wait_tensor.default"
        return func(*args, **(kwargs or {}))


class _OpOrder(TorchDispatchMode):
    """The backward's products and collectives, in order: ``mm`` and ``allreduce`` (and the wait's end: ``waited``,
    noted by the test where the layer returns)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in ("mm", "allreduce_"):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _column_overlap_checks(res, group):
    """A column layer without sequence parallelism (`ColumnParallelLinear.overlap_backward`, the default): its
    backward starts the input gradient's all-reduce before it computes the weight's gradient (Megatron's
    asynchronous all-reduce), and gives bit for bit what the op-by-op form gives (`copy_to_tp`, then F.linear; an
    all-reduce after the layer's backward): outputs, input, weight and bias gradients, for nn.Linear and Conv1D, 2-D,
    3-D and non-contiguous inputs, fp32 and under bf16 autocast (whose input gradient is reduced in fp32, as the
    op-by-op form's)."""
    ok = res["ok"]
    for kind, make in (("linear", lambda: nn.Linear(16, 24)), ("nobias", lambda: nn.Linear(16, 24, bias=False)),
                       ("conv1d", lambda: Conv1D(24, 16))):
        torch.manual_seed(0)
        unsplit = make()
        for shape, amp in (((3, 5, 16), False), ((7, 16), False), ("transposed", False), ((3, 5, 16), True)):
            got, orders = {}, {}
            for overlap in (False, True):
                layer = ColumnParallelLinear(unsplit, group, gather_output=False, part_sizes=())
                layer.overlap_backward = overlap
                torch.manual_seed(1)
                x = torch.randn(5, 3, 16).transpose(0, 1) if shape == "transposed" else torch.randn(*shape)
                x.requires_grad_(True)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    y = layer(x)
                weights = torch.arange(y.numel()).view(y.shape).float().sin()
                with _OpOrder() as order:
                    (y.float() * weights).sum().backward()
                got[overlap] = [y.detach(), x.grad, *(p.grad for p in layer.parameters())]
                orders[overlap] = order.ops
            key = f"col_overlap/{kind}/{shape}/{'bf16' if amp else 'fp32'}"
            ok[f"{key}/bit_identical"] = all(torch.equal(a, b) for a, b in zip(got[False], got[True]))
            ok[f"{key}/reduce_under_weight_gradient"] = (orders[True] == ["mm", "allreduce_", "mm"]
                                                         and orders[False] == ["mm", "mm", "allreduce_"])


class _Backward(TorchDispatchMode):
    """The backward's products and collectives, in order (``mm``; a c10d collective by its op's name)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] == "mm":
            self.ops.append("mm")
        elif func.namespace == "c10d":
            self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def _unit_backward_checks(res, group, hf_ids):
    """A paired unit's backward (`unit_backward`, ``overlap_backward``), Llama (nn.Linear q/k/v, gate/up) and GPT-2
    (fused Conv1D), fp32 and bf16 autocast. With sequence parallelism the reduce-scatter of each unit's input
    gradient (an all-to-all on gloo) runs before its column layers' weight gradients are computed, not after them,
    and the row layers compute their input gradients part by part (this rank's while the all-gather of the output
    gradient runs), bit for bit the ordinary backward's gradients; without it one all-reduce a unit (not one a column
    layer: Llama's q, k, v, gate and up reduced five times a block), the gradients equal within fp32 rounding (the
    sum over TP taken once). Either way a backward run twice over a kept graph gives twice the gradients, and split as
    torch's zero-bubble schedule splits it (the inputs' gradients first, then the weights' from what reached the
    units) it gives the same."""
    ok, err, even = res["ok"], res["err"], torch.cat([hf_ids, hf_ids[:, :5]], dim=1)
    for sp, make in ((True, tiny_llama), (True, tiny_gpt2), (False, tiny_llama), (False, tiny_gpt2)):
        name = f"{make.__name__}{'/sp' if sp else ''}"
        for amp in (False, True):
            got, gaps, products = {}, {}, {}
            for overlap in (False, True):
                torch.manual_seed(0)
                model = make()
                apply_tp(model, group, resolve_tp_plan(model, 2), run_example=lambda m=model: m(input_ids=even),
                         sequence_parallel=sp, split_logits=True)
                for module in model.modules():  # the instances: the class's default stays as it is
                    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                        module.overlap_backward = overlap
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    loss = model(input_ids=even, labels=even).loss
                with _Backward() as order:
                    loss.backward()
                got[overlap] = [p.grad.clone() for p in model.parameters()]
                ops, reduction = order.ops, "alltoall" if sp else "allreduce"
                products[overlap] = ops.count("mm")
                # products between each reduction of an input gradient and the next collective
                gaps[overlap] = [next((j for j, op in enumerate(ops[i + 1:]) if op != "mm"), len(ops) - i - 1)
                                 for i, op in enumerate(ops) if op.startswith(reduction)]
            key = f"unit_backward/{name}/{'bf16' if amp else 'fp32'}"
            if sp:
                ok[f"{key}/bit_identical"] = all(torch.equal(a, b) for a, b in zip(got[False], got[True]))
                ok[f"{key}/reduce_scatter_under_weight_gradients"] = (
                    len(gaps[True]) == 4 and min(gaps[True]) > 0 and gaps[False] == [0] * 4)
                # The row layers' input gradients part by part, this rank's under the all-gather: one product more
                # for each of the 4 (tp 2).
                ok[f"{key}/row_input_gradients_by_parts"] = products[True] == products[False] + 4
            else:
                if not amp:
                    err[f"{key}/grads"] = max(_err(a, b) for a, b in zip(got[True], got[False]))
                # The LM head's own all-reduce (a lone column layer) and one a unit; one a column layer before
                # (GPT-2's c_attn and c_fc: one column layer a unit).
                per_layer = 11 if make is tiny_llama else 5
                ok[f"{key}/one_all_reduce_a_unit"] = (len(gaps[True]) == 5 and min(gaps[True]) > 0
                                                      and len(gaps[False]) == per_layer)
        if make is tiny_llama:  # inside checkpoints, full and selective: the same gradients, the same order
            for mode in ("full", "attention"):
                torch.manual_seed(0)
                ckpt = make()
                apply_tp(ckpt, group, resolve_tp_plan(ckpt, 2), run_example=lambda m=ckpt: m(input_ids=even),
                         sequence_parallel=sp, split_logits=True)
                ckpt(input_ids=even, labels=even).loss.backward()
                plain = [p.grad.clone() for p in ckpt.parameters()]
                apply_activation_checkpointing(ckpt, ["model.layers.0"], recompute_selection(mode))
                ckpt.zero_grad()
                loss = ckpt(input_ids=even, labels=even).loss
                with _Backward() as order:
                    loss.backward()
                ops, reduction = order.ops, "alltoall" if sp else "allreduce"
                gaps = [next((j for j, op in enumerate(ops[i + 1:]) if op != "mm"), len(ops) - i - 1)
                        for i, op in enumerate(ops) if op.startswith(reduction)]
                # (+ the recomputed layer's row layers' reductions when it is recomputed whole -- as far as the
                # recomputation goes: torch stops it once it has what backward needs; the units' four under weight
                # gradients)
                least = 4 + (not sp)
                counted = least <= len(gaps) <= least + 2 * (mode == "full")
                ok[f"unit_backward/{name}/checkpoint_{mode}"] = counted and sum(g > 0 for g in gaps) >= least and all(
                    torch.equal(a, p.grad) for a, p in zip(plain, ckpt.parameters()))
        model.zero_grad()
        loss = model(input_ids=even, labels=even).loss
        loss.backward(retain_graph=True)
        once = [p.grad.clone() for p in model.parameters()]
        loss.backward()
        ok[f"unit_backward/{name}/twice"] = all(torch.equal(2 * a, p.grad) for a, p in zip(once, model.parameters()))
        model.zero_grad()
        embeds = model.get_input_embeddings()(even).detach().requires_grad_(True)
        loss = model(inputs_embeds=embeds, labels=even).loss
        (reference,) = torch.autograd.grad(loss, embeds, retain_graph=True)
        loss.backward(retain_graph=True)
        params = [p for p in model.parameters() if p.grad is not None]  # (not the embedding's, unused)
        whole = [p.grad.clone() for p in params]
        model.zero_grad()
        (split,) = torch.autograd.grad(loss, embeds, retain_graph=True)  # the inputs' pass: no weight gradient
        weights = torch.autograd.grad(loss, params, retain_graph=True)  # then the weights' (the layers again)
        ok[f"unit_backward/{name}/split_passes"] = torch.equal(split, reference) and all(
            torch.equal(w, a) for w, a in zip(weights, whole))
        model.zero_grad()  # as the zero-bubble schedule runs them: the weights' pass from what reached the units
        embeds.grad = None
        loss = model(inputs_embeds=embeds, labels=even).loss
        _, groups = stage_backward_input([loss], None, [embeds], iter(params))
        stage_backward_weight(iter(params), groups)
        ok[f"unit_backward/{name}/zero_bubble_passes"] = torch.equal(embeds.grad, reference) and all(
            torch.equal(p.grad, a) for p, a in zip(params, whole))


def _selective_recompute_checks(res, group, hf_ids):
    """Selective recompute of split layers (eager attention, dropout 0.1, with and without SP) gives exactly
    the gradients of the same split model without recompute, and its backward communicates no more than without
    recompute: reductions are kept, all-gathers run again where SP all-gathers its kept shards anyway. (A model with
    dropout is compared with itself: under TP its masks are not the unsplit model's.)"""
    even = torch.cat([hf_ids, hf_ids[:, :5]], dim=1)
    for mode, sp in (("attention", True), ("pointwise", False)):
        key = f"selective_{mode}{'_sp' if sp else ''}"
        models = []
        for recompute in (False, True):
            model = tiny_llama(attention_dropout=0.1, attn_implementation="eager").train()
            res["results"][key] = apply_tp(model, group, resolve_tp_plan(model, dist.get_world_size(group)),
                                           sequence_parallel=sp, run_example=lambda model=model: model(input_ids=even),
                                           split_logits=True)
            if recompute:
                apply_activation_checkpointing(model, [f"model.layers.{i}" for i in range(2)],
                                               recompute_selection(mode))
            models.append(model)
        grads, collectives = [], []
        for model in models:
            torch.manual_seed(9)
            loss = _hf_loss(model, even)[1]
            with _CollectiveCounter() as counter:
                loss.backward()
            grads.append({n: p.grad for n, p in model.named_parameters()})
            collectives.append(counter.count)
        res["err"][f"{key}/grads"] = max(_err(grads[1][n], g) for n, g in grads[0].items() if g is not None)
        res["ok"][f"{key}/no_more_communication_in_recompute"] = collectives[0] == collectives[1] > 0


def _split_logits_checks(res, group):
    """`SplitLogits` against the gathered logits: what stays split, cross entropy (mean, sum, none, ignored
    targets) and its gradient from the shards, argmax, fused parts, and every other op through a gather."""
    from lightning_hybrid.core.split_logits import SplitLogits

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    err, ok = res["err"], res["ok"]
    torch.manual_seed(6)
    full = torch.randn(2, 5, 12)
    y = torch.randint(0, 12, (2, 5))
    y[0, 1] = -100
    for parts in ((12,), (4, 8)):
        spec = ShardSpec(-1, parts)
        ref = full.clone().requires_grad_()
        local = split_shard(full, spec, rank, world).requires_grad_()
        split = SplitLogits.wrap(local * 1.0, group, spec)
        key = f"split_logits/{parts}"
        ok[f"{key}/shape"] = tuple(split.shape) == (2, 5, 12) and split.size(-1) == 12 and split.numel() == 120
        for reduction in ("mean", "sum", "none"):
            err[f"{key}/ce_{reduction}"] = _err(F.cross_entropy(split.flatten(0, 1), y.flatten(), reduction=reduction),
                                                F.cross_entropy(full.flatten(0, 1), y.flatten(), reduction=reduction))
        ok[f"{key}/stays_split"] = all(type(t) is SplitLogits for t in (
            split.flatten(0, 1), split.view(-1, 12), split[:, :-1], split[..., :], split.float(), split / 2.0,
            split.detach(), torch.cat([split, split], dim=0)))
        F.cross_entropy(split[:, :-1].reshape(-1, split.size(-1)), y[:, 1:].reshape(-1)).backward()
        F.cross_entropy(ref[:, :-1].reshape(-1, ref.size(-1)), y[:, 1:].reshape(-1)).backward()
        err[f"{key}/ce_grad"] = _err(local.grad, split_shard(ref.grad, spec, rank, world))
        ok[f"{key}/argmax"] = torch.equal(split.argmax(-1), full.argmax(-1))
        err[f"{key}/gathered_ops"] = max(
            _err(split.softmax(-1), full.softmax(-1)), _err(split[..., 3], full[..., 3]), _err(split.sum(), full.sum()),
            _err(F.cross_entropy(split.view(-1, 12), y.flatten(), label_smoothing=0.1),
                 F.cross_entropy(full.view(-1, 12), y.flatten(), label_smoothing=0.1)),
        )


def _tp_worker() -> dict:
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    res: dict = {"err": {}, "ok": {}, "results": {}}
    _layer_checks(res, group)
    _column_overlap_checks(res, group)
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(7))
    _check_model(res, "tiny_lm", group, _tiny_lm, _lm_loss, 64, lambda m: m(ids))
    tied, _ = _check_model(res, "tiny_lm_tied", group, lambda: _tiny_lm(tie=True), _lm_loss, 64, lambda m: m(ids))
    res["ok"]["tiny_lm_tied/still_tied"] = tied.lm_head.weight is tied.wte.weight and tied.wte.weight.shape[0] == 32
    _check_model(res, "alibi", group, _alibi_model, _lm_loss, 64, lambda m: m(ids))
    _check_model(res, "torch_encoder", group, _torch_encoder, _lm_loss, 64, lambda m: m(ids))
    hf_ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(8))
    _check_model(res, "llama", group, tiny_llama, _hf_loss, 128, lambda m: m(input_ids=hf_ids))
    _check_model(res, "gpt2", group, tiny_gpt2, _hf_loss, 128, lambda m: m(input_ids=hf_ids))
    _sequence_parallel_checks(res, group, ids, hf_ids)
    _unit_backward_checks(res, group, hf_ids)
    _split_logits_checks(res, group)
    _selective_recompute_checks(res, group, hf_ids)
    # A wrong explicit split (parts that are not the layout of the fused projection) is named, not trained.
    _check_model(res, "planted", group, _tiny_lm, _lm_loss, 64, lambda m: m(ids),
                 tp_plan={"blocks.1.attn.c_attn": {"style": "colwise", "part_sizes": [16, 16, 32]}})
    res["results"] = {k: (r.summary(), {n: (v.label, v.divide, v.head_inputs) for n, v in r.chosen.items()},
                          sorted(r.partial_grads), r.errors)
                      for k, r in res["results"].items()}
    return res


@pytest.fixture(scope="module")
def tp_results():
    return run_distributed(_tp_worker, WORLD)


def _assert_close(results, prefix: str):
    checked = 0
    for rank, res in enumerate(results):
        errs = {k: v for k, v in res["err"].items() if k.startswith(prefix)}
        bad = {k: v for k, v in errs.items() if not v < ATOL}
        assert not bad, f"rank {rank}: errors >= {ATOL}: {bad}"
        oks = {k: v for k, v in res["ok"].items() if k.startswith(prefix)}
        failed = [k for k, v in oks.items() if not v]
        assert not failed, f"rank {rank}: failed checks {failed}"
        checked += len(errs) + len(oks)
    assert checked, f"no checks recorded under {prefix!r}"


@pytest.mark.parametrize("prefix", ["col/", "conv1d_col/", "row/", "conv1d_row/", "emb/", "col_overlap/",
                                    "unit_backward/"])
def test_tp_layers_match_unsplit(tp_results, prefix):
    _assert_close(tp_results, prefix)


@pytest.mark.parametrize("model", ["tiny_lm", "tiny_lm_tied", "alibi", "torch_encoder", "llama", "gpt2", "sp_tiny_lm",
                                   "sp_llama", "sp_gpt2", "selective_attention_sp", "selective_pointwise"])
def test_verified_split_models_match_unsplit(tp_results, model):
    assert tp_results[0]["results"][model][3] == []
    _assert_close(tp_results, f"{model}/")


def test_sequence_parallel_splits_the_blocks_and_refuses_what_it_cannot_reproduce(tp_results):
    summary = tp_results[0]["results"]["sp_llama"][0]
    assert "sequence split in [model.layers.0..model.layers.1]" in summary
    assert "model.layers.0.input_layernorm.weight" in tp_results[0]["results"]["sp_llama"][2]
    for res in tp_results:
        errors = res["results"]["sp_shuffled"][3]
        assert len(errors) == 1 and "blocks.3 does not receive blocks.2's output" in errors[0], errors
        errors = res["results"]["sp_user"][3]
        assert len(errors) == 2 and "blocks.0 holds its column and row layers itself" in errors[0], errors


def test_split_logits_behave_as_the_whole(tp_results):
    _assert_close(tp_results, "split_logits/")


def test_verification_picks_the_exact_layout(tp_results):
    summary, chosen, partial, _ = tp_results[0]["results"]["tiny_lm"]
    assert chosen["blocks.0.attn"][0] == "heads + heads + heads"
    assert chosen["blocks.1.attn"][0] == "[q; k; v]"  # blocks: n_head / n_kv_head divided
    assert chosen["blocks.1.attn"][1] == ("n_head", "n_kv_head")
    assert chosen["blocks.2.attn"][0] == "per-head q/k/v"
    assert chosen["blocks.3.attn"][0] == "per-head q/k/v"  # per key/value group: a contiguous split too
    assert chosen["blocks.2.mlp"][0] == "[gate; up]"
    assert chosen["blocks.5.attn"][0] == "weights split, activations gathered"  # GQA with nothing to read heads from
    assert partial == ["blocks.4.attn.k_norm.weight", "blocks.4.attn.q_norm.weight"]
    assert "verified" in summary and chosen["wte"][0] == "vocabulary split"


def test_verification_finds_per_head_inputs_and_hf_attributes(tp_results):
    _, chosen, _, _ = tp_results[0]["results"]["alibi"]
    assert chosen["h.0"][2] == (("alibi", 0),) or chosen["h.0"][2] == ((1, 0),)
    _, chosen, _, _ = tp_results[0]["results"]["gpt2"]
    assert chosen["transformer.h.0.attn"][0] == "[q; k; v]" and "split_size" in chosen["transformer.h.0.attn"][1]


def test_planted_wrong_split_is_named(tp_results):
    for res in tp_results:  # on every rank
        errors = res["results"]["planted"][3]
        assert len(errors) == 1 and "blocks.1.attn" in errors[0] and "tp_plan" in errors[0]


def test_ranks_agree(tp_results):
    assert tp_results[0]["ok"].keys() == tp_results[1]["ok"].keys()
    decisions = [{k: r[1:] for k, r in res["results"].items()} for res in tp_results]  # all but the timed summary
    assert decisions[0] == decisions[1]
