"""Pipeline parallelism without Lightning: stage partitioning and ranks, schedule resolution, cutting a module
into this rank's stages, and the binding of ``forward``/``loss_fn`` in a training step (`PipelineModule`): the
shapes of training_step it supports and the error for those it does not (all without a process group); the
evaluation output that stays on the last stage (`PipelineOutput`, on 2 gloo ranks)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

from lightning_hybrid.models import GPTLightningModule
from lightning_hybrid.parallel.pipeline import (
    PROTOCOL_HELP,
    LayerwiseInit,
    PipelineModule,
    check_protocol,
    partition_layers,
    resolve_schedule,
    stage_ranks,
)
from lightning_hybrid.parallel.pipeline.output import PipelineOutput
from lightning_hybrid.parallel.pipeline.stages import (
    RemoteLayer,
    bind_evaluation,
    bind_training,
    keep_local_layers,
    plan_stages,
)
from tests.helpers import run_distributed


# ---------------------------------------------------------------------------------------------- partitioning
def test_partition_minimises_the_largest_stage():
    assert partition_layers([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    # Sizes 10,1,1,1,10: the best 2-stage split has a largest stage of 12, the best 3-stage one of 10.
    two = partition_layers([10, 1, 1, 1, 10], 2)
    assert max(sum([10, 1, 1, 1, 10][i] for i in r) for r in two) == 12
    assert partition_layers([10, 1, 1, 1, 10], 3) == [range(0, 1), range(1, 4), range(4, 5)]
    assert partition_layers([5, 5, 5], 3) == [range(0, 1), range(1, 2), range(2, 3)]


def test_partition_splits_as_trying_every_last_stage_start():
    """The split scans each last stage's starts from the right and stops once that stage alone is too big: the same
    split as trying every start and keeping the smallest of least cost (ties included: equal layers, zeros)."""
    import random

    def every_start(sizes, stages):
        n, prefix = len(sizes), [0]
        for size in sizes:
            prefix.append(prefix[-1] + size)
        best = [[float("inf")] * (n + 1) for _ in range(stages + 1)]
        cut = [[0] * (n + 1) for _ in range(stages + 1)]
        best[0][0] = 0
        for s in range(1, stages + 1):
            for end in range(s, n + 1):
                for start in range(s - 1, end):
                    cost = max(best[s - 1][start], prefix[end] - prefix[start])
                    if cost < best[s][end]:
                        best[s][end], cut[s][end] = cost, start
        ranges, end = [], n
        for s in range(stages, 0, -1):
            ranges.append(range(cut[s][end], end))
            end = cut[s][end]
        return ranges[::-1]

    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 30)
        sizes = rng.choice([[7] * n, [rng.choice([0, 1, 5, 5, 100]) for _ in range(n)],
                            [rng.randint(0, 1000) for _ in range(n)]])
        sizes[0], sizes[-1] = rng.randint(0, 3000), rng.randint(0, 3000)  # an embedding and a head
        stages = rng.randint(1, n)
        assert partition_layers(sizes, stages) == every_start(sizes, stages)


def test_explicit_split_points_and_their_errors():
    assert partition_layers([1] * 6, 3, split_points=[1, 5]) == [range(0, 1), range(1, 5), range(5, 6)]
    for bad in ([3], [2, 2], [0, 3], [3, 6], [4, 2]):
        with pytest.raises(ValueError,
                           match=re.escape(f"split_points={bad} is invalid: give 2 increasing layer indices in 1..5")):
            partition_layers([1] * 6, 3, split_points=bad)
    with pytest.raises(ValueError, match="4 pipeline stages need at least 4 layers; the model has 3"):
        partition_layers([1, 1, 1], 4)


def test_stage_ranks_loop_and_v():
    assert stage_ranks(4, 2, "loop") == [0, 1, 0, 1]  # interleaved: stage s on rank s % pp
    assert stage_ranks(4, 2, "v") == [0, 1, 1, 0]  # zero bubble: rank r holds stages r and 2*pp-1-r
    assert stage_ranks(8, 4, "v") == [0, 1, 2, 3, 3, 2, 1, 0]


# ---------------------------------------------------------------------------------------------- schedules
@pytest.mark.parametrize(
    ("schedule", "virtual_stages", "micro_batches", "expected"),
    [
        ("gpipe", 1, None, (ScheduleGPipe, 1, 4)),  # micro_batches defaults to 2 * pp
        ("1f1b", 1, 6, (Schedule1F1B, 1, 6)),
        ("interleaved_1f1b", 3, 4, (ScheduleInterleaved1F1B, 3, 4)),
        ("zero_bubble", 1, 2, (ScheduleZBVZeroBubble, 2, 2)),  # ZB-V: always 2 stages per rank
        ("zero_bubble", 2, 2, (ScheduleZBVZeroBubble, 2, 2)),
    ],
)
def test_schedule_resolution(schedule, virtual_stages, micro_batches, expected):
    spec, per_rank, micro = resolve_schedule(schedule, 2, micro_batches, virtual_stages)
    assert (spec.cls, per_rank, micro) == expected
    assert spec.style == ("v" if schedule == "zero_bubble" else "loop")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("round_robin", 2, None, 1),
         "schedule='round_robin' is unknown: valid schedules are ['1f1b', 'gpipe', 'interleaved_1f1b',"
         " 'zero_bubble']."),
        (("interleaved_1f1b", 2, 4, 1),
         "schedule='interleaved_1f1b' needs virtual_stages >= 2 (stages per rank), got 1."),
        (("interleaved_1f1b", 2, 3, 2), "needs micro_batches to be a multiple of pp (2), got 3."),
        (("gpipe", 2, 4, 2),
         "schedule='gpipe' runs 1 stage(s) per rank; virtual_stages=2 is not supported (leave it at 1)."),
        (("zero_bubble", 2, 4, 3), "virtual_stages=3 is not supported (leave it at 1 or 2)."),
        (("1f1b", 4, 2, 1), "schedule='1f1b' needs micro_batches >= pp (4), got 2."),
        (("1f1b", 2, 0, 1), "micro_batches=0 is invalid: it must be a positive integer."),
    ],
)
def test_schedule_errors_name_the_value_and_the_choices(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_schedule(*args)


# ---------------------------------------------------------------------------------------------- cutting a module
class Chain(nn.Module):
    """Four layers of 1, 2, 3 and 4 parameters, ``(N, 1) -> (N, 4)``; initialises single layers (the layer-wise
    protocol)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(1, 1, bias=False)
        self.body = nn.ModuleList([nn.Linear(1, 2, bias=False), nn.Linear(2, 1)])
        self.last = nn.Linear(1, 4, bias=False)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.first, *self.body, self.last]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    @staticmethod
    def loss_fn(output, target):
        return (output - target).pow(2).mean()

    def init_pipeline_layer(self, index: int, layer: nn.Module) -> None:
        for p in layer.parameters():
            nn.init.constant_(p, float(index))


def test_plan_stages_names_what_each_rank_holds():
    layout = plan_stages(Chain(), pp=2, pp_rank=1, stages_per_rank=1, style="loop", split_points=None)
    assert layout.ranges == [range(0, 3), range(3, 4)]  # sizes 1+2+3 | 4
    assert (layout.owners, layout.local_stages, layout.local_layers()) == ([0, 1], [1], [3])
    assert layout.remote_prefixes == ["first", "body.0", "body.1"]
    v = plan_stages(Chain(), pp=2, pp_rank=0, stages_per_rank=2, style="v", split_points=None)
    assert v.owners == [0, 1, 1, 0] and v.local_stages == [0, 3] and v.local_layers() == [0, 3]


def test_keep_local_layers_materialises_only_the_own_layers():
    with torch.device("meta"):
        module = Chain()
    layout = plan_stages(module, pp=2, pp_rank=0, stages_per_rank=1, style="loop", split_points=[2])
    keep_local_layers(module, layout, torch.device("cpu"))
    assert isinstance(module.body[1], RemoteLayer) and isinstance(module.last, RemoteLayer)
    assert module.first.weight.item() == 0.0 and module.body[0].weight.tolist() == [[1.0], [1.0]]
    assert sorted(n for n, _ in module.named_parameters()) == ["body.0.weight", "first.weight"]
    with pytest.raises(RuntimeError, match="pipeline layer 3 lives on another pipeline rank"):
        module.last(torch.zeros(1, 1))
    # A hook reading a stand-in's weight is told where it is (hasattr still answers False).
    with pytest.raises(AttributeError, match="'weight': pipeline layer 3 lives on another pipeline rank"):
        getattr(module.last, "weight")  # noqa: B009
    assert not hasattr(module.last, "bias") and module.last.index == 3


def test_parameters_outside_the_layers_are_an_error():
    with torch.device("meta"):
        module = Chain()
        module.scale = nn.Parameter(torch.ones(1))
    layout = plan_stages(module, pp=2, pp_rank=0, stages_per_rank=1, style="loop", split_points=None)
    with pytest.raises(TypeError,
                       match=r"Parameters \['scale'\] are outside the layers listed by `pipeline_layers\(\)`"):
        keep_local_layers(module, layout, torch.device("cpu"))


def test_the_protocol():
    assert isinstance(Chain(), PipelineModule) and isinstance(Chain(), LayerwiseInit)
    assert isinstance(GPTLightningModule(n_layer=1), PipelineModule)
    with pytest.raises(TypeError,
                       match=re.escape(f"Linear does not implement ['pipeline_layers', 'loss_fn']. {PROTOCOL_HELP}")):
        check_protocol(nn.Linear(1, 1))


# ---------------------------------------------------------------------------------------------- the binding
class RecordingExecutor:
    """Stands in for `PipelineExecutor` (our own class): records what the binding hands it."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls.append((inputs, targets))
        return torch.tensor(1.5)

    def eval_forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs * 2


X, Y = torch.arange(3.0).view(3, 1), torch.zeros(3, 4)


def one_expression(m, batch):
    x, y = batch
    return m.loss_fn(m(x), y)


def through_a_variable(m, batch):
    output = m(batch["x"])
    loss = m.loss_fn(output, batch["y"])
    return loss


def returning_a_dict(m, batch):
    return {"loss": m.loss_fn(m(batch["x"]), batch["y"]), "samples": 3}


def skipping_the_batch(m, batch):
    return None


@pytest.mark.parametrize("step", [one_expression, through_a_variable, returning_a_dict, skipping_the_batch])
def test_supported_training_steps(step):
    module, executor = Chain(), RecordingExecutor()
    batch = (X, Y) if step is one_expression else {"x": X, "y": Y}
    with bind_training(module, executor) as binding:
        output = step(module, batch)
    binding.check_output(output)
    if step is skipping_the_batch:
        assert output is None and executor.calls == []
        return
    loss = output["loss"] if isinstance(output, dict) else output
    assert loss.item() == 1.5 and len(executor.calls) == 1
    assert executor.calls[0][0] is X and executor.calls[0][1] is Y
    assert "forward" not in vars(module) and "loss_fn" not in vars(module)  # the instance is as it was
    assert module(X).shape == (3, 4)


def using_the_output_as_a_tensor(m, batch):
    return m.loss_fn(m(X).argmax(-1), Y)


def a_torch_loss_on_the_output(m, batch):
    return F.mse_loss(m(X), Y)


def two_inputs(m, batch):
    return m.loss_fn(m(X, torch.ones(3)), Y)


def loss_fn_twice(m, batch):
    m.loss_fn(m(X), Y)
    return m.loss_fn(m(X), Y)


def loss_fn_of_something_else(m, batch):
    return m.loss_fn(X, Y)


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (using_the_output_as_a_tensor, "the model output of a training step is not a tensor"),
        (a_torch_loss_on_the_output, "the model output of a training step is not a tensor (mse_loss received it)"),
        (two_inputs, "self(...) takes one positional input tensor (one tensor flows between stages) and keyword"),
        (loss_fn_twice, "loss_fn was called twice in one training step"),
        (loss_fn_of_something_else, "loss_fn received Tensor, not the output of self(x)"),
    ],
)
def test_unsupported_training_steps_fail_in_the_step(step, message):
    module = Chain()
    with bind_training(module, RecordingExecutor()), pytest.raises(TypeError, match=re.escape(message)) as err:
        step(module, None)
    assert PROTOCOL_HELP in str(err.value)


def scaling_the_loss(m, batch):
    return 2 * m.loss_fn(m(X), Y)


def adding_to_the_loss(m, batch):
    return {"loss": m.loss_fn(m(X), Y) + m.first.weight.sum()}


def no_loss_fn(m, batch):
    return torch.tensor(0.0)


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (scaling_the_loss, "training_step returned another loss than self.loss_fn(self(x), y)"),
        (adding_to_the_loss, "training_step returned another loss than self.loss_fn(self(x), y)"),
        (no_loss_fn, "training_step did not call self.loss_fn(self(x), y), so no schedule ran"),
    ],
)
def test_a_changed_or_missing_loss_is_an_error_after_the_step(step, message):
    module = Chain()
    with bind_training(module, RecordingExecutor()) as binding:
        output = step(module, None)
    with pytest.raises(TypeError, match=re.escape(message)):
        binding.check_output(output)


def test_outside_training_steps_forward_is_the_pipeline_output():
    module, executor = Chain(), RecordingExecutor()
    with bind_evaluation(module, executor):
        assert module(X).tolist() == (X * 2).tolist()
        with bind_training(module, executor):  # a training step inside the run's evaluation binding
            assert module.loss_fn(module(X), Y).item() == 1.5
        assert module(X).tolist() == (X * 2).tolist()  # the evaluation binding is back
        with pytest.raises(TypeError, match="takes one positional input tensor"):
            module(X, X)
    assert "forward" not in vars(module)


# ---------------------------------------------------------------------------------------------- evaluation output
def _pipeline_output_worker() -> dict:
    """Rank 1 is the last stage. What validation code does with the output, on both ranks."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    logits, y = torch.randn(2, 6, 10), torch.randint(0, 10, (2, 6))
    out = PipelineOutput.create(logits if dist.get_rank() == 1 else None, 1, dist.group.WORLD, torch.device("cpu"))
    flat = out.float().flatten(0, 1)  # as large as the output: stays on the last stage
    loss = F.cross_entropy(flat, y.flatten())
    return {
        "meta": (tuple(out.shape), out.dtype, out.dim(), out.size(-1), str(out.device)),
        "kept": (type(flat).__name__, flat._value is None),
        "loss": (type(loss).__name__, loss.item(), F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()),
        "argmax": torch.equal(out.argmax(-1), logits.argmax(-1)),
        "item": out[0, 0, 0].item() == logits[0, 0, 0].item(),
        "whole": torch.equal(out.materialize(), logits),
    }


def test_evaluation_output_stays_on_the_last_stage_and_small_results_reach_every_rank():
    first, last = run_distributed(_pipeline_output_worker, 2)
    for rank, res in enumerate((first, last)):
        assert res["meta"] == ((2, 6, 10), torch.float32, 3, 10, "cpu"), rank
        assert res["kept"] == ("PipelineOutput", rank == 0), rank  # the data is on the last stage only
        kind, loss, expected = res["loss"]
        assert kind == "Tensor" and loss == pytest.approx(expected, rel=1e-6), rank
        assert res["argmax"] and res["item"] and res["whole"], rank
