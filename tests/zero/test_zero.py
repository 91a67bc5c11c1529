"""Per-rank memory follows the ZeRO partitioning at the peak of a training step, not only after it: the peak
of live tensor bytes (`lightning_hybrid.runs.memory.PeakMemoryMonitor`) split into parameters, gradients and
optimizer state, for every stage, under dp2 x tp2 (on top of the 1/tp that TP gives) and pp2 x dp2 (per
stage). And unit checks of the gradient buckets on a gloo group, without Lightning, and of the guard that makes a read
of a parameter wait for ZeRO 1-2's gather in flight."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_hybrid import HybridStrategy
from lightning_hybrid.data.corpus import ByteCorpusDataModule
from lightning_hybrid.models import GPTConfig, GPTLightningModule
from lightning_hybrid.parallel.zero import ZeroOptimizer, _InPlaceAllGather, _InPlaceReduceScatter
from lightning_hybrid.runs.memory import LiveTensorTracker, PeakMemoryMonitor, rank_state
from tests.helpers import QUIET_TRAINER, run_distributed

DP = 2
CAP_MB = 0.25  # small against the model, so that buckets in flight are a small part of it
# (params, grads, optimizer state) in units of the rank-local model size Psi (TP shard, pipeline stage); AdamW
# keeps two moments. At the peak, stage 2 also holds the bucket backward is filling and one being reduced, and
# stage 3 what FSDP2 has gathered (on gloo, without prefetch: one layer's flat all-gather buffer and its parameters).
EXPECTED = {
    0: (1.0, 1.0, 2.0),
    1: (1.0, 1.0, 2.0 / DP),
    2: (1.0, 1.0 / DP, 2.0 / DP),
    3: (1.0 / DP, 1.0 / DP, 2.0 / DP),
}
# Under a pipeline (as under gradient accumulation) gradients accumulate over the micro-batches in the full
# buckets and are reduced once, after the last: stage 2 then holds the full buckets and its slices. (Stage 3
# under a pipeline: torch's pipelining keeps a stage's FSDP2 parameters gathered and its gradients unsharded
# until the last micro-batch, so only the sharded parts below are checked there.)
PIPELINE_STAGE2_GRADS = 1.0 + 1.0 / DP


def _expected(name: str, stage: int) -> tuple[float, float, float]:
    params, grads, optim = EXPECTED[stage]
    return params, PIPELINE_STAGE2_GRADS if stage == 2 and "pp" in name else grads, optim
LAYOUTS = {"dp2xtp2": dict(dp=DP, tp=2), "pp2xdp2": dict(pp=2, dp=DP, micro_batches=2)}


def _checkpoint_overheads(trainer: L.Trainer, path: str) -> dict[str, int]:
    """The peak of live tensor bytes while saving and then loading a checkpoint (the rank's own state included)."""
    out = {}
    for what in ("save", "load"):
        tracker = LiveTensorTracker("cpu")
        tracker.label(rank_state(trainer.lightning_module, trainer.optimizers), "other")
        with tracker:
            if what == "save":
                trainer.save_checkpoint(path)
            else:
                trainer.strategy.load_checkpoint(path)
        out[what] = tracker.peak  # the rank's own state and what the save or load adds to it
    return out


def _peaks(ckpt_dir: str) -> dict:
    world = int(os.environ["WORLD_SIZE"])
    out = {}
    for name, layout in LAYOUTS.items():
        for stage in EXPECTED:
            L.seed_everything(0, verbose=False)
            config = GPTConfig(vocab_size=256, block_size=32, n_layer=6, n_head=4, n_embd=128, mlp="swiglu")
            module = GPTLightningModule(config=config)
            monitor = PeakMemoryMonitor(steps=3)
            trainer = L.Trainer(
                accelerator="cpu", devices=world, max_steps=3, limit_val_batches=0, **QUIET_TRAINER,
                callbacks=[monitor], strategy=HybridStrategy(zero_stage=stage, bucket_cap_mb=CAP_MB, **layout),
            )
            trainer.fit(module, ByteCorpusDataModule(max_bytes=40_000, block_size=32, batch_size=2))
            params = list(module.parameters())
            fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
            overheads = _checkpoint_overheads(trainer, f"{ckpt_dir}/{name}-{stage}.ckpt") if stage in (1, 3) else {}
            out[name, stage] = {
                "checkpoint": overheads,
                "peak": monitor.peak.breakdown,
                "total": monitor.peak.total,
                # A ZeRO-3 DTensor's global shape is the TP-local one: numel() is the rank-local size in every stage.
                "psi": sum(p.numel() * p.element_size() for p in params),
                "largest_layer": max(sum(p.numel() * p.element_size() for p in block.parameters())
                                     for block in module.model.blocks),
                "largest_bucket": max((b.padded * 4 for o in trainer.optimizers if isinstance(o, ZeroOptimizer)
                                       for b in o.buckets), default=0),
                # Stage 3 on gloo: every FSDP2 module runs the in-place collectives and prefetches only itself.
                "fsdp": [(type(g._all_gather_comm).__name__, type(g._reduce_scatter_comm).__name__,
                          m._get_fsdp_state()._states_to_backward_prefetch == [m._get_fsdp_state()])
                         for m in fsdp for g in m._get_fsdp_state()._fsdp_param_groups],
            }
    return out


def test_peak_memory_follows_zero_formulas(tmp_path):
    results = run_distributed(_peaks, 4, str(tmp_path))
    for rank, per_run in enumerate(results):
        for (name, stage), m in per_run.items():
            psi, got = m["psi"], m["peak"]
            params, grads, optim = (x * psi for x in _expected(name, stage))
            where = (rank, name, stage, {k: round(v / psi, 3) for k, v in got.items()})
            assert got["optimizer_state"] == pytest.approx(optim, rel=0.1), where
            if stage < 3:
                assert got["parameters"] == pytest.approx(params, rel=0.1), where
                assert not m["fsdp"], where
            else:
                assert params * 0.95 <= got["parameters"] <= params + 2 * m["largest_layer"], where
                assert set(m["fsdp"]) == {("_InPlaceAllGather", "_InPlaceReduceScatter", True)}, (rank, name, m)
            if stage == 2 and "pp" not in name:
                assert grads * 0.95 <= got["gradients"] <= grads + 2 * m["largest_bucket"] + psi * 0.05, where
            else:
                assert got["gradients"] == pytest.approx(grads, rel=0.1), where
            # Saving and loading a checkpoint stream it in parts of one bucket: over the training peak, at most
            # one bucket's worth.
            for what, peak in m["checkpoint"].items():
                assert peak <= m["total"] + CAP_MB * 2**20, (rank, name, stage, what, peak / m["total"])
        # The peak itself falls stage by stage, by at least 90% of what the formulas promise against stage 0
        # (stage 3 less what FSDP2 keeps gathered).
        for name in LAYOUTS:
            zero = per_run[name, 0]
            for stage in (1, 2, 3) if "pp" not in name else (1, 2):
                promised = (sum(EXPECTED[0]) - sum(_expected(name, stage))) * zero["psi"]
                if stage == 3:
                    promised -= 2 * zero["largest_layer"]
                saved = zero["total"] - per_run[name, stage]["total"]
                assert saved >= 0.9 * promised, (rank, name, stage, saved / promised)


# ---------------------------------------------------------------------------------------------- unit checks
def _bucket_checks() -> dict:
    """Four parameters, two ranks, per stage: gradients are bucket views, a bucket is reduced as soon as backward
    completes it (before backward ends), accumulation reduces once, an unused parameter keeps grad=None."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in (0, 1, 2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
        unused = nn.Linear(3, 3)
        # Stage 0 skips a parameter without a gradient, as one device does; stages 1-2 refuse the step (below).
        params = [*model.parameters(), *(unused.parameters() if stage == 0 else ())]
        reference = [p.detach().clone() for p in [*model.parameters(), *unused.parameters()]]
        opt = ZeroOptimizer(torch.optim.SGD(params, lr=1.0), dist.group.WORLD, stage, set(),
                            bucket_cap_mb=8 * 8 * 4 / 2**20)
        buckets = opt.gradients
        launched_in_backward = []
        first = model[0].weight  # its gradient is among the last of the backward: the earliest buckets are out by then
        first.register_post_accumulate_grad_hook(
            lambda p, launched=launched_in_backward, buckets=buckets: launched.append(len(buckets._launched)))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        grads_one_device = None
        for micro in range(2):  # an accumulation window of two backward passes
            buckets.sync = micro == 1
            model(x * (micro + 1)).square().sum().backward()
        buckets.wait()
        views = stage == 0 and all(
            p.grad is not None and p.grad.untyped_storage().data_ptr() == b.grad.untyped_storage().data_ptr()
            for b in opt.buckets for p in b.params if p.grad is not None
        )
        opt.step()
        # The one-device update: SGD with lr 1 on the mean over ranks of both micro-batches' gradients.
        inputs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        clone = nn.Sequential(*(nn.Linear(m.in_features, m.out_features) for m in model))
        with torch.no_grad():
            for p, ref in zip(clone.parameters(), reference):
                p.copy_(ref)
        for inp in inputs:
            for micro in range(2):
                (clone(inp * (micro + 1)).square().sum() / world).backward()
        grads_one_device = [p.grad for p in clone.parameters()]
        updated = [ref - g for ref, g in zip(reference, grads_one_device)]
        out[stage] = {
            "max_error": max((p.detach() - u).abs().max().item() for p, u in zip(model.parameters(), updated)),
            "unused_moved": any(not torch.equal(p.detach(), r) for p, r in zip(unused.parameters(), reference[-2:])),
            "unused_grad_none": all(p.grad is None for p in unused.parameters()),
            "launched_before_backward_ended": launched_in_backward[-1],
            "buckets": len(opt.buckets),
            "views": views,
        }
        buckets.remove()
        if stage:
            names = {id(p): n for n, p in [*model.named_parameters(prefix="model"),
                                           *unused.named_parameters(prefix="unused")]}
            opt = ZeroOptimizer(torch.optim.SGD([*model.parameters(), *unused.parameters()], lr=1.0), dist.group.WORLD,
                                stage, set(), names=names)
            model(x).sum().backward()
            try:
                opt.gradients.wait()
                out[stage]["refused"] = None
            except RuntimeError as e:
                out[stage]["refused"] = str(e)
            opt.gradients.remove()
    dist.destroy_process_group()
    return out


def test_gradient_buckets_reduce_during_backward_and_match_one_device():
    for rank, per_stage in enumerate(run_distributed(_bucket_checks, 2)):
        for stage, got in per_stage.items():
            assert got["buckets"] >= 3, (rank, stage, got)
            assert got["max_error"] < 1e-5, (rank, stage, got)
            assert got["launched_before_backward_ended"] >= 1, (rank, stage, got)  # overlap: reduced during backward
            if stage == 0:
                assert got["views"], (rank, stage, got)
                # No gradient on any rank: skipped by the optimizer, as on one device.
                assert got["unused_grad_none"] and not got["unused_moved"], (rank, stage, got)
            else:  # a slice cannot skip part of itself: the step is refused, naming the parameters, on every rank
                refusal = "['unused.bias', 'unused.weight'] got no gradient on any data-parallel rank"
                assert refusal in got["refused"], got


def _resident(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _transient(fn) -> int:
    """How far the resident set rises above its level before ``fn()`` while it runs (``VmHWM`` reset first)."""
    before = _resident("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    fn()
    return _resident("VmHWM") - before


GLOO_BUCKET_MB = 16  # a bucket of one parameter, for the resident-set measurement


def _gloo_collective_checks() -> dict:
    """Stages 1-2 on gloo over a DP group (the whole world if it is odd, else the ranks of one parity): the slice
    gradients equal torch's reduce-scatter of the same float32 gradient buffers bit for bit, and the gathered
    parameters its all-gather of the stepped slices; and how much resident memory reducing and gathering a bucket
    of `GLOO_BUCKET_MB` add (gloo's own reduce-scatter and all-gather copy the whole bucket)."""
    import ctypes

    ctypes.CDLL(None).mallopt(-3, 65536)  # M_MMAP_THRESHOLD, as MALLOC_MMAP_THRESHOLD_: freed tensors leave the RSS
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group(list(range(parity, world, 2))) for parity in (0, 1)] if world % 2 == 0 else []
    group = groups[rank % 2] if groups else dist.group.WORLD
    dp = dist.get_world_size(group)
    out = {}
    for stage in (1, 2):
        torch.manual_seed(0)  # the same parameters on every rank; sizes that leave the buckets padded
        params = [nn.Parameter(torch.randn(n)) for n in (1001, 37, 5003, 20_011, 3, 777)]
        opt = ZeroOptimizer(torch.optim.SGD(params, lr=0.1), group, stage, set(), bucket_cap_mb=32 * 1024 / 2**20)
        generator = torch.Generator().manual_seed(rank + 1)
        for p in params:  # per rank, over many orders of magnitude: any change of summation order shows
            scale = torch.exp(5 * torch.randn(p.shape, generator=generator))
            p.grad = torch.randn(p.shape, generator=generator) * scale
        full = []  # each bucket's gradient buffer as the bucket lays it out, zero-padded
        for b in opt.buckets:
            flat = torch.zeros(b.padded)
            for q, offset in zip(b.params, b.offsets):
                flat[offset : offset + q.numel()] = q.grad.reshape(-1)
            full.append(flat)
        opt.gradients.reduce()
        scattered = []
        for b, flat in zip(opt.buckets, full):
            reference = flat.new_empty(b.hi - b.lo)
            dist.reduce_scatter_single(reference, flat, group=group)
            scattered.append(torch.equal(b.shard.grad, reference.div_(dp)))
        opt.step()
        gathered = []
        for b in opt.buckets:
            reference = torch.empty_like(b.flat)
            dist.all_gather_single(reference, b.shard.detach().clone(), group=group)
            gathered.append(torch.equal(b.flat, reference))
        out[stage] = {"buckets": len(opt.buckets), "scattered": scattered, "gathered": gathered,
                      "slice_in_bucket": stage == 2 or all(b.shard.grad.data_ptr() == b.grad[b.lo :].data_ptr()
                                                           for b in opt.buckets)}
        opt.gradients.remove()
    # Stage 1 (its full buffer is allocated beforehand): what reducing and gathering a bucket add to the RSS.
    big = nn.Parameter(torch.randn(GLOO_BUCKET_MB * 2**20 // 4))
    opt = ZeroOptimizer(torch.optim.SGD([big], lr=0.1), group, 1, set(), bucket_cap_mb=GLOO_BUCKET_MB)
    big.grad = opt.buckets[0].views[0].normal_()  # already the bucket's view: nothing is freed meanwhile
    dist.barrier()
    out["reduce_bytes"] = _transient(opt.gradients.reduce)
    dist.barrier()
    out["gather_bytes"] = _transient(opt.step)
    opt.gradients.remove()
    # ZeRO-3 (FSDP2) on gloo: the same sums and copies as gloo's reduce-scatter and all-gather, with the op FSDP2
    # passes for float32 (AVG) or others (SUM), and what each adds to the RSS for a layer of GLOO_BUCKET_MB.
    n = 20_011
    generator = torch.Generator().manual_seed(rank + 1)
    grads = torch.randn(n * dp, generator=generator) * torch.exp(5 * torch.randn(n * dp, generator=generator))
    out["fsdp_scattered"] = []
    for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
        reference, got = torch.empty(n), torch.empty(n)
        dist.reduce_scatter_single(reference, grads, op=op, group=group)
        _InPlaceReduceScatter()(got, grads.clone(), group, op)
        out["fsdp_scattered"].append(torch.equal(got, reference))
    reference, gathered = torch.empty(n * dp), torch.empty(n * dp)
    dist.all_gather_single(reference, grads[:n], group=group)
    work = _InPlaceAllGather()(gathered, grads[:n], group)
    if work is not None:
        work.wait()
    out["fsdp_gathered"] = torch.equal(gathered, reference)
    size = GLOO_BUCKET_MB * 2**20 // 4 // dp
    layer, shard = torch.randn(size * dp), torch.zeros(size)  # written: resident before
    dist.barrier()
    reduce = _InPlaceReduceScatter()
    out["fsdp_reduce_bytes"] = _transient(lambda: reduce(shard, layer, group, dist.ReduceOp.AVG))
    dist.barrier()
    mine = layer.narrow(0, dist.get_rank(group) * size, size)
    out["fsdp_gather_bytes"] = _transient(lambda: _InPlaceAllGather()(layer, mine, group).wait())
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_gloo_reductions_are_exact_and_allocate_no_bucket_copy(world):
    for rank, got in enumerate(run_distributed(_gloo_collective_checks, world)):
        for stage in (1, 2):
            assert got[stage]["buckets"] >= 3, (rank, stage, got[stage])
            assert all(got[stage]["scattered"]) and all(got[stage]["gathered"]), (rank, stage, got[stage])
            assert got[stage]["slice_in_bucket"], (rank, stage)  # stage 1 reduces in place into its bucket
        # gloo's reduce-scatter and all-gather would add the whole bucket (16 MiB) each; in place: ~2 MiB
        bucket = GLOO_BUCKET_MB * 2**20
        assert got["reduce_bytes"] < bucket / 4 and got["gather_bytes"] < bucket / 4, (rank, got)
        # ZeRO-3's FSDP2 collectives on gloo: exact, and as little memory (a gathered layer of the same size)
        assert all(got["fsdp_scattered"]) and got["fsdp_gathered"], (rank, got)
        assert got["fsdp_reduce_bytes"] < bucket / 4 and got["fsdp_gather_bytes"] < bucket / 4, (rank, got)


def test_stages_1_and_2_take_element_wise_optimizers_only():
    from lightning_hybrid.parallel.zero import check_elementwise

    params = [nn.Parameter(torch.zeros(2, 2, device="cpu"))]
    for optimizer in (torch.optim.AdamW(params), torch.optim.SGD(params, lr=0.1, momentum=0.9),
                      torch.optim.Adagrad(params)):
        check_elementwise(optimizer, 1)
    for optimizer in (torch.optim.Adafactor(params), torch.optim.LBFGS(params)):
        with pytest.raises(TypeError,
                           match=rf"zero_stage=2 steps flat slices.*{type(optimizer).__qualname__} is not known"):
            check_elementwise(optimizer, 2)

    class AdamWithClipping(torch.optim.Adam):  # a subclass may change the update: it must say it is element-wise
        pass

    with pytest.raises(TypeError, match="AdamWithClipping is not known to be one"):
        check_elementwise(AdamWithClipping(params), 1)
    AdamWithClipping.elementwise_update = True
    check_elementwise(AdamWithClipping(params), 1)


def _in_flight(gathers, params: list[nn.Parameter], values: list[torch.Tensor]) -> None:
    """Buckets whose data arrive only when waited for (a collective that has not finished yet): ``params[i]`` takes
    ``values[i]`` at its wait."""

    def start(p: nn.Parameter, value: torch.Tensor):
        def arrive() -> None:
            with torch.no_grad():
                p.copy_(value)
        return lambda: arrive

    gathers.queue([start(p, v) for p, v in zip(params, values)], [[p] for p in params])


def test_a_read_of_a_parameter_in_flight_waits_for_its_bucket():
    """Between the step and the end of the next forward (`ParameterGathers.guard`), any torch function taking a
    parameter whose gather has not arrived waits for it: a layer's forward, a callback's ``p.detach()``, a sum over
    them, ``_foreach`` ops over a list, a ``state_dict``. Without the guard the same reads see the old values."""
    from lightning_hybrid.parallel.zero import ParameterGathers

    torch.manual_seed(0)
    layer, gain = nn.Linear(4, 3), nn.Parameter(torch.ones(()))
    params = [layer.weight, layer.bias, gain]
    new = [torch.randn_like(p) for p in params]
    x = torch.randn(2, 4)
    reads = {
        "forward": lambda: layer(x) * gain,
        "detach": lambda: torch.cat([p.detach().reshape(-1) for p in params]),
        "sum": lambda: sum(p.sum() for p in params),
        "foreach": lambda: torch.cat([t.reshape(-1) for t in torch._foreach_mul(params, 2.0)]),
        "state_dict": lambda: torch.cat([t.reshape(-1) for t in layer.state_dict().values()]),
    }
    old = [p.detach().clone() for p in params]

    def set_to(values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, value in zip(params, values):
                p.copy_(value)

    for name, read in reads.items():
        set_to(new)
        expected = read().detach().clone()  # the read once every bucket has arrived
        set_to(old)
        before = read().detach().clone()  # ... and before any has
        for guarded in (True, False):
            set_to(old)
            gathers = ParameterGathers()
            _in_flight(gathers, params, new)
            if guarded:
                gathers.guard()
            got = read().detach().clone()
            gathers.release()
            assert torch._C._len_torch_function_stack() == 0, name
            if guarded:
                assert torch.equal(got, expected) and gathers.waited_on_use >= 1, name
            else:  # the reads the guard exists for: the old parameters
                assert torch.equal(got, before) and not torch.equal(got, expected), name
    gathers = ParameterGathers()  # a run stopping on an error: the guard off without waiting
    _in_flight(gathers, params, new)
    gathers.guard()
    gathers.drop()
    assert torch._C._len_torch_function_stack() == 0 and not gathers.pending
