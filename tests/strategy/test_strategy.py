"""HybridStrategy's contract with Lightning and with the user: launchers, and clear errors raised before any
process could hang."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_hybrid import HybridStrategy, ParallelDims
from lightning_hybrid.core.hooks import StepHooks
from lightning_hybrid.data.corpus import ByteCorpusDataModule
from lightning_hybrid.models import GPTLightningModule
from tests.helpers import QUIET_TRAINER, run_distributed

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(zero_stage=4), r"zero_stage=4 is invalid: valid stages are \[0, 1, 2, 3\]"),
        (dict(tp=0), r"tp=0 is invalid"),
        (dict(dp=0), r"dp=0 is invalid"),
        (dict(pp=2, schedule="round_robin"),
         r"schedule='round_robin' is unknown: valid schedules are \['1f1b', 'gpipe', 'interleaved_1f1b',"
         r" 'zero_bubble'\]"),
        (dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2, micro_batches=3), r"multiple of pp \(2\), got 3"),
        (dict(pp=2, schedule="interleaved_1f1b"), r"needs virtual_stages >= 2"),
        (dict(pp=2, schedule="gpipe", virtual_stages=2), r"schedule='gpipe' runs 1 stage\(s\) per rank"),
        (dict(pp=4, schedule="1f1b", micro_batches=2), r"needs micro_batches >= pp \(4\), got 2"),
        (dict(tp_plan="everything"), r"tp_plan='everything' is invalid"),
        (dict(bucket_cap_mb=0), r"bucket_cap_mb=0 is invalid: it must be a positive number of MiB"),
        # Accepted and unused is refused: nothing trains differently from what was asked without an error.
        (dict(schedule="round_robin"), r"schedule='round_robin' is not used with pp=1, tp=1"),
        (dict(tp=2, micro_batches=4, virtual_stages=2, split_points=[1]),
         r"micro_batches=4, virtual_stages=2, split_points=\[1\] are not used with pp=1, tp=2"),
        (dict(pp=2, sequence_parallel=True), r"sequence_parallel=True is not used with pp=2, tp=1"),
        (dict(tp_plan={"*.q_proj": "colwise"}), r"tp_plan=\{'\*.q_proj': 'colwise'\} is not used with pp=1, tp=1"),
        (dict(checkpoint_io=object()), r"checkpoint_io=<object object at .*> would not be used: HybridStrategy writes"),
        (dict(recompute="most"), r"recompute='most' is invalid: use 'full' \(the whole layer\), 'attention'"),
        (dict(recompute=["gelu", "no_such_op"]), r"recompute names unknown aten ops \['aten.no_such_op'\]"),
        (dict(compile="yes"), r"compile='yes' is invalid: use True, False, or a dict of torch.compile arguments"),
        (dict(compile={"modes": "max-autotune"}), r"\['modes'\] are not arguments of torch.compile"),
        (dict(dp=4, dp_shard=3, zero_stage=3), r"dp_shard=3 does not divide dp=4: .*dp_shard for dp=4: \[1, 2, 4\]"),
        (dict(dp_shard=0, zero_stage=3), r"dp_shard=0 is invalid: it must be a positive integer"),
        (dict(dp_shard=2, zero_stage=1), r"dp_shard=2 shards ZeRO-3 .*; zero_stage=1 does not shard parameters"),
        (dict(dp_shard=2, zero_stage=3, ep=2), r"dp_shard=2 with ep=2: hybrid sharding of expert-parallel experts"),
        (dict(grad_reduce="sometimes", zero_stage=3), r"grad_reduce='sometimes' is invalid: use 'micro_batch'"),
        (dict(grad_reduce="micro_batch", zero_stage=2), r"grad_reduce='micro_batch' chooses when ZeRO-3"),
        (dict(tp=2, async_tp=True), r"async_tp=True fuses .*; it needs sequence_parallel=True, compile=True"),
        (dict(async_tp=True, compile=True), r"it needs tp > 1, sequence_parallel=True \(got tp=1"),
        (dict(fp8="float8"), r"fp8='float8' is invalid: use one of torchao's recipes \['tensorwise', 'rowwise',"),
        (dict(fp8=True), r"fp8=True is invalid: use one of torchao's recipes"),
        (dict(fp8_exclude=["lm_head"]), r"fp8_exclude=\['lm_head'\] names linears to keep out of FP8, but fp8=None"),
        (dict(fp8="tensorwise", fp8_exclude="lm_head"), r"fp8_exclude='lm_head' is invalid: use a list of glob"),
        (dict(fp8="tensorwise", ep=2), r"fp8='tensorwise' with ep=2: the experts' tokens are exchanged"),
        (dict(fp8_all_gather=True, zero_stage=3), r"fp8_all_gather=True gathers .* but fp8=None trains none in FP8"),
        (dict(fp8="tensorwise", fp8_all_gather=True, zero_stage=2),
         r"fp8_all_gather=True gathers ZeRO-3's sharded weights in float8; zero_stage=2 gathers no weights"),
        (dict(fp8="rowwise", fp8_all_gather=True, zero_stage=3),
         r"fp8_all_gather=True casts each weight shard .* tensorwise weight casts .*, not fp8='rowwise'"),
        (dict(fp8="tensorwise", fp8_all_gather="yes", zero_stage=3), r"fp8_all_gather='yes' is invalid: use True or"),
        (dict(cp=2, cp_attention="rings"), r"cp_attention='rings' is invalid: use 'all_gather' .* or 'ring'"),
        (dict(cp_attention="ring"), r"cp_attention='ring' chooses how context parallelism's .*; cp=1 has none"),
        (dict(zero_stage=1, overlap_param_gather="yes"), r"overlap_param_gather='yes' is invalid: use None"),
        (dict(zero_stage=3, overlap_param_gather=True), r"overlap_param_gather=True overlaps ZeRO 1-2's .*"
                                                        r"zero_stage=3 has none"),
        (dict(zero_stage=2, compile=True, overlap_param_gather=True), r"overlap_param_gather=True with compile=True"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HybridStrategy(**kwargs)


def test_layout_must_fit_the_world():
    assert ParallelDims.resolve(dp=-1, tp=2, pp=1, world_size=8).dp == 4
    with pytest.raises(ValueError, match=r"dp\*tp\*pp = 4\*1\*1 = 4 does not equal the world size 2"):
        ParallelDims.resolve(dp=4, tp=1, pp=1, world_size=2)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp\*pp = 4\*1 = 4.*\[1, 2, 3, 6\]"):
        ParallelDims.resolve(dp=-1, tp=4, pp=1, world_size=6)
    # dp inferred, then checked against dp_shard; the hybrid sizes follow from dp and dp_shard.
    with pytest.raises(ValueError, match=r"dp_shard=4 does not divide dp=2"):
        ParallelDims.resolve(dp=-1, tp=2, pp=2, world_size=8, dp_shard=4)
    hybrid = ParallelDims.resolve(dp=-1, tp=1, pp=1, world_size=8, cp=2, dp_shard=2)
    assert (hybrid.dp, hybrid.shard_size, hybrid.dp_replicate, hybrid.hybrid) == (4, 2, 2, True)
    assert not ParallelDims.resolve(dp=4, tp=1, pp=1, world_size=4).hybrid


class WithoutPipelineProtocol(GPTLightningModule):
    pipeline_layers = None  # a LightningModule that does not list its layers


class ToyDimension(StepHooks):
    """A toy dimension's hooks, as a new dimension registers them (docs/adding-a-dimension.md): every call recorded,
    the batch passed on as it is."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_batch(self, batch, stage):
        self.calls.append(f"batch:{stage}")
        return batch

    def after_training_step(self) -> None:
        self.calls.append("step")

    def after_backward(self) -> None:
        self.calls.append("backward")


class RegistersToyDimension(L.Callback):
    """Appends `ToyDimension` to what `parallelize` made, where a dimension's own step would have."""

    def __init__(self) -> None:
        self.toy = ToyDimension()

    def on_fit_start(self, trainer, pl_module) -> None:
        parallelized = trainer.strategy.parallelized
        parallelized.hooks = (*parallelized.hooks, self.toy)


def _fit_expecting_errors() -> dict[str, str]:
    """Each case fails on every rank with the same error; the next case reuses the surviving processes."""
    toy = RegistersToyDimension()
    cases = {
        "world size": (HybridStrategy(dp=4), {}),
        # q_proj's output is 4 heads of 16: parts [16, 48] hand each rank the wrong rows (setup-time verification).
        "wrong split": (HybridStrategy(tp=2, tp_plan={"*.q_proj": {"style": "colwise", "part_sizes": [16, 48]}}), {}),
        "plan pattern": (HybridStrategy(tp=2, tp_plan={"*.nonexistent": "colwise"}), {}),
        "no pipeline protocol": (HybridStrategy(pp=2), None),
        "too few layers": (HybridStrategy(pp=2, schedule="zero_bubble"), dict(n_layer=1)),
        "toy dimension": (HybridStrategy(tp=2), {}),
        # Micro-pipelined TP exists on CUDA/NCCL only: refused by name here, on every rank, before a collective.
        "async tp on cpu": (HybridStrategy(tp=2, sequence_parallel=True, compile=True, async_tp=True), {}),
        # A pattern that keeps nothing out of FP8 is a mistake in the name: refused, naming valid ones.
        "fp8 exclude pattern": (HybridStrategy(tp=2, fp8="tensorwise", fp8_exclude=["*.lm_hed"]), {}),
    }
    errors = {}
    for name, (strategy, overrides) in cases.items():
        module = (WithoutPipelineProtocol(n_layer=1, block_size=16) if overrides is None
                  else GPTLightningModule(block_size=16, **{"n_layer": 1, **overrides}))
        toy_run = dict(max_steps=2, callbacks=[toy], val_check_interval=2, limit_val_batches=1,
                       num_sanity_val_steps=0)  # two training steps, then one validation batch
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, **QUIET_TRAINER,
                            **(toy_run if name == "toy dimension" else dict(max_steps=1)))
        try:
            trainer.fit(module, ByteCorpusDataModule(max_bytes=20_000, block_size=16, batch_size=2))
            errors[name] = "no error"
        except (ValueError, TypeError) as err:
            errors[name] = str(err)
    errors["toy dimension calls"] = " ".join(toy.toy.calls)
    return errors


def test_bad_layouts_fail_on_every_rank_without_hanging():
    for errors in run_distributed(_fit_expecting_errors, 2):
        assert re.search(r"dp\*tp\*pp = 4\*1\*1 = 4 does not equal the world size 2", errors["world size"])
        assert re.search(r"tp_plan splits model\.blocks\.0\.attn in a way that changes its results",
                         errors["wrong split"])
        assert re.search(r"tp_plan pattern '\*\.nonexistent' matches no nn\.Linear", errors["plan pattern"])
        assert re.search(r"WithoutPipelineProtocol does not implement \['pipeline_layers'\]",
                         errors["no pipeline protocol"])
        assert re.search(r"4 pipeline stages need at least 4 layers; the model has 3", errors["too few layers"])
        # A dimension's hooks, called by the strategy without naming it: each batch through on_batch, then (training)
        # after the step and after its backward.
        assert re.search(r"async_tp=True needs CUDA with NCCL: .*this run is on cpu with gloo",
                         errors["async tp on cpu"])
        assert re.search(r"fp8_exclude patterns \['\*\.lm_hed'\] match no linear layer of the model; valid names"
                         r" are those of its linears, e\.g\. \['model\.blocks\.0\.attn\.q_proj'",
                         errors["fp8 exclude pattern"])
        assert errors["toy dimension"] == "no error"
        assert errors["toy dimension calls"] == "batch:train step backward batch:train step backward batch:validate"


def test_lightning_launcher_starts_the_ranks_and_every_run_exits_cleanly():
    """`Trainer(devices=2)` from a plain script: Lightning's subprocess launcher starts rank 1; the script exits 0
    with no rank aborting at interpreter exit -- even when, as the script ends, a gloo worker thread is still busy
    with a finished collective (`--busy-worker-at-exit`: what a loaded machine does to a worker descheduled before
    it has dropped its last work; the plain run is this one without the busy worker, so one run checks both). Without
    `lightning_hybrid.runtime.clean_exit`'s wait every rank of that run aborts ("terminate called without an active
    exception", exit code 134)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    script = ROOT / "tests" / "scripts" / "fit_with_lightning_launcher.py"
    done = subprocess.run([sys.executable, str(script), "--devices", "2", "--tp", "2", "--busy-worker-at-exit"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "terminate called" not in done.stderr and "Aborted" not in done.stderr, done.stderr[-3000:]
    assert re.search(r"world=2 dp=1 tp=2 val_loss=\d+\.\d+", done.stdout), done.stdout[-2000:]


def test_rank_zero_failing_after_starting_the_ranks_stops_them():
    """Rank 0 fails after Lightning's launcher started rank 1 (here: its store's port is taken): the run ends
    with rank 0's error instead of rank 1 waiting for a rank 0 that is gone (the run returns only once no rank
    holds its output open)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    script = ROOT / "tests" / "scripts" / "fit_with_lightning_launcher.py"
    done = subprocess.run([sys.executable, str(script), "--devices", "2", "--tp", "2", "--occupy-main-port"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert re.search(r"(?i)address already in use|failed to listen", done.stderr), done.stderr[-3000:]


@pytest.mark.parametrize(("hidden", "message"), [
    (False, "batch_size=6 (per data-parallel rank) does not split into micro_batches=4: use a multiple"),
    (True, "The batch of 6 samples (per data-parallel rank) does not split into micro_batches=4"),
])
def test_a_batch_the_pipeline_cannot_split_is_one_error(hidden, message):
    """A data module that tells its batch size is checked before the other ranks start; a loader that does not is
    found on the ranks, and only rank 0 says so (the others exit quietly): one traceback, not one per rank."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    script = ROOT / "tests" / "scripts" / "fit_with_lightning_launcher.py"
    args = ["--devices", "2", "--tp", "1", "--pp", "2", "--micro-batches", "4", "--batch-size", "6"]
    done = subprocess.run([sys.executable, str(script), *args, *(["--hidden-batch-size"] if hidden else [])],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert message in done.stderr and done.stderr.count("Traceback") == 1, done.stderr[-3000:]
    assert ("Initializing distributed" in done.stderr + done.stdout) == hidden  # no rank started: checked before


def test_a_rank_that_stops_answering_ends_the_job_with_a_report_naming_it():
    """Rank 1 sleeps before a batch: rank 0's next collective times out (20 s), the job ends (no rank left behind),
    and rank 0 names the collective, where it was called, and rank 1 with the batch it had reached."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    script = ROOT / "tests" / "scripts" / "stuck_rank.py"
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode != 0 and time.monotonic() - start < 200
    report = [line for line in done.stderr.splitlines() if line.startswith("error: rank 0 waited 20 s in")]
    assert report and re.search(r"torch\.distributed\.\w+ called from .*:\d+ \(\w+\), and a rank never joined"
                                r" it; ranks that never reached this rank's batch 2: rank 1 \(at batch 1\)\.",
                                report[0]), done.stderr[-3000:]


def test_a_rank_that_dies_ends_the_job_with_a_report_naming_it():
    """Rank 1 SIGKILLs itself before a batch: rank 0's next collective fails at once (gloo: the connection closed),
    the job ends within seconds of the death, and rank 0 names the collective, where it was called, and rank 1 as
    dead: its process, which rank 0 launched, ended by SIGKILL (instead of gloo's bare "Connection closed by
    peer")."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    script = ROOT / "tests" / "scripts" / "dead_rank.py"
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    ended = time.time()
    died = re.search(r"rank 1: SIGKILL at (\d+\.\d+)", done.stderr)
    assert done.returncode != 0 and died, done.stderr[-3000:]
    assert ended - float(died.group(1)) < 60, done.stderr[-3000:]
    report = [line for line in done.stderr.splitlines() if line.startswith("error: rank 0 lost a peer in")]
    assert report and re.search(r"torch\.distributed\.\w+ called from .*:\d+ \(\w+\) \(\"(Connection closed by peer"
                                r" \[127\.0\.0\.1\]:\d+|Read error \[127\.0\.0\.1\]:\d+: Connection reset by peer)\"\):"
                                r" rank 1 died \(pid \d+ on this host, killed by SIGKILL, at batch 1\)\.$",
                                report[0]), done.stderr[-3000:]


def test_a_lost_peer_is_recognised_and_a_dead_process_told_from_a_live_one():
    """What `Forensics.report_dead_peer` relies on, without a process group: gloo's and NCCL's errors for a peer that
    went
    away are told from a timeout, with the peer's address; a process on this host is alive, or dead also while
    its parent has not reaped it yet (a zombie), with its exit status where this process launched it."""
    import signal

    from lightning_hybrid.runtime.forensics import (
        _ABORTED,
        _PEER_ADDRESS,
        _PEER_LOST,
        _clause,
        _process_gone,
        _ranks,
        _start_time,
        _this_process,
    )

    lost = {
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:30408. "
        "This is typically caused by a remote worker crashing.": "[127.0.0.1]:30408",
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:414: Connection reset by "
        "peer. This is typically caused by a remote worker hanging": "[10.0.0.2]:414",
        "NCCL error in: ProcessGroupNCCL.cpp:3763, remote process exited or there was a network error, NCCL version "
        "2.21.5\nncclRemoteError: A call failed possibly due to a network error or a remote process exiting "
        "prematurely.\nLast error:\nsocketProgressOpt: Call to recv from 10.0.0.3<33759> failed": "10.0.0.3<33759>",
    }
    clauses = ["Connection closed by peer [127.0.0.1]:30408", "Read error [10.0.0.2]:414: Connection reset by peer",
               "remote process exited or there was a network error"]
    for (text, address), clause in zip(lost.items(), clauses):
        assert _PEER_LOST.search(text) and _PEER_ADDRESS.search(text).group(0) == address, text
        assert _clause(text, _PEER_LOST.search(text)) == clause
    assert _ABORTED.search("NCCL communicator was aborted on rank 1.")
    assert not _PEER_LOST.search("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv "
                                 "operation to complete")
    assert _ranks([3]) == "rank 3" and _ranks([7, 1, 4, 5, 6]) == "ranks 1, 4-7"

    me = _this_process()
    assert _process_gone(me, {}) is None
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {"pid": child.pid, "start": _start_time(child.pid)}
        assert _process_gone(record, {}) is None
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _process_gone(record, {}) is None and time.monotonic() < deadline:  # not reaped: a zombie
            time.sleep(0.05)
        assert _process_gone(record, {}) in ("exited", "gone")
        assert _process_gone(record, {child.pid: child.wait()}) == "killed by SIGKILL"
        assert _process_gone(record, {}) == "gone"
    finally:
        child.kill()
        child.wait()


def test_a_checkpoint_io_plugin_is_refused_when_the_trainer_is_built():
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    with pytest.raises(ValueError, match=r"checkpoint_io=<.*TorchCheckpointIO.*> would not be used"):
        L.Trainer(accelerator="cpu", devices=1, strategy=HybridStrategy(), plugins=[TorchCheckpointIO()],
                  **QUIET_TRAINER)


def test_layer_by_layer_options_find_the_layers_or_refuse():
    """activation_checkpointing=True and compile apply to the layers: the elements of nn.ModuleLists, else the
    pipeline layers of a module that holds its blocks as plain attributes; with neither, an error -- the option
    was once accepted and did nothing."""
    from torch import nn

    from lightning_hybrid.parallel.activation_checkpointing import checkpoint_targets
    from tests.user_modules import UserLM

    class Attributes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.block_a, self.block_b = nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def pipeline_layers(self) -> list[nn.Module]:
            return [self.embed, self.block_a, self.block_b]

    assert checkpoint_targets(UserLM(), True) == ["blocks.0", "blocks.1"]
    assert checkpoint_targets(Attributes(), True) == ["embed", "block_a", "block_b"]
    # A glob: the outermost matches ('*' matches the blocks' submodules too, which their checkpoint covers).
    assert checkpoint_targets(UserLM(), "blocks.*") == ["blocks.0", "blocks.1"]
    assert checkpoint_targets(UserLM(), "*norm1") == ["blocks.0.norm1", "blocks.1.norm1"]

    class Nested(nn.Module):  # a ModuleList inside each element of another (a MoE block's experts): the blocks
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.ModuleDict({"experts": nn.ModuleList([nn.Linear(4, 4)])}) for _ in "ab")

    assert checkpoint_targets(Nested(), True) == ["blocks.0", "blocks.1"]
    with pytest.raises(ValueError,
                       match=r"Sequential holds its layers neither in an nn.ModuleList nor in pipeline_layers"):
        checkpoint_targets(nn.Sequential(nn.Linear(4, 4)), True)


def test_parameter_gathers_run_under_the_next_forward_only_where_nothing_compiled_or_manual_reads_around_them():
    from lightning_hybrid.options import ParallelOptions
    from tests.user_code import ManualLM, UserLM

    zero1 = ParallelOptions.create(zero_stage=1)
    assert zero1.defers_param_gather(UserLM()) and ParallelOptions.create(zero_stage=2).defers_param_gather(UserLM())
    for options in (ParallelOptions.create(zero_stage=0), ParallelOptions.create(zero_stage=3),
                    ParallelOptions.create(zero_stage=1, overlap_param_gather=False),
                    ParallelOptions.create(zero_stage=2, compile=True)):
        assert not options.defers_param_gather(UserLM()), options
    compiled = UserLM()
    compiled.head = torch.compile(compiled.head)  # compiled by the user: nothing is traced until it runs
    assert not zero1.defers_param_gather(compiled) and not zero1.defers_param_gather(ManualLM())
    required = ParallelOptions.create(zero_stage=1, overlap_param_gather=True)
    with pytest.raises(ValueError, match=r"overlap_param_gather=True: \['head'\] of the module are compiled"):
        required.defers_param_gather(compiled)
    with pytest.raises(ValueError, match="overlap_param_gather=True: the module uses manual optimization"):
        required.defers_param_gather(ManualLM())
