"""Fine-tuning data (`lightning_hybrid.sft`): records read and refused, the plain format and a chat template masked
to the answers, packed and padded rows in the batch format (exact ids, labels, masks, positions), truncation, the
data module's loaders, splits and statistics, and the ``data=sft`` config. Pure and fast: no process group, no
download (the tokenizers are trained here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate

from lightning_hybrid.config import register_configs
from lightning_hybrid.recipe import ConfigError, check
from lightning_hybrid.sft import (
    IGNORE_INDEX,
    SFTDataModule,
    batch_statistics,
    pack_documents,
    read_records,
    tokenize_conversation,
)

ROOT = Path(__file__).resolve().parents[1]
N = IGNORE_INDEX
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hi"}, {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "well, thank you"}]


def _jsonl(path: Path, records: list, raw_lines: tuple = ()) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "".join(raw_lines))
    return path


def _prompt_answer(prompt: str, answer: str) -> tuple[list[int], list[bool]]:
    """The plain format by hand, in bytes: header and prompt untrained, the answer and its newline trained."""
    head = f"<|user|>\n{prompt}\n<|assistant|>\n".encode()
    tail = f"{answer}\n".encode()
    return list(head + tail), [False] * len(head) + [True] * len(tail)


def _chat_tokenizer(folder: Path, template: str = CHATML) -> Path:
    """A byte-level BPE tokenizer trained here, with ChatML's special tokens (eos ``<|im_end|>``) and ``template``."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = " ".join(m["content"] for m in CHAT) + " system user assistant" * 20
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>")
    fast.chat_template = template
    fast.save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------------------------------- records
def test_records_chat_and_instruction(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [
        {"messages": CHAT},
        {"instruction": "Add.", "input": "1 + 2", "output": "3", "id": 7},  # extra keys are ignored
        {"prompt": "Say hi.", "completion": "hi"},
    ], raw_lines=("\n", "   \n"))
    records = read_records(path)
    assert [r.where for r in records] == [f"{path}:1", f"{path}:2", f"{path}:3"]
    assert records[0].messages == CHAT
    assert records[1].messages == [{"role": "user", "content": "Add.\n\n1 + 2"}, {"role": "assistant", "content": "3"}]
    assert records[2].messages == [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]


@pytest.mark.parametrize("line, why", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "got a JSON list, not an object"),
    ('{"text": "plain"}', r"needs exactly one of \['prompt', 'instruction'\]"),
    ('{"prompt": "a", "instruction": "b", "response": "c"}', "needs exactly one of"),
    ('{"prompt": "a", "response": 3}', "'response' must be a string"),
    ('{"messages": []}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', r"messages\[0\] = .* must be .*'system', 'user', 'assistant'"),
])
def test_a_bad_line_names_file_line_and_what_is_valid(tmp_path, line, why):
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "response": "b"}], raw_lines=("\n", line + "\n"))
    with pytest.raises(ValueError, match=rf"^{path}:3: .*{why}.*each line is one JSON object: {{\"messages\""):
        read_records(path)


# ---------------------------------------------------------------------------------------------- tokens
def test_plain_format_in_bytes_trains_the_answer_only():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    ids, trained = tokenize_conversation(messages)
    assert (ids, trained) == _prompt_answer("hi", "ok")
    assert bytes(ids) == b"<|user|>\nhi\n<|assistant|>\nok\n"
    assert bytes(i for i, t in zip(ids, trained) if t) == b"ok\n"


def test_plain_format_with_a_tokenizer_ends_each_answer_with_eos(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(_chat_tokenizer(tmp_path, template=None))
    assert not tokenizer.chat_template
    ids, trained = tokenize_conversation(CHAT[1:3], tokenizer)
    eos = tokenizer.eos_token_id
    assert ids[-1] == eos and trained[-1] and ids.count(eos) == 1
    answer = [i for i, t in zip(ids, trained) if t]
    assert tokenizer.decode(answer) == "hi\n<|im_end|>"
    assert tokenizer.decode(ids) == "<|user|>\nhello there\n<|assistant|>\nhi\n<|im_end|>"


def test_chat_template_multi_turn_trains_only_the_assistant_turns(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(_chat_tokenizer(tmp_path))
    ids, trained = tokenize_conversation(CHAT, tokenizer)
    text = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]  # the pieces tokenise as the whole does
    # Each answer: its content and end-of-turn marker; the headers "<|im_start|>assistant\n" are prompt.
    answers = [i for i, t in zip(ids, trained) if t]
    assert tokenizer.decode(answers) == "hi<|im_end|>\nwell, thank you<|im_end|>\n"
    runs = [k for k in range(1, len(trained)) if trained[k] != trained[k - 1]]
    assert len(runs) == 3 and trained[-1]  # two answer spans, the second at the end
    assert tokenizer.decode(ids[:runs[0]]).endswith("<|im_start|>assistant\n")


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    marks_last = "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}\n{% endfor %}"
    folder = _chat_tokenizer(tmp_path / "tok", template=marks_last)
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "hello", "response": "hi"}] * 2)
    data = SFTDataModule(path, tokenizer=folder, block_size=32, batch_size=1)
    with pytest.raises(ValueError, match=rf"^{path}:1: the chat template is not prefix-consistent: .*differ at"
                                         r" character 0: 'LAST hello\\n' vs 'hello\\nLAST hi\\n'"):
        data.setup()


# ---------------------------------------------------------------------------------------------- rows
def test_packing_positions_labels_and_masks():
    a = ([10, 11, 12], [False, True, True])
    b = ([20, 21], [False, True])
    rows = pack_documents([a, b], block_size=7, pad_id=0)
    assert {k: v.dtype for k, v in rows.items()} == dict.fromkeys(rows, torch.int64)
    assert rows["input_ids"].tolist() == [[10, 11, 12, 20, 21, 0, 0]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 0]]
    assert rows["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0]]
    assert rows["labels"].tolist() == [[11, 12, N, 21, N, N, N]]
    # A prompt token as target: no loss on it.
    prompt_first = pack_documents([([10, 11, 12], [False, False, True])], block_size=4, pad_id=9)
    assert prompt_first["labels"].tolist() == [[N, 12, N, N]]
    assert prompt_first["input_ids"].tolist() == [[10, 11, 12, 9]]


def test_packing_is_greedy_in_order():
    docs = [([k] * n, [True] * n) for k, n in enumerate([3, 2, 4, 1, 6], start=1)]
    rows = pack_documents(docs, block_size=6, pad_id=0)
    # [3, 2] leaves 1: the 4 starts a new row, the 1 joins it (not the first row), the 6 fills a row of its own.
    assert rows["input_ids"].tolist() == [[1, 1, 1, 2, 2, 0], [3, 3, 3, 3, 4, 0], [5] * 6]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 4, 5]]
    assert rows["labels"].tolist() == [[1, 1, N, 2, N, N], [3, 3, 3, N, N, N], [5, 5, 5, 5, 5, N]]
    assert batch_statistics(rows) == {"rows": 3, "documents": 5, "tokens": 16, "loss_tokens": 11,
                                      "packing_efficiency": 16 / 18}


def test_padding_mode_is_one_document_per_row():
    rows = pack_documents([([10, 11, 12], [False, True, True]), ([20, 21], [True, True])], block_size=4, pad_id=7,
                          pack=False)
    assert rows["input_ids"].tolist() == [[10, 11, 12, 7], [20, 21, 7, 7]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 0, 0]]
    assert rows["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert rows["labels"].tolist() == [[11, 12, N, N], [21, N, N, N]]


@pytest.mark.parametrize("doc", [([], []), ([1, 2, 3, 4, 5], [True] * 5), ([1, 2], [True])])
def test_pack_documents_refuses_what_does_not_fit(doc):
    with pytest.raises(ValueError, match=r"document 1 has \d tokens and \d flags: it needs 1 to block_size=4"):
        pack_documents([([1], [True]), doc], block_size=4, pad_id=0)


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
    data.setup()
    row = data.train_rows["input_ids"][1].tolist()
    assert row == ids[:32] and data.train_rows["labels"][1, -1].item() == N  # cut, its last token untrained
    with pytest.raises(ValueError, match=rf"^{path}:2: the record has 66 tokens, more than block_size=32: raise"
                                         " block_size, or set truncate=true"):
        SFTDataModule(path, block_size=32, batch_size=1, truncate=False).setup()
    # A prompt longer than the row leaves no trained target: that document is dropped.
    long_prompt = _jsonl(tmp_path / "p.jsonl", [{"prompt": "q" * 40, "response": "r"}, {"prompt": "a", "response": "b"},
                                                {"prompt": "c", "response": "d"}])
    data = SFTDataModule(long_prompt, block_size=32, batch_size=1, val_fraction=0.3)
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


def test_bad_arguments_fail_at_construction(tmp_path):
    with pytest.raises(FileNotFoundError, match="path: '/no/such.jsonl' is not a file"):
        SFTDataModule("/no/such.jsonl")
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "response": "b"}])
    with pytest.raises(FileNotFoundError, match="tokenizer: '/no/such/model' is not a folder"):
        SFTDataModule(path, tokenizer="/no/such/model")
    (tmp_path / "weights-only").mkdir()
    assert SFTDataModule(path, tokenizer=tmp_path / "weights-only").tokenizer is None  # bytes


def test_module_with_a_chat_template_masks_the_prompt(tmp_path):
    from transformers import AutoTokenizer

    folder = _chat_tokenizer(tmp_path / "tok")
    path = _jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}] * 3)
    data = SFTDataModule([path], tokenizer=folder, block_size=128, batch_size=1, val_fraction=0.3)
    data.setup()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert data.vocab_size == len(tokenizer) and data.pad_token_id == tokenizer.eos_token_id
    ids, trained = tokenize_conversation(CHAT, tokenizer)
    assert data.rows == 1 and data.documents == 2
    row, labels = data.train_rows["input_ids"][0].tolist(), data.train_rows["labels"][0].tolist()
    assert row[:2 * len(ids)] == ids + ids
    expected = [ids[t + 1] if trained[t + 1] else N for t in range(len(ids) - 1)] + [N]
    assert labels[:2 * len(ids)] == expected + expected
    assert tokenizer.decode([x for x in labels[:len(ids)] if x != N]) == "hi<|im_end|>\nwell, thank you<|im_end|>\n"


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
    assert cfg.data.tokenizer == str(folder) and cfg.data.block_size == 64 and cfg.data.seed == 5
    data = instantiate(cfg.data)
    assert isinstance(data, SFTDataModule) and data.tokenizer is not None and data.paths == [str(path)]
    data.setup()
    assert data.rows > 0 and data.block_size == 64
    with pytest.raises(ConfigCompositionException):
        _compose_finetune(f"model.model={folder}", "data=sft", f"data.path={path}", "data.pakc=false")
    with pytest.raises(ConfigError, match=r"^data.path is required"):
        check(_compose_finetune(f"model.model={folder}", "data=sft"))
    assert check(_compose_finetune(f"model.model={folder}", "data=sft", f"data.path={path}", "parallel=dp_pp"))[
        "devices"] == 4  # the SFT module's arguments checked against its signature, before any process starts


def test_finetune_recipe_on_chat_jsonl_end_to_end(tmp_path):
    from transformers import AutoTokenizer

    from tests.test_recipes import TINY, _check_metrics, _pretrained_folder_with_tokenizer, _run

    folder = _pretrained_folder_with_tokenizer(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)  # its 256 tokens are the model's vocabulary: no new ones
    tokenizer.chat_template = ("{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n\n{% endfor %}"
                               "{% if add_generation_prompt %}### assistant:\n{% endif %}")
    tokenizer.save_pretrained(folder)
    records = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                             {"role": "assistant", "content": f"{2 * i}."}]} for i in range(200)]
    path = _jsonl(tmp_path / "chat.jsonl", records)
    run_dir = tmp_path / "run"
    tiny = [o for o in TINY if not o.startswith("data.max_bytes")]  # a corpus option the SFT data has not
    res = _run([f"model.model={folder}", "data=sft", f"data.path={path}", "parallel=dp_pp", *tiny,
                f"hydra.run.dir={run_dir}"], cwd=tmp_path, recipe=ROOT / "recipes" / "finetune.py")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = _check_metrics(run_dir / "metrics.json", "dp2xtp1xpp2", 4)
    assert m["model"] == "lightning_hybrid.hf.CausalLM"
