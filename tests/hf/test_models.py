"""Tests of the reference GPT and its LightningModule (single process, CPU)."""

import lightning as L
import pytest
import torch

from lightning_hybrid.data.corpus import ByteCorpusDataModule
from lightning_hybrid.models import GPT, GPTConfig, GPTLightningModule
from lightning_hybrid.models.gpt import CausalSelfAttention
from tests.helpers import QUIET_TRAINER

TINY = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32)


def _idx(B=2, T=16, V=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g)


def test_output_shape():
    model = GPT(GPTConfig(**TINY))
    logits = model(_idx(2, 16))
    assert logits.shape == (2, 16, 256)
    assert logits.dtype == torch.float32


def test_full_block_size_and_too_long_raises():
    model = GPT(GPTConfig(**TINY))
    assert model(_idx(1, 32)).shape == (1, 32, 256)
    with pytest.raises(ValueError, match="block_size"):
        model(_idx(1, 33))


def test_gqa():
    cfg = GPTConfig(**{**TINY, "n_kv_head": 2})
    model = GPT(cfg)
    attn = model.blocks[0].attn
    assert (attn.n_head, attn.n_kv_head, attn.head_dim) == (4, 2, 8)
    assert attn.q_proj.weight.shape == (32, 32)
    assert attn.k_proj.weight.shape == (16, 32)
    assert attn.v_proj.weight.shape == (16, 32)
    assert [n for n, _ in attn.named_children()][:4] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert model(_idx()).shape == (2, 16, 256)


def test_gqa_matches_explicit_repeated_kv_heads():
    """GQA == MHA whose k/v weights repeat each kv head's rows."""
    torch.manual_seed(0)
    gqa = CausalSelfAttention(GPTConfig(**{**TINY, "n_kv_head": 2})).eval()
    mha = CausalSelfAttention(GPTConfig(**TINY)).eval()
    with torch.no_grad():
        mha.q_proj.load_state_dict(gqa.q_proj.state_dict())
        mha.o_proj.load_state_dict(gqa.o_proj.state_dict())
        for name in ("k_proj", "v_proj"):
            src, dst = getattr(gqa, name), getattr(mha, name)
            dst.weight.copy_(src.weight.view(2, 1, 8, 32).expand(2, 2, 8, 32).reshape(32, 32))
            dst.bias.copy_(src.bias.view(2, 1, 8).expand(2, 2, 8).reshape(32))
    x = torch.randn(2, 10, 32)
    torch.testing.assert_close(gqa(x), mha(x))


def test_attention_is_causal():
    model = GPT(GPTConfig(**TINY)).eval()
    idx = _idx(1, 12)
    idx2 = idx.clone()
    idx2[0, 8:] = (idx2[0, 8:] + 1) % 256
    torch.testing.assert_close(model(idx)[:, :8], model(idx2)[:, :8])


def test_sharded_heads_forward():
    """Forward infers head counts from tensors: a layer with half the heads works."""
    attn = CausalSelfAttention(GPTConfig(**{**TINY, "n_kv_head": 2}))
    attn.q_proj = torch.nn.Linear(32, 16)  # 2 of 4 query heads
    attn.k_proj = torch.nn.Linear(32, 8)  # 1 of 2 kv heads
    attn.v_proj = torch.nn.Linear(32, 8)
    attn.o_proj = torch.nn.Linear(16, 32)
    attn.n_head, attn.n_kv_head = 2, 1
    assert attn(torch.randn(2, 5, 32)).shape == (2, 5, 32)


def test_swiglu():
    model = GPT(GPTConfig(**{**TINY, "mlp": "swiglu"}))
    mlp = model.blocks[0].mlp
    assert [n for n, _ in mlp.named_children()][:3] == ["gate_proj", "up_proj", "down_proj"]
    assert mlp.gate_proj.weight.shape == (128, 32)
    assert mlp.down_proj.weight.shape == (32, 128)
    assert model(_idx()).shape == (2, 16, 256)


def test_init():
    model = GPT(GPTConfig(**{**TINY, "n_layer": 8, "n_embd": 64}))
    assert model.head.lm_head.bias is None
    assert model.head.lm_head.weight.data_ptr() != model.embed.tok_emb.weight.data_ptr()
    b = model.blocks[0]
    assert torch.all(b.attn.q_proj.bias == 0)
    # Residual projections use the scaled std 0.02 / sqrt(2 * n_layer) = 0.005.
    assert abs(b.mlp.fc2.weight.std().item() - 0.005) < 0.0015
    assert abs(b.mlp.fc1.weight.std().item() - 0.02) < 0.003


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_embd=30, n_head=4), "n_embd=30"),
        (dict(n_head=4, n_kv_head=3), "n_kv_head=3"),
        (dict(mlp="relu"), "relu"),
        (dict(n_layer=0), "n_layer"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_config_defaults():
    cfg = GPTConfig()
    assert cfg.n_kv_head == cfg.n_head == 4
    assert (cfg.vocab_size, cfg.block_size, cfg.n_embd, cfg.head_dim) == (256, 64, 64, 16)


def test_lightning_module_same_seed_same_weights():
    a = GPTLightningModule(**TINY, init_seed=3)
    b = GPTLightningModule(GPTConfig(**TINY), init_seed=3)
    assert a.model is None
    rng_before = torch.random.get_rng_state()
    torch.manual_seed(123)  # global RNG must not matter ...
    a.configure_model()
    torch.manual_seed(456)
    b.configure_model()
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    # ... and a second call is a no-op.
    model = a.model
    a.configure_model()
    assert a.model is model
    c = GPTLightningModule(**TINY, init_seed=4)
    c.configure_model()
    assert not torch.equal(c.model.head.lm_head.weight, a.model.head.lm_head.weight)
    torch.random.set_rng_state(rng_before)


def test_configure_model_leaves_global_rng_alone():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    GPTLightningModule(**TINY).configure_model()
    torch.testing.assert_close(torch.rand(3), expected)


def test_hparams_roundtrip():
    m = GPTLightningModule(**TINY, lr=1e-3)
    assert m.hparams.lr == 1e-3
    assert m.hparams.config["n_embd"] == 32
    m2 = GPTLightningModule(**m.hparams)
    assert m2.config == m.config


def test_optimizer_groups_and_warmup():
    m = GPTLightningModule(**TINY, warmup_steps=4, weight_decay=0.1)
    m.configure_model()
    conf = m.configure_optimizers()
    opt = conf["optimizer"]
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
    n = sum(len(g["params"]) for g in opt.param_groups)
    assert n == len(list(m.model.parameters()))
    assert conf["lr_scheduler"]["interval"] == "step"
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-3 / 4)

    m0 = GPTLightningModule(**TINY)
    m0.configure_model()
    assert isinstance(m0.configure_optimizers(), torch.optim.AdamW)


class _LossRecorder(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def test_tiny_fit_loss_decreases_and_validates():
    dm = ByteCorpusDataModule(max_bytes=50_000, block_size=32, batch_size=4)
    model = GPTLightningModule(
        vocab_size=dm.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=32, lr=3e-3
    )
    rec = _LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=5,
        limit_val_batches=2,
        val_check_interval=5,
        num_sanity_val_steps=0,
        **QUIET_TRAINER,
        callbacks=[rec],
    )
    trainer.fit(model, datamodule=dm)
    assert len(rec.losses) == 5
    assert rec.losses[-1] < rec.losses[0]
    metrics = trainer.callback_metrics
    assert "val_loss" in metrics and "val_acc" in metrics
    assert torch.isfinite(metrics["val_loss"])
    assert 0.0 <= float(metrics["val_acc"]) <= 1.0


@pytest.mark.parametrize("config", [dict(), dict(mlp="swiglu", n_kv_head=2)])
def test_flops_per_token(config):
    """6 FLOPs per matmul weight per token (forward + backward), as torch's FLOP counter measures them, plus the
    attention term 12 * n_layer * n_embd * T (scores and weighted values, forward + backward)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, **config))
    idx = torch.randint(256, (3, 16))
    with FlopCounterMode(display=False) as counter:
        model(idx).sum().backward()
    matmuls = sum(n for op, n in counter.get_flop_counts()["Global"].items() if str(op) in ("aten.mm", "aten.addmm"))
    attention = 12 * 2 * 32 * 16
    assert model.flops_per_token(16) * idx.numel() == matmuls + attention * idx.numel()
