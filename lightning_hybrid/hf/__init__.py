"""Hugging Face causal LMs under every layout, unchanged: `CausalLM` wraps any ``AutoModelForCausalLM``.

Built from a config (random init) or from a local pretrained folder (safetensors, as ``save_pretrained``
writes it), `CausalLM` trains under DP x TP x PP x ZeRO without edits to the model:

* **Pipeline layers from the model's own structure.** The decoder layers are the model's ``nn.ModuleList``
  (``base_model_pp_plan``'s ``layers``, or the one list of ``num_hidden_layers`` blocks); the modules before it
  (token and position embeddings, embedding norm or dropout) and after it (final norm) are layers of their
  own, in the model's order, and the output head is the last. Parameter-free modules outside them (rotary
  embeddings) are kept on every stage. The modules keep their places and names in the model, so the model's
  TP plan, checkpoints and ``save_pretrained`` names are unchanged.
* **What a decoder layer needs besides the hidden states** (attention mask, position ids, rotary or ALiBi
  tensors, which depend on the shape only) is what the model's own forward passes it: each stage runs the
  base model's forward once per input shape with stand-ins for every layer (no weights, no compute) and
  keeps the arguments the stand-ins received. A layer called by the pipeline with the hidden states alone
  gets those arguments from a forward pre-hook; the model's own forward, which passes them itself, is left
  as it is. A position embedding that follows the token embedding (GPT-2's ``wpe``) adds its embedding of
  the positions to the hidden states it receives.
* **Exact or refused.** At setup the pipeline's decomposition is checked against the model's own forward on
  small stand-ins of the embedding, norm and head modules (the code between modules -- a scaling of the
  embeddings, a soft cap of the logits -- is what can differ): a model whose forward does something the
  layers do not is refused with an error before the first step, as are tied input and output embeddings
  under ``pp > 1``.
* **Initialisation and loading per layer, and per TP slice.** The model is built on the meta device; each
  pipeline layer is materialised by `init_pipeline_layer`: from the pretrained folder (each rank reads only the
  tensors of its own layers, one safetensors tensor at a time), or with the model's own ``_init_weights`` under
  a seed of its own (so the same values come out under every layout and on one device). Under ``tp > 1`` (any
  ``pp``; at ``pp=1`` too, for a model its pipeline layers reproduce) the strategy splits the layers on the
  meta device first, and `load_pipeline_layer_slices` fills each with this rank's pieces only
  (``safe_open().get_slice``); a random init keeps this rank's slices of one unsplit layer at a time. The
  folder's names and shapes are checked against the model when it is built, on every rank.
* `export_pretrained` writes a trained run back to a folder that ``AutoModelForCausalLM.from_pretrained``
  loads.

The package, by concern: `structure` (where the pipeline layers are), `decomposition` (the check that they
reproduce the model's forward, and the hooks that call them one tensor at a time), `weights` (reading a pretrained
folder per layer and TP slice; `export_pretrained`), `config` (the model's config and its overrides), `module`
(`CausalLM`).
"""

from lightning_hybrid.hf.decomposition import check_decomposition
from lightning_hybrid.hf.export import ExportPretrained, export_adapter, export_pretrained
from lightning_hybrid.hf.module import CausalLM
from lightning_hybrid.hf.structure import PipelineDecompositionError, pipeline_structure

__all__ = [
    "CausalLM", "ExportPretrained", "PipelineDecompositionError", "check_decomposition", "export_adapter",
    "export_pretrained",
    "pipeline_structure",
]

# The public names are `lightning_hybrid.hf`'s, wherever they are defined: class paths recorded by runs and
# recipes (``lightning_hybrid.hf.CausalLM`` in metrics.json, Hydra's ``_target_``), pickles and tracebacks keep
# naming them so.
for _public in (CausalLM, ExportPretrained, PipelineDecompositionError, check_decomposition, export_adapter,
                export_pretrained,
                pipeline_structure):
    _public.__module__ = __name__
del _public
