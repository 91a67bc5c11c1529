"""What users write, as they write it, for `tests/strategy/test_user_code.py`: LightningModules with their own
losses, masks, dropout, ties and hooks, and their own loaders. No helper of this package is used by the modules
themselves."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

VOCAB, DIM, HEADS, BLOCK = 64, 16, 2, 16


def token_rows(n: int = 64, seed: int = 0) -> torch.Tensor:
    """``n`` rows of ``BLOCK + 1`` tokens."""
    return torch.randint(0, VOCAB, (n, BLOCK + 1), generator=torch.Generator(device="cpu").manual_seed(seed))


class Pairs(Dataset):
    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return self.rows[i, :-1], self.rows[i, 1:]


class RankSplitStream(IterableDataset):
    """A stream split the way ``split_dataset_by_node`` and litdata split one: by torch.distributed's rank and
    world size (or, with ``by_dp``, by the strategy's data-parallel rank and size; ``whole``: not split at all)."""

    def __init__(self, rows: torch.Tensor, by_dp: "L.Trainer | None" = None, whole: bool = False) -> None:
        self.rows, self.trainer, self.whole = rows, by_dp, whole

    def __iter__(self):
        if self.whole:
            rank, size = 0, 1
        elif self.trainer is not None:
            rank, size = self.trainer.strategy.dp_rank, self.trainer.strategy.dp_size
        else:
            rank, size = dist.get_rank(), dist.get_world_size()
        for i in range(rank, len(self.rows), size):
            yield self.rows[i, :-1], self.rows[i, 1:]


def stream_loader(trainer: "L.Trainer | None", batch_size: int = 4, whole: bool = False) -> DataLoader:
    return DataLoader(RankSplitStream(token_rows(), by_dp=trainer, whole=whole), batch_size=batch_size)


class Block(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + F.dropout(self.o(y), self.dropout, self.training)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class UserLM(L.LightningModule):
    """Layers held directly, a bare embedding and head, a plain mean cross entropy; SGD."""

    def __init__(self, layers: int = 2, lr: float = 0.5, dropout: float = 0.0) -> None:
        super().__init__()
        self.lr = lr
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.embed = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.ModuleList(Block(dropout=dropout) for _ in range(layers))
            self.head = nn.Linear(DIM, VOCAB)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    @staticmethod
    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class PaddedDicts(Dataset):
    """Rows of 6-16 real tokens padded on the right (``left``: on the left): ``input_ids``, ``labels`` (-100 on the
    padding and the last token) and ``attention_mask``."""

    def __init__(self, rows: torch.Tensor, left: bool = False) -> None:
        self.rows, self.left = rows, left
        self.lengths = torch.randint(6, BLOCK + 1, (len(rows),), generator=torch.Generator(device="cpu").manual_seed(1))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = int(self.lengths[i])
        ids = self.rows[i, :-1].clone()
        mask = (torch.arange(BLOCK) < n).long()
        labels = torch.where(torch.arange(BLOCK) < n - 1, self.rows[i, 1:], torch.full_like(ids, -100))
        if self.left:
            ids, labels, mask = ids.roll(BLOCK - n), labels.roll(BLOCK - n), mask.roll(BLOCK - n)
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


class DictLM(UserLM):
    """On dict batches: the mean cross entropy over the labels other than -100, computed in training_step (no
    loss_items, nothing declared)."""

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten())


class DeclaredMeanDictLM(DictLM):
    loss_reduction = "mean"


class SumLM(UserLM):
    """A loss summed over tokens, declared."""

    loss_reduction = "sum"

    def __init__(self, lr: float = 0.005, **kwargs) -> None:
        super().__init__(lr=lr, **kwargs)

    @staticmethod
    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")


class UndeclaredSumLM(SumLM):
    loss_reduction = None


class MiscountedLM(UserLM):
    """Defines loss_items, counting every target, while its loss_fn leaves out the targets below 8 (as a padding id
    would be)."""

    @staticmethod
    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten().masked_fill(y.flatten() < 8, -100))

    @staticmethod
    def loss_items(y: torch.Tensor) -> torch.Tensor:
        return torch.tensor(y.numel(), device=y.device)


def _loader(dataset: Dataset, batch_size: int) -> DataLoader:
    """A loader as users write it (``shuffle=False``): the strategy keeps its order, one device's (each data-parallel
    rank reads every ``dp``-th sample of it; `ordered_loader`: an order of the user's own)."""
    return DataLoader(dataset, batch_size=batch_size, drop_last=True)


def pairs_loader(batch_size: int = 4) -> DataLoader:
    return _loader(Pairs(token_rows()), batch_size)


def padded_loader(batch_size: int = 4, left: bool = False) -> DataLoader:
    return _loader(PaddedDicts(token_rows(), left), batch_size)


class ByLastToken(Sampler):
    """A sampler of the user's own: the rows in the order of their last token (a curriculum, an order by length)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.order = torch.argsort(rows[:, -1], stable=True).tolist()

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self):
        return iter(self.order)


def ordered_loader(batch_size: int = 4, rows: int = 64, drop_last: bool = True) -> DataLoader:
    """``rows`` rows of `token_rows` in `ByLastToken`'s order."""
    data = token_rows(rows)
    return DataLoader(Pairs(data), batch_size=batch_size, sampler=ByLastToken(data), drop_last=drop_last)


class HandClippingLM(UserLM):
    """Clips its gradients itself, as many scripts do."""

    def on_before_optimizer_step(self, optimizer) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.5)


class ScaledGradsLM(UserLM):
    """Halves every gradient after each backward (loss scaling by hand): element-wise, so one device's wherever the
    hook sees the gradients one device's hook sees (reduced, or each rank's part inside a window)."""

    def on_after_backward(self) -> None:
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)


class HookCallsLM(UserLM):
    """Counts Lightning's backward hooks (``calls``): one of each per backward, under every layout."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls = {"on_before_backward": 0, "on_after_backward": 0}

    def on_before_backward(self, loss) -> None:
        self.calls["on_before_backward"] += 1

    def on_after_backward(self) -> None:
        self.calls["on_after_backward"] += 1


class AssignedGradLM(UserLM):
    """Replaces the head's gradient before the step (``p.grad = ...``): zero, so the head does not move."""

    def on_before_optimizer_step(self, optimizer) -> None:
        self.head.weight.grad = torch.zeros_like(self.head.weight)


class HandNormLM(UserLM):
    """Divides the gradients by their global norm, written out by hand (no norm function), before the step."""

    def on_before_optimizer_step(self, optimizer) -> None:
        norm = sum((p.grad.detach() ** 2).sum() for p in self.parameters() if p.grad is not None) ** 0.5
        for p in self.parameters():
            if p.grad is not None:
                p.grad.div_(norm + 1e-6)


class ClipAfterBackwardLM(UserLM):
    """Clips by hand after each backward, as some scripts do."""

    def on_after_backward(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)


class UnfrozenLaterLM(UserLM):
    """The embedding frozen for the first optimizer step and trained from the second (gradual unfreezing); with
    ``join``: also out of the optimizer until then, as Lightning's ``BackboneFinetuning`` adds it
    (``add_param_group``)."""

    def __init__(self, join: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.join = join
        self.embed.weight.requires_grad_(False)

    def configure_optimizers(self):
        params = [p for n, p in self.named_parameters() if not (self.join and n.startswith("embed."))]
        return torch.optim.SGD(params, lr=self.lr)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self.trainer.global_step == 1 and not self.embed.weight.requires_grad:
            self.embed.weight.requires_grad_(True)
            if self.join:
                self.trainer.optimizers[0].add_param_group({"params": [self.embed.weight]})


class ManualLM(UserLM):
    """Manual optimization: each batch's two halves backward separately (half the loss each), then one step,
    clipped by the norm."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizer = self.optimizers()
        optimizer.zero_grad()
        for hx, hy in zip(x.chunk(2), y.chunk(2)):
            self.manual_backward(self.loss_fn(self(hx), hy) * 0.5)
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        optimizer.step()


class GainLM(UserLM):
    """A gain of its own, applied to the logits in ``training_step`` (read outside any layer's forward); a buffer
    ``weight_sum`` for `SumWeights`."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.gain = nn.Parameter(torch.ones(()))
        self.register_buffer("weight_sum", torch.zeros(()))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self(x) * self.gain, y)


class SumWeights(L.Callback):
    """Adds the parameters up after every step into the module's ``weight_sum`` (as a weight-averaging callback
    reads them)."""

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        with torch.no_grad():
            pl_module.weight_sum += sum(p.sum() for p in pl_module.parameters())


class TiedLM(UserLM):
    """The LM head tied to the token embedding, held directly by the LightningModule."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.head.weight = self.embed.weight


class Trunk(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TiedTrunkLM(UserLM):
    """The tie inside one submodule (``self.model``)."""

    def __init__(self, layers: int = 2, lr: float = 0.5) -> None:
        L.LightningModule.__init__(self)
        self.lr = lr
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.model = Trunk(layers)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.model.embed, *self.model.blocks, self.model.head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class DropoutBlock(Block):
    """A block with two dropouts, as nn.Dropout modules: on the query projection's output (split by heads under
    TP) and on the attention's output projection (replicated under TP)."""

    def __init__(self, split_p: float, whole_p: float) -> None:
        super().__init__()
        self.drop_split, self.drop_whole = nn.Dropout(split_p), nn.Dropout(whole_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.norm1(x)
        q = self.drop_split(self.q(h)).view(B, T, self.heads, -1).transpose(1, 2)
        k, v = (p(h).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.drop_whole(self.o(y))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class DropoutLM(UserLM):
    """`UserLM` with `DropoutBlock`s."""

    def __init__(self, split_p: float = 0.0, whole_p: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(DropoutBlock(split_p, whole_p) for _ in range(len(self.blocks)))


class LoraUserLM(UserLM):
    """`UserLM` with peft's LoRA on its own linears, chosen by a pattern over their names (the query, value, and both
    MLP projections of every block), as a user adds it in their module; plain SGD (Adam turns the fp32 noise of a
    near-zero adapter gradient into lr-sized updates)."""

    def __init__(self, dropout: float = 0.0, **kwargs) -> None:
        from peft import LoraConfig, inject_adapter_in_model

        super().__init__(**kwargs)
        config = LoraConfig(r=4, lora_alpha=16, init_lora_weights=False, lora_dropout=dropout,
                            target_modules=r"blocks\.\d+\.(q|v|up|down)")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            inject_adapter_in_model(config, self)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)


class DropoutMasks(L.Callback):
    """Keeps, per ``nn.Dropout`` module, the mask of its last call in the first training batch (a boolean tensor,
    True: dropped): the training forward's, after whatever the strategy's first-step checks ran."""

    def __init__(self) -> None:
        self.masks: dict[str, torch.Tensor] = {}
        self._recording = False

    def on_train_start(self, trainer, pl_module) -> None:
        for name, module in pl_module.named_modules():
            if isinstance(module, nn.Dropout):
                module.register_forward_hook(self._keep(name))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._recording = batch_idx == 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._recording = False

    def _keep(self, name: str):
        def hook(module, inputs, output) -> None:
            if module.training and self._recording:
                self.masks[name] = (output == 0).cpu()
        return hook


class SequenceLM(UserLM):
    """Reads the batch as context parallelism hands it (a TokenBatch) and calls ``self(input_ids, position_ids=...)``;
    its blocks are built by ``block`` and its positions are learned (an embedding of each token's position: the
    batch's, or with ``own_positions`` ``torch.arange`` over the tokens it is given)."""

    def __init__(self, block=Block, own_positions: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.own_positions = own_positions
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            self.blocks = nn.ModuleList(block() for _ in range(len(self.blocks)))
            self.positions = nn.Embedding(BLOCK, DIM)

    def forward(self, x: torch.Tensor, position_ids: "torch.Tensor | None" = None) -> torch.Tensor:
        if self.own_positions or position_ids is None:
            position_ids = torch.arange(x.size(1), device=x.device).expand_as(x)
        h = self.embed(x) + self.positions(position_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        from lightning_hybrid.core.batch import TokenBatch

        tokens = TokenBatch.from_batch(batch)
        return self.loss_fn(self(tokens.input_ids, position_ids=tokens.position_ids), tokens.labels)


class WindowBlock(Block):
    """Attention within a window of 4 tokens, by a mask of its own (over the tokens it is given)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        distance = torch.arange(T, device=x.device).unsqueeze(1) - torch.arange(T, device=x.device)
        mask = (distance >= 0) & (distance < 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, T, -1)
        x = x + self.o(y)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ConvBlock(Block):
    """A causal depthwise convolution along the sequence before the attention."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(DIM, DIM, 3, groups=DIM, padding=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.conv(x.transpose(1, 2))[..., : x.size(1)].transpose(1, 2)
        return super().forward(x)


class BatchNormBlock(Block):
    """A BatchNorm over the batch's tokens before the attention (its batch statistics mix the rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.bn(x.transpose(1, 2)).transpose(1, 2))
