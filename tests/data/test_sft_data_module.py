"""The fine-tuning data module (`SFTDataModule`): rows by hand, truncation and its refusal, splits, loaders,
determinism; what is dropped, cut or malformed counted in ``statistics()`` and warned of; tokenizer folders and
chat templates; the ``data=sft`` config with the finetune recipe. Pure and fast: no process group, no download
(the tokenizers are trained here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate

from lightning_hybrid.data.corpus import DataError, statistics_line
from lightning_hybrid.data.sft import SFTDataModule, tokenize_conversation
from lightning_hybrid.runs.config import register_configs
from lightning_hybrid.runs.recipe import ConfigError, check
from tests.data.sft_helpers import (
    CHAT,
    GEMMA,
    MISTRAL_V0_3,
    QWEN2_5,
    TOOL_CHAT,
    TOOLS,
    N,
    _chat_tokenizer,
    _jsonl,
    _load,
    _prompt_answer,
)

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------- data module
def test_module_rows_by_hand_in_bytes(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "response": "ok"}, {"prompt": "a", "response": "bc"},
                                         {"prompt": "val", "response": "x"}])
    data = SFTDataModule(path, block_size=64, batch_size=1, val_fraction=0.3)
    data.setup()
    ids1, ids2 = _prompt_answer("hi", "ok")[0], _prompt_answer("a", "bc")[0]
    assert data.train_rows["input_ids"].tolist() == [ids1 + ids2 + [0] * (64 - len(ids1) - len(ids2))]
    labels = [N] * (len(ids1) - 4) + list(b"ok\n") + [N] + [N] * (len(ids2) - 4) + list(b"bc\n") + [N]
    assert data.train_rows["labels"].tolist() == [labels + [N] * (64 - len(labels))]
    assert data.train_rows["position_ids"][0, len(ids1)].item() == 0  # the second document starts over
    assert data.val_rows["input_ids"][0, :len(_prompt_answer("val", "x")[0])].tolist() == _prompt_answer("val", "x")[0]
    n = len(ids1) + len(ids2)
    assert (data.rows, data.documents, data.tokens, data.loss_tokens) == (1, 2, n, 6)
    assert data.packing_efficiency == pytest.approx(n / 64)
    assert data.vocab_size == 256 and data.pad_token_id == 0

    everything = SFTDataModule(path, block_size=64, batch_size=1, val_fraction=0.3, train_on_prompt=True)
    everything.setup()
    assert everything.loss_tokens == n - 2  # every next token within a document
    padded = SFTDataModule(path, block_size=64, batch_size=1, val_fraction=0.3, pack=False)
    padded.setup()
    assert padded.rows == 2 and padded.train_rows["attention_mask"].sum(1).tolist() == [len(ids1), len(ids2)]


def test_truncation_and_its_refusal(tmp_path):
    long = {"prompt": "p", "response": "y" * 40}
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "response": "b"}, long, {"prompt": "c", "response": "d"}])
    ids = _prompt_answer("p", "y" * 40)[0]
    assert len(ids) == 66
    data = SFTDataModule(path, block_size=32, batch_size=1, val_fraction=0.3)
    with pytest.warns(UserWarning, match=r"^data: cut 1 of 3 records to block_size=32 tokens \(the longest has 66;"):
        data.setup()
    row = data.train_rows["input_ids"][1].tolist()
    assert row == ids[:32] and data.train_rows["labels"][1, -1].item() == N  # cut, its last token untrained
    with pytest.raises(ValueError, match=rf"^{path}:2: the record has 66 tokens, more than block_size=32: raise"
                                         " block_size, or set truncate=true"):
        SFTDataModule(path, block_size=32, batch_size=1, truncate=False).setup()
    with pytest.raises(DataError, match=rf"^{path}:1: the record has 27 tokens, more than block_size=20 \(and 2"
                                        r" more records, the longest with 66 tokens\): raise block_size"):
        SFTDataModule(path, block_size=20, batch_size=1, truncate=False).setup()
    # A prompt longer than the row leaves no trained target: that document is dropped.
    long_prompt = _jsonl(tmp_path / "p.jsonl", [{"prompt": "q" * 40, "response": "r"}, {"prompt": "a", "response": "b"},
                                                {"prompt": "c", "response": "d"}])
    data = SFTDataModule(long_prompt, block_size=32, batch_size=1, val_fraction=0.3)
    with pytest.warns(UserWarning, match=r"^data: dropped 1 of 3 records \(no trained token left after truncation:"
                                         r" 1\)$"):
        data.setup()
    assert data.documents == 1 and data.loss_tokens == 2


def test_splits_by_record_index(tmp_path):
    records = [{"prompt": str(i), "response": "r"} for i in range(20)]
    data = SFTDataModule(_jsonl(tmp_path / "d.jsonl", records), block_size=32, batch_size=2, pack=False)
    data.setup()
    assert data.rows == 19 and len(data.val_rows["input_ids"]) == 1  # 5% of 20
    assert data.val_rows["input_ids"][0].tolist()[:len(_prompt_answer("19", "r")[0])] == _prompt_answer("19", "r")[0]
    two = SFTDataModule(_jsonl(tmp_path / "two.jsonl", records[:2]), block_size=32, batch_size=1, pack=False)
    two.setup()
    assert (two.rows, len(two.val_rows["input_ids"])) == (1, 1)  # at least one record each
    with pytest.raises(ValueError, match=r"the training split makes 1 rows, fewer than batch_size=2"):
        SFTDataModule(_jsonl(tmp_path / "two.jsonl", records[:2]), block_size=32, batch_size=2).setup()


def test_dataloaders_give_dict_batches(tmp_path):
    records = [{"messages": CHAT}] + [{"prompt": "q" * (i % 9), "response": "a" * (i % 5 + 1)} for i in range(39)]
    data = SFTDataModule(_jsonl(tmp_path / "d.jsonl", records), block_size=48, batch_size=4, val_fraction=0.15)
    with pytest.warns(UserWarning, match="dropped 1 of 40 records"):  # the chat: its first answer starts past 48
        data.setup()
    batches = list(data.train_dataloader())
    assert len(batches) == data.rows // 4  # drop_last
    for batch in batches:
        assert sorted(batch) == ["attention_mask", "input_ids", "labels", "position_ids"]
        assert all(v.shape == (4, 48) and v.dtype == torch.int64 for v in batch.values())
    val = list(data.val_dataloader())
    assert len(data.val_rows["input_ids"]) % 4 != 0 and len(val) == len(data.val_rows["input_ids"]) // 4 + 1
    assert sum(len(b["input_ids"]) for b in val) == len(data.val_rows["input_ids"])  # the last batch kept
    assert torch.equal(next(iter(data.test_dataloader()))["input_ids"], val[0]["input_ids"])
    data.load_state_dict({"epoch": 0, "batches": 2})  # a resumed run: the epoch's loader starts after 2 batches
    resumed = list(data.train_dataloader())
    assert len(resumed) == len(batches) - 2 and torch.equal(resumed[0]["input_ids"], batches[2]["input_ids"])


def test_rows_are_deterministic(tmp_path):
    records = [{"prompt": "q" * (i % 7), "response": "a" * (i % 5 + 1)} for i in range(60)]
    path = _jsonl(tmp_path / "d.jsonl", records)

    def rows(**kwargs):
        data = SFTDataModule(path, block_size=40, batch_size=2, shuffle=True, **kwargs)
        data.setup()
        return data.train_rows, [b["input_ids"] for b in data.train_dataloader()]

    (first, order), (second, again) = rows(seed=3), rows(seed=3)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert all(torch.equal(a, b) for a, b in zip(order, again))
    assert not torch.equal(rows(seed=4)[0]["input_ids"], first["input_ids"])


def test_statistics_account_for_every_record(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [
        {"prompt": "a", "response": "b"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "no answer"}]},
        {"prompt": "p", "response": "y" * 40},  # 66 bytes: cut to 48
        {"prompt": "q" * 60, "response": "r"},  # its answer cut away: dropped
        {"prompt": "c", "response": "d"}, {"prompt": "e", "response": "f"},
    ])
    data = SFTDataModule(path, block_size=48, batch_size=1, val_fraction=0.2)
    with pytest.warns(UserWarning) as warned:
        data.setup()
    stats = data.statistics()
    assert json.loads(json.dumps(stats)) == stats  # JSON-serialisable, for metrics.json
    n = [len(_prompt_answer(p, r)[0]) for p, r in (("a", "b"), ("c", "d"), ("e", "f"))]
    assert stats == {
        "tokenizer": "bytes", "records": 6,
        "dropped": {"no assistant turn": 1, "no trained token left after truncation": 1},
        "malformed": [], "truncated": 1, "longest": 86, "block_size": 48,
        # Rows: [a-b], [the cut one: 48 tokens, of which the answer's first 23], [c-d].
        "rows": 3, "documents": 3, "tokens": n[0] + 48 + n[1], "loss_tokens": 2 + 23 + 2,
        "packing_efficiency": (n[0] + 48 + n[1]) / (3 * 48),
        "val_rows": 1, "val_documents": 1, "val_tokens": n[2], "val_loss_tokens": 2,
        "val_packing_efficiency": n[2] / 48,
    }
    assert stats["records"] == stats["documents"] + stats["val_documents"] + sum(stats["dropped"].values())
    assert [str(w.message) for w in warned] == [
        "data: dropped 2 of 6 records (no assistant turn: 1, no trained token left after truncation: 1); cut 1 of 6"
        " records to block_size=48 tokens (the longest has 86; raise data.block_size to keep them whole)"]
    assert statistics_line(stats).startswith(
        "data: tokenizer=bytes records=6 dropped=2 (no assistant turn: 1, no trained token left after truncation: 1)"
        " malformed=0 truncated=1 longest=86 block_size=48 rows=3 documents=3")
    with pytest.raises(RuntimeError, match=r"call setup\(\) before statistics\(\)"):
        SFTDataModule(path).statistics()
    # With the loss on every token, a record without an answer still trains.
    everything = SFTDataModule(path, block_size=48, batch_size=1, val_fraction=0.2, train_on_prompt=True)
    with pytest.warns(UserWarning, match="^data: cut 2 of 6 records"):
        everything.setup()
    assert everything.statistics()["dropped"] == {}


def _malformed_file(tmp_path: Path, bad: int) -> Path:
    """``bad`` malformed lines (alternately bad JSON and a record of no known shape) among 6 good records."""
    lines = [json.dumps({"prompt": f"q{i}", "response": "a"}) for i in range(6)]
    lines += ["{oops" if i % 2 else json.dumps({"text": i}) for i in range(bad)]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_malformed_records_are_one_error_naming_them_all(tmp_path):
    path = _malformed_file(tmp_path, bad=7)
    with pytest.raises(DataError) as error:
        SFTDataModule(path, block_size=64, batch_size=1).setup()
    message = str(error.value)
    assert message.startswith(f"7 of 13 records are malformed (not a chat record, or one the chat template cannot"
                              f" render): {path}:7: a record needs 'messages' (OpenAI chat)")
    assert f"{path}:8: not valid JSON (Expecting property name enclosed in double quotes at column 2); " in message
    assert f"{path}:11: " in message and f"{path}:12: " not in message  # the first five
    assert message.endswith("; and 2 more. Fix them, or set data.skip_malformed=true to skip them (each listed in a"
                            " warning and in statistics()['malformed'])")


def test_skip_malformed_skips_them_aloud(tmp_path):
    path = _malformed_file(tmp_path, bad=23)
    data = SFTDataModule(path, block_size=64, batch_size=1, skip_malformed=True)
    with pytest.warns(UserWarning, match=r"^data: skipped 23 malformed records \(data.skip_malformed=true\):") as w:
        data.setup()
    listed = str(w[0].message).splitlines()[1:]
    assert listed[:2] == [f"  {path}:7: a record needs 'messages' (OpenAI chat), 'conversations' (ShareGPT), or an"
                          " instruction: exactly one of ['prompt', 'instruction'] and one of ['response', 'output',"
                          " 'completion'] ('input' optional); got keys ['text']",
                          f"  {path}:8: not valid JSON (Expecting property name enclosed in double quotes at column 2)"]
    assert len(listed) == 21 and listed[-1] == "  ... and 3 more"
    stats = data.statistics()
    assert len(stats["malformed"]) == 23 and stats["malformed"][22].startswith(f"{path}:29: ")
    assert stats["dropped"] == {"malformed": 23} and stats["records"] == 29
    assert stats["documents"] + stats["val_documents"] == 6


def test_records_the_template_cannot_render_are_malformed(tmp_path):
    folder = _chat_tokenizer(tmp_path / "tok", GEMMA)
    path = _jsonl(tmp_path / "d.jsonl", [{"messages": CHAT[1:]}, {"messages": CHAT}, {"messages": CHAT[1:]}])
    with pytest.raises(DataError, match=rf"^1 of 3 records are malformed .*: {path}:2: the chat template failed on"
                                        r" messages\[:5\]: TemplateError: System role not supported\. Fix them"):
        SFTDataModule(path, tokenizer=folder, block_size=64, batch_size=1, val_fraction=0.3).setup()
    data = SFTDataModule(path, tokenizer=folder, block_size=64, batch_size=1, val_fraction=0.3, skip_malformed=True)
    with pytest.warns(UserWarning, match="skipped 1 malformed records"):
        data.setup()
    assert data.statistics()["malformed"] == [f"{path}:2: the chat template failed on messages[:5]: TemplateError:"
                                              " System role not supported"]


def test_a_folder_without_a_tokenizer_is_bytes_said_aloud(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "response": "b"}] * 2)
    (tmp_path / "weights-only").mkdir()
    with pytest.warns(UserWarning, match=rf"tokenizer: '{tmp_path}/weights-only' has none of the tokenizer files"
                                         r" \['tokenizer.json', .*\]: the fine-tuning data is bytes \(vocabulary 256"):
        data = SFTDataModule(path, tokenizer=tmp_path / "weights-only", block_size=32, batch_size=1)
    assert data.tokenizer is None and data.vocab_size == 256
    data.setup()
    assert data.statistics()["tokenizer"] == f"bytes (no tokenizer files in {tmp_path}/weights-only)"


def test_bad_arguments_fail_at_construction(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "response": "b"}])
    with pytest.raises(FileNotFoundError, match="tokenizer: '/no/such/model' is not a folder"):
        SFTDataModule(path, tokenizer="/no/such/model")
    with pytest.raises(DataError, match="block_size must be > 1 and batch_size > 0, got 1, 8"):
        SFTDataModule(path, block_size=1)
    with pytest.raises(DataError, match=r"val_fraction must be in \[0, 1\), got 1.0"):
        SFTDataModule(path, val_fraction=1.0)


def test_module_with_a_chat_template_masks_the_prompt(tmp_path):
    folder = _chat_tokenizer(tmp_path / "tok")
    path = _jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}] * 3)
    data = SFTDataModule([path], tokenizer=folder, block_size=128, batch_size=1, val_fraction=0.3)
    data.setup()
    tokenizer = _load(folder)
    assert data.vocab_size == len(tokenizer) and data.pad_token_id == tokenizer.eos_token_id
    ids, trained = tokenize_conversation(CHAT, tokenizer)
    assert data.rows == 1 and data.documents == 2 and data.statistics()["tokenizer"] == str(folder)
    row, labels = data.train_rows["input_ids"][0].tolist(), data.train_rows["labels"][0].tolist()
    assert row[:2 * len(ids)] == ids + ids
    expected = [ids[t + 1] if trained[t + 1] else N for t in range(len(ids) - 1)] + [N]
    assert labels[:2 * len(ids)] == expected + expected
    assert tokenizer.decode([x for x in labels[:len(ids)] if x != N]) == "hi<|im_end|>\nwell, thank you<|im_end|>\n"


def test_module_on_tool_calls_from_parquet_under_mistral(tmp_path):
    """OpenAI messages with a tool call and tools, read from Parquet, under Mistral v0.3's template (not
    prefix-consistent): the labels are the assistant's tokens, located in the whole rendering."""
    datasets = pytest.importorskip("datasets")
    folder = _chat_tokenizer(tmp_path / "tok", MISTRAL_V0_3)
    datasets.Dataset.from_list([{"messages": TOOL_CHAT, "tools": json.dumps(TOOLS)}] * 2).to_parquet(
        tmp_path / "d.parquet")
    data = SFTDataModule(tmp_path / "d.parquet", tokenizer=folder, block_size=2048, batch_size=1, val_fraction=0.5)
    data.setup()
    labels = [x for x in data.train_rows["labels"][0].tolist() if x != N]
    assert _load(folder).decode(labels) == ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"},'
                                            ' "id": "call00001"}]</s> It is 22 C in Paris.</s>')


def test_module_on_sharegpt_function_calls_under_qwen(tmp_path):
    folder = _chat_tokenizer(tmp_path / "tok", QWEN2_5)
    record = {"tools": json.dumps(TOOLS), "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
        {"from": "observation", "value": "22 C"}, {"from": "gpt", "value": "It is 22 C in Paris."}]}
    (tmp_path / "d.json").write_text(json.dumps([record] * 2))
    data = SFTDataModule(tmp_path / "d.json", tokenizer=folder, block_size=2048, batch_size=1, val_fraction=0.5)
    data.setup()
    labels = [x for x in data.train_rows["labels"][0].tolist() if x != N]
    assert _load(folder).decode(labels) == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                            "</tool_call><|im_end|>\nIt is 22 C in Paris.<|im_end|>\n")


# ---------------------------------------------------------------------------------------------- config
def _compose_finetune(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="finetune", overrides=list(overrides))


def test_sft_config_composes_with_the_finetune_recipe(tmp_path):
    folder = _chat_tokenizer(tmp_path / "model")
    path = _jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}] * 40)
    cfg = _compose_finetune(f"model.model={folder}", "data=sft", f"data.path={path}", "data.batch_size=2",
                            "seed=5")
    assert cfg.data.tokenizer == str(folder) and cfg.data.block_size == 1024 and cfg.data.seed == 5
    assert cfg.data.skip_malformed is False
    data = instantiate(cfg.data)
    assert isinstance(data, SFTDataModule) and data.tokenizer is not None and data.paths == [str(path)]
    data.setup()
    assert data.rows > 0 and data.block_size == 1024 and data.statistics()["truncated"] == 0
    with pytest.raises(ConfigCompositionException):
        _compose_finetune(f"model.model={folder}", "data=sft", f"data.path={path}", "data.pakc=false")
    with pytest.raises(ConfigError, match=r"^data.path is required"):
        check(_compose_finetune(f"model.model={folder}", "data=sft"))
    assert check(_compose_finetune(f"model.model={folder}", "data=sft", f"data.path={path}", "parallel=dp_pp"))[
        "devices"] == 4  # the SFT module's arguments checked against its signature, before any process starts
