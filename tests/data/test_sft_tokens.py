"""Fine-tuning tokens and rows (`lightning_hybrid.data.sft`): the plain format; the trained tokens under real chat
templates (ChatML, Qwen2.5 with tools, Llama 3.1 with tools, Mistral v0.3, Gemma, a ``{% generation %}``
template), each checked against the text written out by hand, and the records whose tokens cannot be located;
packed and padded rows in the batch format (exact ids, labels, masks, positions). Pure and fast: no process
group, no download (the tokenizers are trained here)."""

from __future__ import annotations

import pytest
import torch

from lightning_hybrid.data.corpus import DataError
from lightning_hybrid.data.sft import (
    _located_document,
    _prefix_pieces,
    _renderer,
    batch_statistics,
    pack_documents,
    tokenize_conversation,
)
from tests.data.sft_helpers import (
    CHAT,
    CHATML,
    GEMMA,
    LLAMA3_1,
    MISTRAL_V0_3,
    PARALLEL_CHAT,
    QWEN2_5,
    QWEN2_5_GENERATION,
    TOOL_CHAT,
    TOOLS,
    N,
    _chat_tokenizer,
    _load,
    _prompt_answer,
    _trained_text,
)


# ---------------------------------------------------------------------------------------------- tokens
def test_plain_format_in_bytes_trains_the_answer_only():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    ids, trained = tokenize_conversation(messages)
    assert (ids, trained) == _prompt_answer("hi", "ok")
    assert bytes(ids) == b"<|user|>\nhi\n<|assistant|>\nok\n"
    assert bytes(i for i, t in zip(ids, trained) if t) == b"ok\n"


def test_plain_format_with_tools_and_tool_calls():
    ids, trained = tokenize_conversation(TOOL_CHAT[1:], tools=[{"name": "get_weather"}])
    assert bytes(ids).decode() == (
        '<|tools|>\n[{"name": "get_weather"}]\n<|user|>\nWeather in Paris?\n'
        '<|assistant|>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        "<|tool|>\n22 C\n<|assistant|>\nIt is 22 C in Paris.\n")
    assert bytes(i for i, t in zip(ids, trained) if t).decode() == (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\nIt is 22 C in Paris.\n')


def test_plain_format_with_a_tokenizer_ends_each_answer_with_eos(tmp_path):
    tokenizer = _load(_chat_tokenizer(tmp_path, template=None))
    assert not tokenizer.chat_template
    ids, trained = tokenize_conversation(CHAT[1:3], tokenizer)
    eos = tokenizer.eos_token_id
    assert ids[-1] == eos and trained[-1] and ids.count(eos) == 1
    assert _trained_text(tokenizer, (ids, trained)) == "hi\n<|im_end|>"
    assert tokenizer.decode(ids) == "<|user|>\nhello there\n<|assistant|>\nhi\n<|im_end|>"


def test_chat_template_multi_turn_trains_only_the_assistant_turns(tmp_path):
    tokenizer = _load(_chat_tokenizer(tmp_path))
    ids, trained = tokenize_conversation(CHAT, tokenizer)
    text = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]  # the pieces tokenise as the whole does
    # Each answer: its content and end-of-turn marker; the headers "<|im_start|>assistant\n" are prompt.
    assert _trained_text(tokenizer, (ids, trained)) == "hi<|im_end|>\nwell, thank you<|im_end|>\n"
    runs = [k for k in range(1, len(trained)) if trained[k] != trained[k - 1]]
    assert len(runs) == 3 and trained[-1]  # two answer spans, the second at the end
    assert tokenizer.decode(ids[:runs[0]]).endswith("<|im_start|>assistant\n")


#: (template, conversation, tools, how the mask is found, the trained text written out by hand)
TEMPLATE_CASES = {
    "qwen2.5-tools": (QWEN2_5, TOOL_CHAT, TOOLS, "prefix",
                      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
                      "It is 22 C in Paris.<|im_end|>\n"),
    # Two tool results: the first one's end marker moves once the second follows.
    "qwen2.5-parallel-calls": (QWEN2_5, PARALLEL_CHAT, TOOLS, "located",
                               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
                               "<|im_end|>\nParis 22 C, Rome 25 C.<|im_end|>\n"),
    "qwen2.5-generation-tools": (QWEN2_5_GENERATION, TOOL_CHAT, TOOLS, "generation",
                                 '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
                                 "<|im_end|>\n\nIt is 22 C in Paris.<|im_end|>\n"),
    "llama3.1": (LLAMA3_1, CHAT, None, "prefix", "hi<|eot_id|>well, thank you<|eot_id|>"),
    # The tools go into the first user turn: the system message alone cannot be rendered.
    "llama3.1-tools": (LLAMA3_1, TOOL_CHAT, TOOLS, "located",
                       '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
                       "It is 22 C in Paris.<|eot_id|>"),
    "mistral-v0.3": (MISTRAL_V0_3, CHAT, None, "located", " hi</s> well, thank you</s>"),
    "mistral-v0.3-tools": (MISTRAL_V0_3, TOOL_CHAT + [{"role": "user", "content": "Thanks!"},
                                                      {"role": "assistant", "content": "You are welcome."}], TOOLS,
                           "located", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id":'
                                      ' "call00001"}]</s> It is 22 C in Paris.</s> You are welcome.</s>'),
    "gemma": (GEMMA, CHAT[1:], None, "prefix", "hi<end_of_turn>\nwell, thank you<end_of_turn>\n"),
}


@pytest.mark.parametrize("case", list(TEMPLATE_CASES))
def test_real_templates_train_exactly_the_assistant_tokens(tmp_path, case):
    template, messages, tools, way, expected = TEMPLATE_CASES[case]
    tokenizer = _load(_chat_tokenizer(tmp_path, template))
    document = tokenize_conversation(messages, tokenizer, tools)
    assert _trained_text(tokenizer, document) == expected
    # The tokens are the template's rendering of the whole conversation.
    assert tokenizer.decode(document[0]) == tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    render = _renderer(messages, tools, tokenizer)
    if way != "generation":
        assert (_prefix_pieces(messages, render) is not None) == (way == "prefix")
    if way == "prefix":  # where both apply, the located spans train the same text
        assert _trained_text(tokenizer, _located_document(messages, render, tokenizer)) == expected


def test_a_record_whose_assistant_tokens_cannot_be_located_is_refused(tmp_path):
    # A template that renders an assistant message differently once messages follow it (as templates that drop
    # earlier turns' reasoning do): its span is not in the whole rendering.
    final_mark = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                  "{% if m.role == 'assistant' and loop.last %} (final){% endif %}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tokenizer = _load(_chat_tokenizer(tmp_path / "a", final_mark))
    with pytest.raises(DataError, match=r"^messages\[2\] \(assistant\): the text the chat template renders for it as"
                                        r" the last message, 'hi \(final\)<\|im_end\|>\\n', is not in the rendering"):
        tokenize_conversation(CHAT, tokenizer)
    # One that drops an assistant message that only calls a tool (as some templates drop tool calls).
    drops_calls = CHATML.replace("{% for m in messages %}", "{% for m in messages if m.tool_calls is not defined %}")
    tokenizer = _load(_chat_tokenizer(tmp_path / "b", drops_calls))
    with pytest.raises(DataError, match=r"^messages\[2\] \(assistant\): the chat template's rendering of"
                                        r" messages\[:3\] adds no text after its rendering of messages\[:2\] with the"
                                        " generation prompt"):
        tokenize_conversation(TOOL_CHAT, tokenizer)
    # The template's own refusal.
    tokenizer = _load(_chat_tokenizer(tmp_path / "c", GEMMA))
    with pytest.raises(DataError, match=r"^the chat template failed on messages\[:5\]: TemplateError: System role not"
                                        " supported"):
        tokenize_conversation(CHAT, tokenizer)


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
