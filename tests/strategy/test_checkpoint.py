"""Sharded checkpoints: exact resume, resharding across layouts, consolidation to one plain file, crash
safety, and clear errors. Every run is a real Lightning Trainer on real process groups."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hybrid import HybridStrategy
from lightning_hybrid.checkpoint import CheckpointError, consolidate, read_meta
from lightning_hybrid.data.corpus import ByteCorpusDataModule
from lightning_hybrid.models import GPTLightningModule
from tests.helpers import QUIET_TRAINER, Recorder, run_distributed
from tests.parity import BLOCK, GLOBAL_BATCH
from tests.strategy.test_strategy_parity import gpt

ROOT = Path(__file__).resolve().parents[2]
MODEL = gpt(n_layer=2)
SAVED_LAYOUT = dict(dp=2, tp=2, pp=2, zero_stage=1)
# Each changes every dimension it can: pp 2 -> 1 and dp 2 -> 4 and ZeRO 1 -> 0; tp 2 -> 1, dp 2 -> 4 and ZeRO 1 -> 3
# hybrid-sharded (over 2 ranks, replicated across 2).
RESHARDED = {"dp4xtp2-zero0": dict(dp=4, tp=2, zero_stage=0),
             "pp2xdp4-zero3-hsdp2": dict(dp=4, pp=2, zero_stage=3, dp_shard=2, micro_batches=2)}


def _fit(
    world: int, layout: dict, steps: int, ckpt_in=None, ckpt_out=None, make_module=MODEL, **trainer_kwargs,
) -> dict:
    L.seed_everything(0, verbose=False)
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=HybridStrategy(**layout), max_steps=steps, callbacks=[recorder],
        **{"limit_val_batches": 0, **QUIET_TRAINER, **trainer_kwargs},
    )
    data = ByteCorpusDataModule(max_bytes=80_000, block_size=BLOCK, batch_size=GLOBAL_BATCH // layout.get("dp", 1))
    module = make_module()
    trainer.fit(module, data, ckpt_path=ckpt_in)
    if ckpt_out:
        trainer.save_checkpoint(ckpt_out)
    val = trainer.callback_metrics.get("val_loss")
    return {"losses": recorder.losses, "val_loss": None if val is None else val.item(), **_rank_state(trainer, module)}


def fit_and_resume(
    ckpt: str, saved: dict, others: dict[str, dict], make_module, world: int = 4, steps: int = 8,
) -> dict:
    """On each rank: ``steps`` steps under the ``saved`` layout straight through (``"full"``), the first half saved to
    ``ckpt``, then resumed from it to ``steps`` under ``saved`` (``"same"``) and under each layout of ``others``."""
    full = _fit(world, saved, steps, make_module=make_module)
    _fit(world, saved, steps // 2, ckpt_out=ckpt, make_module=make_module)
    layouts = {"same": saved, **others}
    return {"full": full, **{name: _fit(world, layout, steps, ckpt_in=ckpt, make_module=make_module)
                             for name, layout in layouts.items()}}


def assert_resumed_exactly(by_rank: list[dict], others, steps: int = 8) -> None:
    """What `fit_and_resume` gave every rank: resumed under the saved layout, bit for bit the uninterrupted run's
    losses, parameters, gradients and optimizer state; under each of ``others``, its losses within 1e-6 and its
    whole model within 1e-5."""
    half = steps // 2
    for rank, runs in enumerate(by_rank):
        full = runs["full"]
        assert runs["same"]["losses"] == full["losses"][half:], rank
        for what in ("params", "grads", "optimizer"):
            for key, value in full[what].items():
                assert torch.equal(runs["same"][what][key], value), (rank, what, key)
        for name in others:
            torch.testing.assert_close(torch.tensor(runs[name]["losses"]), torch.tensor(full["losses"][half:]),
                                       rtol=1e-6, atol=0, msg=f"{name} rank {rank}")
            torch.testing.assert_close(runs[name]["whole"], full["whole"], rtol=0, atol=1e-5, msg=f"{name} rank {rank}")


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t._local_tensor if hasattr(t, "_local_tensor") else t).detach().clone()


def _rank_state(trainer, module) -> dict:
    """This rank's own tensors after training: its parameters and their last gradients (local shards; ZeRO 1-2:
    the reduced bucket slices), the optimizer state it holds, and the whole model (gathered)."""
    grads = {n: _local(p.grad) for n, p in module.named_parameters() if p.grad is not None}
    optimizer = {}
    for i, opt in enumerate(trainer.optimizers):
        if hasattr(opt, "grad_shards"):
            grads.update({f"zero{i}.slice{j}": _local(g) for j, (g, _) in enumerate(opt.grad_shards())})
        for key, state in opt.state_dict()["state"].items():
            optimizer.update({f"{i}.{key}.{k}": _local(v) for k, v in state.items() if isinstance(v, torch.Tensor)})
    return {
        "params": {n: _local(p) for n, p in module.named_parameters()},
        "grads": grads,
        "optimizer": optimizer,
        "whole": {k: v.cpu() for k, v in trainer.strategy.full_state_dict().items()},
    }


def _train_then_save(ckpt: str) -> dict:
    full = _fit(8, SAVED_LAYOUT, 20)
    first = _fit(8, SAVED_LAYOUT, 10, ckpt_out=ckpt, limit_val_batches=2, val_check_interval=10)
    return {"full": full, "first": first["losses"], "val_loss": first["val_loss"]}


def _resume_under_each_layout(ckpt: str) -> dict:
    layouts = {"same": SAVED_LAYOUT, **RESHARDED}
    return {name: _fit(8, layout, 20, ckpt_in=ckpt) for name, layout in layouts.items()}


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys() and want, what
    for key, value in want.items():
        assert torch.equal(got[key], value), (f"{what}: {key} differs by"
                                              f" {(got[key].float() - value.float()).abs().max().item():.3g}")


def test_resume_is_exact_and_reshards_to_other_layouts(tmp_path):
    ckpt = str(tmp_path / "step10.ckpt")
    saved_by_rank = run_distributed(_train_then_save, 8, ckpt)
    saved = saved_by_rank[0]
    assert saved["first"] == saved["full"]["losses"][:10]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step10.ckpt"]  # no partial folder left behind
    assert read_meta(ckpt)["lightning_hybrid"]["layout"] == {"dp": 2, "tp": 2, "pp": 2, "zero_stage": 1}

    resumed_by_rank = run_distributed(_resume_under_each_layout, 8, ckpt)
    for rank, (resumed, full) in enumerate(zip(resumed_by_rank, (s["full"] for s in saved_by_rank))):
        # Same layout: every rank ends bit-identical to the uninterrupted run -- losses, its parameters, their last
        # gradients and its optimizer state.
        assert resumed["same"]["losses"] == full["losses"][10:], rank
        for what in ("params", "grads", "optimizer"):
            _assert_equal(resumed["same"][what], full[what], f"rank {rank}: {what}")
        # Another layout: the same run within fp32 reordering, losses and the whole model.
        for name in RESHARDED:
            torch.testing.assert_close(torch.tensor(resumed[name]["losses"]), torch.tensor(full["losses"][10:]),
                                       rtol=1e-6, atol=0, msg=f"{name} rank {rank}")
            torch.testing.assert_close(resumed[name]["whole"], full["whole"], rtol=0, atol=5e-6,
                                       msg=f"{name} rank {rank}")

    # One plain file that the unparallelised module loads; it gives the sharded run's validation loss.
    out = tmp_path / "plain.pt"
    done = subprocess.run([sys.executable, "-m", "lightning_hybrid.checkpoint", "consolidate", ckpt, str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    module = MODEL()
    module.configure_model()
    module.load_state_dict(torch.load(out, weights_only=True))
    trainer = L.Trainer(accelerator="cpu", devices=1, limit_val_batches=2, **QUIET_TRAINER)
    data = ByteCorpusDataModule(max_bytes=80_000, block_size=BLOCK, batch_size=GLOBAL_BATCH)
    metrics = trainer.validate(module, data, verbose=False)
    assert metrics[0]["val_loss"] == pytest.approx(saved["val_loss"], rel=1e-5)

    # `load_from_checkpoint` takes the folder itself: its hyper-parameters and the consolidated weights.
    loaded = GPTLightningModule.load_from_checkpoint(ckpt)
    assert loaded.hparams == module.hparams and loaded.state_dict().keys() == module.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in module.state_dict().items())


class DiesDuringSave(HybridStrategy):
    """The third save (step 6; steps 3 wrote the step-3 and the last checkpoint) is killed after the shards
    are written and before the checkpoint is committed."""

    saves = 0

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        DiesDuringSave.saves += 1
        if DiesDuringSave.saves == 3:
            import lightning_hybrid.checkpoint.save as save_module

            save_module.commit = lambda *args: os._exit(9)  # the process dies where the rename would be
        super().save_checkpoint(checkpoint, filepath, storage_options)


def _train_and_die_in_third_save(root: str) -> None:
    checkpointing = ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=3, save_top_k=-1)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DiesDuringSave(dp=2, zero_stage=2), max_steps=6,
                        callbacks=[checkpointing], limit_val_batches=0, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(MODEL(), ByteCorpusDataModule(max_bytes=80_000, block_size=BLOCK, batch_size=4))


def _resume_last(root: str) -> dict:
    L.seed_everything(0, verbose=False)
    recorder = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(dp=2, zero_stage=2), max_steps=5,
                        callbacks=[recorder, ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=100)],
                        limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(MODEL(), ByteCorpusDataModule(max_bytes=80_000, block_size=BLOCK, batch_size=4), ckpt_path="last")
    # The same run without the kill: its steps 4 and 5 are the resumed run's.
    L.seed_everything(0, verbose=False)
    uninterrupted = Recorder()
    L.Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(dp=2, zero_stage=2), max_steps=5,
              callbacks=[uninterrupted], limit_val_batches=0, **QUIET_TRAINER).fit(
        MODEL(), ByteCorpusDataModule(max_bytes=80_000, block_size=BLOCK, batch_size=4))
    return {"steps": trainer.global_step, "losses": recorder.losses, "uninterrupted": uninterrupted.losses}


def _errors(root: str) -> dict:
    errors = {}
    for name, (path, module) in {
        "another model": (f"{root}/good.ckpt", gpt(n_layer=2, n_embd=64)),
        "not a checkpoint": (f"{root}/empty", MODEL),
        "truncated shard": (f"{root}/truncated.ckpt", MODEL),
        "corrupted shard": (f"{root}/corrupted.ckpt", MODEL),
        "truncated meta": (f"{root}/no-meta.ckpt", MODEL),
    }.items():
        try:
            _fit(2, dict(dp=2), 4, ckpt_in=path, make_module=module)
            errors[name] = "no error"
        except CheckpointError as err:
            errors[name] = str(err)
        except SystemExit:  # rank 1: rank 0 says it (lightning_hybrid.runtime.rank_zero.raise_from_rank_zero)
            errors[name] = "left to rank 0"
    # A save rank 0 cannot write (its folders would be made under a file): every rank raises, none waits for it.
    try:
        _fit(2, dict(dp=2), 1, ckpt_out=f"{root}/a-file/x.ckpt")
        errors["unwritable"] = "no error"
    except Exception as err:
        errors["unwritable"] = f"{type(err).__name__}: {err}"
    return errors


def test_killed_save_keeps_previous_checkpoint_and_errors_are_clear(tmp_path):
    root = tmp_path / "ckpts"
    # Rank 0 dies where it would commit; rank 1 then fails in the barrier (gloo: connection reset), no hang.
    with pytest.raises(RuntimeError, match=r"rank 0 died with exit code 9|rank 1 failed"):
        run_distributed(_train_and_die_in_third_save, 2, str(root))
    names = sorted(p.name for p in root.iterdir())
    assert "last.ckpt" in names and "epoch=0-step=3.ckpt" in names
    assert any(".partial-" in n for n in names), names  # what the killed save left: never a checkpoint
    assert read_meta(root / "last.ckpt")["global_step"] == 3
    with pytest.raises(CheckpointError, match="did not finish"):
        read_meta(root / next(n for n in names if ".partial-" in n))

    resumed = run_distributed(_resume_last, 2, str(root))[0]
    assert resumed["steps"] == 5 and len(resumed["losses"]) == 2  # steps 4 and 5, after the whole step-3 one
    assert resumed["losses"] == resumed["uninterrupted"][3:], resumed  # exact: the resume loses nothing

    # A checkpoint of another model, a folder that is not a checkpoint, and damaged files (a shard cut short, a
    # shard with one byte changed, meta.pt cut short): errors that name the problem and the file, raised before
    # any rank reads (by rank 0; rank 1 leaves it to rank 0).
    os.rename(root / "last.ckpt", tmp_path / "good.ckpt")
    (tmp_path / "empty").mkdir()
    shard = sorted((tmp_path / "good.ckpt").rglob("*.distcp"))[0].relative_to(tmp_path / "good.ckpt")
    for name in ("truncated", "corrupted", "no-meta"):
        shutil.copytree(tmp_path / "good.ckpt", tmp_path / f"{name}.ckpt")
    with open(tmp_path / "truncated.ckpt" / shard, "r+b") as f:
        f.truncate(f.seek(0, os.SEEK_END) // 2)
    with open(tmp_path / "corrupted.ckpt" / shard, "r+b") as f:
        f.seek(f.seek(0, os.SEEK_END) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with open(tmp_path / "no-meta.ckpt" / "meta.pt", "r+b") as f:
        f.truncate(100)
    (tmp_path / "a-file").write_text("a file, not a folder")
    results = run_distributed(_errors, 2, str(tmp_path))
    errors = results[0]
    assert errors["unwritable"].startswith(("NotADirectoryError", "FileExistsError")), errors["unwritable"]
    assert results[1]["unwritable"].startswith(
        f"RuntimeError: rank 0 failed in making the folders of checkpoint {tmp_path}/a-file/x.ckpt: "), results[1]
    assert results[1]["truncated shard"] == results[1]["corrupted shard"] == "left to rank 0"
    assert f"truncated.ckpt/{shard} holds" in errors["truncated shard"] and "truncated" in errors["truncated shard"]
    assert re.search(rf"corrupted.ckpt/{re.escape(str(shard))} does not hold what its save wrote \(CRC-32",
                     errors["corrupted shard"]), errors["corrupted shard"]
    assert "no-meta.ckpt/meta.pt cannot be read" in errors["truncated meta"]
    assert "The checkpoint is of another model" in errors["another model"]
    assert "model.blocks.0.attn.q_proj.weight: checkpoint [32, 32] vs model [64, 64]" in errors["another model"]
    assert "is not a lightning_hybrid checkpoint" in errors["not a checkpoint"]
    with pytest.raises(CheckpointError, match="is not a lightning_hybrid checkpoint"):
        consolidate(tmp_path / "empty", tmp_path / "x.pt")


def _preemptible(root: Path, steps: int, *extra: str, **popen) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    script = ROOT / "tests" / "scripts" / "preemptible.py"
    return subprocess.Popen([sys.executable, str(script), str(root), str(steps), *extra], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def test_sigterm_stops_every_rank_at_one_step_saves_and_the_resume_is_exact(tmp_path):
    """SIGTERM (preemption) to one rank: every rank stops after the same step, ``last.ckpt`` is saved there, and
    the run resumed from it equals the uninterrupted one. (Lightning's own handler broadcasts inside the signal
    handler, where it pairs with whatever collective another rank is in.)"""
    run = _preemptible(tmp_path / "ckpts", 30)
    seen = []
    for line in run.stdout:  # the losses rank 0 prints
        seen.append(line)
        if line.startswith("step 3 "):
            run.send_signal(signal.SIGTERM)
            break
    out, err = run.communicate(timeout=120)
    stopped = [line for line in seen + out.splitlines(keepends=True) if line.startswith("step ")]
    assert run.returncode == 0, err[-3000:]  # Lightning's SIGTERMException: a clean exit
    at = len(stopped)
    assert 3 <= at < 30 and f"SIGTERM: saved {tmp_path / 'ckpts' / 'last.ckpt'} at step {at}" in err, err[-3000:]
    assert read_meta(tmp_path / "ckpts" / "last.ckpt")["global_step"] == at

    # Resumed into the next epoch (the data's order of that epoch, the resumed epoch's length: both as the
    # uninterrupted run's).
    resumed = _preemptible(tmp_path / "ckpts", 40, "resume")
    uninterrupted = _preemptible(tmp_path / "other", 40)
    (resumed_out, resumed_err), (full_out, _) = resumed.communicate(timeout=180), uninterrupted.communicate(timeout=180)
    assert resumed.returncode == 0, resumed_err[-3000:]
    losses = [line for line in resumed_out.splitlines() if line.startswith("step ")]
    full = [line for line in full_out.splitlines() if line.startswith("step ")]
    assert len(losses) == 40 - at and losses == full[at:]
