"""`parallelize` and `GradientSync` without a ``Trainer``: on 4 real gloo ranks, a GPT is parallelised over a mesh, one
step is taken by hand (forward, backward, the gradient sync, an SGD step), and the loss, each parameter's gradient
norm and the parameters after the step are compared with the same step of the unsplit module on one process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_hybrid.checkpoint import full_state_dict
from lightning_hybrid.core.dims import ParallelDims
from lightning_hybrid.grad_sync import GradientSync
from lightning_hybrid.models import GPTLightningModule
from lightning_hybrid.options import ParallelOptions
from lightning_hybrid.parallelize import parallelize
from lightning_hybrid.testing import run_distributed

CONFIG = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64)
BATCH = 4
LR = 0.5  # SGD: an update proportional to the gradient (Adam would magnify rounding noise on gradients near 0)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, CONFIG["block_size"] + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _reference() -> dict:
    """One SGD step of the unsplit module on the whole batch."""
    module = GPTLightningModule(**CONFIG)
    module.configure_model()
    x, y = _batch()
    loss = module.loss_fn(module(x), y)
    loss.backward()
    norms = {n: p.grad.norm().item() for n, p in module.named_parameters()}
    torch.optim.SGD(module.parameters(), lr=LR).step()
    params = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"loss": loss.item(), "norms": norms, "params": params}


def _step(requested: ParallelDims, options: ParallelOptions, on_meta: bool) -> dict:
    """Parallelise a fresh module as ``requested`` and ``options`` say and take one step by hand; what it gives,
    gathered."""
    dims = requested.for_world(dist.get_world_size())
    meshes = dims.build_meshes("cpu")
    device = torch.device("cpu")
    module = GPTLightningModule(**CONFIG)
    if on_meta:  # what HybridStrategy's init context does under pp > 1: each rank builds only its layers
        with torch.device("meta"):
            module.configure_model()
    else:
        module.configure_model()
    result = parallelize(module, meshes, options, device)
    sync = GradientSync(result, options.zero_stage, options.bucket_cap_mb, device)
    (optimizer,) = sync.wrap_optimizers([torch.optim.SGD(module.parameters(), lr=LR)])
    x, y = _batch()
    dp_rank = meshes.local_rank("dp")
    x, y = x.chunk(dims.dp)[dp_rank], y.chunk(dims.dp)[dp_rank]  # DP ranks see different samples
    if result.pipeline is not None:
        loss = sync.pipeline_step(lambda: result.pipeline.train_step(x, y), first_in_window=True)
        sync.unstash()
    else:
        loss = module.loss_fn(module(x), y)
        loss.backward()
    sync.reduce()
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=meshes.group("dp_cp"))
    norms = {n: v.item() for n, v in sync.parameter_grad_norms().items()}
    optimizer.step()
    params = full_state_dict(module, meshes.group("pp"))
    sync.close()
    return {"loss": loss.item() / dims.dp, "norms": norms, "params": params, "pipelined": result.pipeline is not None,
            "tp_sharded": len(result.tp_sharded), "fsdp_roots": len(result.fsdp_roots)}


class _LayersHeldDirectly(torch.nn.Module):
    """A module as a user writes one: its layers held as attributes, no ``nn.ModuleList``, no ``pipeline_layers``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.block = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 32))
        self.head = torch.nn.Linear(32, 64)


def _layers_held_directly() -> str:
    """Such a module parallelises under DP with ZeRO-3 (nothing asks for its layers); under cp > 1, which wraps the
    layers, it is refused with the reason."""
    dims = ParallelDims.resolve(4, 1, 1, 4)
    parallelize(_LayersHeldDirectly(), dims.build_meshes("cpu"), ParallelOptions.create(dims, zero_stage=3),
                torch.device("cpu"))
    try:
        dims = ParallelDims.resolve(2, 1, 1, 4, cp=2)
        parallelize(_LayersHeldDirectly(), dims.build_meshes("cpu"), ParallelOptions.create(dims),
                    torch.device("cpu"))
    except ValueError as e:
        return str(e)
    return "not refused"


def _layouts() -> dict[str, dict]:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    cases = {
        "dp2 tp2 sp zero1": (ParallelDims.request(dp=2, tp=2), dict(zero_stage=1, sequence_parallel=True), False),
        "pp2 tp2 built per rank": (ParallelDims.request(tp=2, pp=2), dict(micro_batches=2), True),
        "pp2 dp2 zero3 1f1b": (ParallelDims.request(dp=2, pp=2), dict(zero_stage=3, micro_batches=2), True),
    }
    results = {name: _step(dims, ParallelOptions.create(dims, **kwargs), on_meta)
               for name, (dims, kwargs, on_meta) in cases.items()}
    return {**results, "layers held directly": _layers_held_directly()}


def test_parallelize_and_gradient_sync_reproduce_one_device_without_a_trainer():
    reference = _reference()
    for rank, results in enumerate(run_distributed(_layouts, 4)):
        refused = results.pop("layers held directly")
        assert refused.startswith("cp=2: context parallelism wraps the layers.") and "nn.ModuleList" in refused, refused
        for name, got in results.items():
            where = f"{name}, rank {rank}"
            assert abs(got["loss"] - reference["loss"]) <= 1e-6 * abs(reference["loss"]), where
            assert got["norms"], where
            for param, norm in got["norms"].items():  # this rank's parameters (its pipeline stages)
                want = reference["norms"][param]
                assert abs(norm - want) <= 2e-6 * max(want, 1e-3), f"{where}: gradient norm of {param}"
            assert set(got["params"]) == set(reference["params"]), where
            for key, value in got["params"].items():
                torch.testing.assert_close(value, reference["params"][key], rtol=0, atol=5e-6, msg=f"{where}: {key}")
        assert results["dp2 tp2 sp zero1"]["tp_sharded"] > 0 and not results["dp2 tp2 sp zero1"]["pipelined"]
        assert results["pp2 tp2 built per rank"]["pipelined"]
        assert results["pp2 dp2 zero3 1f1b"]["fsdp_roots"] > 0
