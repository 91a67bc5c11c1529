"""Pretrain a model with `HybridStrategy`, configured by Hydra (`configs/pretrain.yaml`): the reference GPT on the
standard library's sources by default, any LightningModule and LightningDataModule by `_target_`.

    python recipes/pretrain.py                                          # tiny GPT, stdlib corpus, 1 CPU
    python recipes/pretrain.py parallel=3d model=small                  # dp2 x tp2 x pp2 on 8 processes
    python recipes/pretrain.py model=small data=text 'data.paths=[/my/corpus]' parallel=dp_tp trainer=gpu
    python recipes/pretrain.py -m parallel=dp,tp,zero1 max_steps=50      # layout sweep -> summary.md/csv/png
    python recipes/pretrain.py parallel=3d model=custom model._target_=my_pkg.MyModule model.width=256 \\
        data=custom data._target_=my_pkg.MyData data.batch_size=8       # your own module and data

Layouts (configs/parallel/): single, dp, zero1, zero2, zero3, tp, dp_tp, dp_pp, tp_pp, 3d; devices = dp*tp*pp
unless `trainer.devices` is set. Each run writes metrics.json (final val loss, tokens/s, MFU, peak memory per
rank), CSV logs and checkpoints into its Hydra output dir; a multirun also writes summary.* into the sweep dir.
A bad config prints one `error: ...` line to stderr and exits with code 2.
"""

import hydra
from omegaconf import DictConfig

from lightning_hybrid.runs.recipe import exit_on_config_error, run


@hydra.main(config_path="../configs", config_name="pretrain", version_base="1.3")
@exit_on_config_error
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    exit_on_config_error(main)()
