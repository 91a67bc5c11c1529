"""`lightning_hybrid.parallel.tensor_parallel.layerwise` without a process group: the blocks TP verification
materialises for a model on the meta device, and their inputs. (Splitting on meta and loading slices run under
`tests/hf/test_hf.py` and the pipeline x TP parity tests.)"""

from __future__ import annotations

import torch
from torch import nn

from lightning_hybrid.core.devices import is_meta
from lightning_hybrid.parallel.tensor_parallel.layerwise import Representatives


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x, scale):  # more than the one tensor a pipeline layer takes
        return x + self.down(torch.relu(self.up(x))) * scale


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x, scale=0.5)
        return x


class Layered(nn.Module):
    """The pipeline protocol's layer part: an embedding, then stages that each hold several blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.stages = nn.ModuleList([Stage(), Stage()])
        self.init_calls: list[int] = []

    def pipeline_layers(self):
        return [self.embed, *self.stages]

    def init_pipeline_layer(self, index, layer):
        self.init_calls.append(index)
        generator = torch.Generator().manual_seed(index)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


def test_representatives_are_materialised_copies_called_as_their_layer_calls_them():
    with torch.device("meta"):
        module = Layered()
    layers = module.pipeline_layers()
    names = ["embed", "stages.0", "stages.1"]
    ids = torch.randint(0, 32, (2, 5))
    reps = Representatives(module, layers, names, torch.device("cpu"), first_input=ids)

    block = reps("stages.1.blocks.0", module.stages[1].blocks[0])
    assert not is_meta(block) and is_meta(module) and module.init_calls == [2]  # a copy of its layer, initialised
    call = reps.example_call("stages.1.blocks.0", block)
    assert call.kwargs == {"scale": 0.5} and call.args[0].shape == (2, 11, 8)  # what the stage hands it

    embed = reps("embed", module.embed)
    call = reps.example_call("embed", embed)
    assert torch.equal(call.args[0], ids) and module.init_calls == [2, 0]

    plain = nn.Linear(8, 8)  # not on the meta device: verified as it is
    assert reps("other", plain) is plain and reps.example_call("other", plain).args[0].shape == (2, 11, 8)
