"""Fine-tune a Hugging Face causal LM with `HybridStrategy`, configured by Hydra (`configs/finetune.yaml`): a local
pretrained folder (save_pretrained's output), the standard library's sources or your own text tokenised with
the folder's tokenizer (bytes when it has none), any layout, checkpoints, validation loss, and at the end the
trained model exported to `<run dir>/hf_model`, a folder `AutoModelForCausalLM.from_pretrained` loads.

    python recipes/finetune.py model.model=/models/my-llama                         # one process
    python recipes/finetune.py model.model=/models/my-llama parallel=3d max_steps=200  # dp2 x tp2 x pp2
    python recipes/finetune.py model.model=/models/my-llama 'data.paths=[/my/text]' parallel=tp_pp trainer=gpu
    python recipes/finetune.py -m model.model=/models/my-llama parallel=dp,tp,dp_pp  # layout sweep -> summary.*

Same run function as recipes/pretrain.py (lightning_hybrid.runs.recipe.run): metrics.json, CSV logs and checkpoints in
the Hydra output dir; a bad config prints one `error: ...` line and exits with code 2.
"""

import hydra
from omegaconf import DictConfig

from lightning_hybrid.runs.recipe import exit_on_config_error, run


@hydra.main(config_path="../configs", config_name="finetune", version_base="1.3")
@exit_on_config_error
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    exit_on_config_error(main)()
