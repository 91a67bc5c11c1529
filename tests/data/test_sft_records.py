"""Fine-tuning records (`lightning_hybrid.data.chat_formats`): the record shapes users have (OpenAI messages with
tools and tool calls, ShareGPT, instructions) read, or refused with their place, what is wrong and what is
valid; the files they come in (JSON lines, JSON arrays, gzip, Parquet / Arrow / save_to_disk through
``datasets``), checked at construction. Pure and fast: no process group, no download."""

from __future__ import annotations

import functools
import gzip
import json
import re
import sys

import pytest

from lightning_hybrid.data.chat_formats import check_paths, parse_record, read_records
from lightning_hybrid.data.corpus import DataError
from lightning_hybrid.data.sft import SFTDataModule
from tests.data.sft_helpers import CHAT, TOOLS, _call, _jsonl


# ---------------------------------------------------------------------------------------------- records
def test_records_chat_and_instruction(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [
        {"messages": CHAT},
        {"instruction": "Add.", "input": "1 + 2", "output": "3", "id": 7},  # extra keys are ignored
        {"prompt": "Say hi.", "completion": "hi"},
    ], raw_lines=("\n", "   \n"))
    records, malformed = read_records(path)
    assert [r.where for r in records] == [f"{path}:1", f"{path}:2", f"{path}:3"] and malformed == []
    assert records[0].messages == CHAT and records[0].tools is None
    assert records[1].messages == [{"role": "user", "content": "Add.\n\n1 + 2"}, {"role": "assistant", "content": "3"}]
    assert records[2].messages == [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]


def test_openai_records_with_tools_content_parts_and_tool_calls():
    record = {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}]},
        {"role": "user", "content": "Weather in Paris?", "name": None},  # null: absent (an Arrow row's empty key)
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "22 C"},
        {"role": "assistant", "content": "22 C.", "tool_calls": [], "reasoning_content": "easy"},
    ], "tools": json.dumps(TOOLS)}  # tools as a JSON string, as datasets files hold them
    messages, tools = parse_record(record)
    assert tools == TOOLS
    assert messages == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": record["messages"][2]["tool_calls"]},  # as given: arguments a string
        {"role": "tool", "tool_call_id": "c1", "content": "22 C"},
        {"role": "assistant", "content": "22 C.", "reasoning_content": "easy"},  # other keys kept for the template
    ]


def test_sharegpt_records():
    record = {"system": "Be brief.", "tools": TOOLS, "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
        {"from": "observation", "value": "22 C"},
        {"from": "gpt", "value": "22 C."},
        {"from": "user", "value": "And Rome and Oslo?"},
        {"from": "function_call", "value": json.dumps([{"name": "get_weather", "arguments": {"city": c}}
                                                       for c in ("Rome", "Oslo")])},
        {"from": "tool", "value": "25 C"}, {"from": "tool", "value": "5 C"},
        {"from": "assistant", "value": "25 C and 5 C."},
    ]}
    messages, tools = parse_record(record)
    call = functools.partial(dict, type="function")
    assert tools == TOOLS
    assert messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [call(function={"name": "get_weather", "arguments": {"city": "Paris"}})]},
        {"role": "tool", "content": "22 C"}, {"role": "assistant", "content": "22 C."},
        {"role": "user", "content": "And Rome and Oslo?"},
        {"role": "assistant", "tool_calls": [call(function={"name": "get_weather", "arguments": {"city": c}})
                                             for c in ("Rome", "Oslo")]},
        {"role": "tool", "content": "25 C"}, {"role": "tool", "content": "5 C"},
        {"role": "assistant", "content": "25 C and 5 C."},
    ]
    # ShareGPT's list may hold OpenAI messages too.
    assert parse_record({"conversations": CHAT}) == (CHAT, None)


@pytest.mark.parametrize("line, why", [
    ("{not json", r"not valid JSON \(Expecting property name enclosed in double quotes at column 2\)"),
    ("[1, 2]", "got a JSON list, not an object"),
    ('{"text": "plain"}', r"a record needs 'messages' \(OpenAI chat\), 'conversations' \(ShareGPT\), or an"
                          r" instruction: exactly one of \['prompt', 'instruction'\] .* got keys \['text'\]"),
    ('{"prompt": "a", "instruction": "b", "response": "c"}', r"a record needs .* got keys \['instruction', 'prompt',"),
    ('{"prompt": "a", "response": 3}', "'response' must be a string, got 3"),
    ('{"messages": []}', "'messages' must be a non-empty list of messages"),
    ('{"messages": [{"role": "bot", "content": "x"}]}',
     r"messages\[0\] = .* must have a 'role', one of \['system', 'user', 'assistant', 'tool'\] \(or ShareGPT's"),
    ('{"conversations": [{"from": "bot", "value": "x"}]}',
     r"conversations\[0\]: 'from' = 'bot' is none of \['system', 'human', 'user', 'gpt', 'assistant',"
     r" 'function_call', 'tool', 'observation'\]"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
     r"messages\[0\].content\[0\] is a 'image_url' part: only text parts"),
    ('{"messages": [{"role": "user"}]}', r"messages\[0\] has no 'content'"),
    ('{"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}',
     r"messages\[0\]: a user message has 'tool_calls': only an assistant's may"),
    ('{"messages": [{"role": "assistant", "tool_calls": [{"name": "f", "arguments": {}}]}]}',
     r"messages\[0\].tool_calls\[0\] = .* must be {\"type\": \"function\", \"function\": {\"name\": str,"),
    ('{"conversations": [{"from": "function_call", "value": "f(x)"}]}',
     r'conversations\[0\]: a "function_call" value must be JSON {"name": str, "arguments": ...}'),
    ('{"messages": [{"role": "user", "content": "x"}], "tools": "nope"}', r"'tools' is a string but not JSON"),
    ('{"messages": [{"role": "user", "content": "x"}], "tools": [1]}', r"'tools' = \[1\] must be a list of tool"),
])
def test_a_bad_record_names_its_place_what_is_wrong_and_what_is_valid(tmp_path, line, why):
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "response": "b"}], raw_lines=("\n", line + "\n"))
    records, malformed = read_records(path)
    assert len(records) == 1 and len(malformed) == 1
    assert re.match(rf"^{re.escape(str(path))}:3: {why}", malformed[0]), malformed[0]


# ---------------------------------------------------------------------------------------------- files
def test_json_arrays_json_lines_and_gzip(tmp_path):
    good, bad = {"prompt": "a", "response": "b"}, {"text": "x"}
    array = tmp_path / "array.json"
    array.write_text(json.dumps([good, bad, good], indent=2))  # pretty-printed: items, not lines
    lines_in_json = _jsonl(tmp_path / "lines.json", [good, good])
    zipped = tmp_path / "z.jsonl.gz"
    zipped.write_bytes(gzip.compress(b"\n" + json.dumps(good).encode() + b"\n{oops\n"))
    records, malformed = read_records([array, lines_in_json, zipped])
    assert [r.where for r in records] == [f"{array}:row 0", f"{array}:row 2", f"{lines_in_json}:1",
                                          f"{lines_in_json}:2", f"{zipped}:2"]
    assert [m.split(": ")[0] for m in malformed] == [f"{array}:row 1", f"{zipped}:3"]
    broken = tmp_path / "broken.json"
    broken.write_text('[{"prompt": "a"},\n')
    with pytest.raises(DataError, match=rf"^{broken}: not a valid JSON array \(Expecting value at line 2 column 1\);"
                                        " a .json file holds one JSON array of records, or one record per line"):
        read_records(broken)


def test_datasets_files_parquet_arrow_and_save_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"messages": [{"role": "user", "content": "Weather?"},
                          {"role": "assistant", "content": None, "tool_calls": [_call("Paris")]}]},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]},
            {"messages": [{"role": "bot", "content": "x"}]}]
    for row in rows:  # Arrow's columns: the arguments as JSON strings, as such files hold them
        for m in row["messages"]:
            for call in m.get("tool_calls") or ():
                call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    dataset = datasets.Dataset.from_list(rows)
    dataset.to_parquet(tmp_path / "d.parquet")
    dataset.save_to_disk(tmp_path / "saved")
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for path in (tmp_path / "d.parquet", tmp_path / "saved", arrow):
        records, malformed = read_records(path)
        assert [r.where for r in records] == [f"{path}:row 0", f"{path}:row 1"]
        # The rows' nulls (Arrow fills every struct's fields) are absent keys again.
        assert records[0].messages == [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [
            {"type": "function", "id": "call00001",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
        assert records[1].messages == rows[1]["messages"]
        assert len(malformed) == 1 and malformed[0].startswith(f"{path}:row 2: messages[0] = ")
    datasets.DatasetDict(train=dataset, test=dataset).save_to_disk(tmp_path / "dict")
    with pytest.raises(DataError, match=r"a DatasetDict with splits \['train', 'test'\]: give one split's folder, e.g."
                                        rf" '{tmp_path}/dict/train'"):
        read_records(tmp_path / "dict")


def test_paths_are_checked_at_construction(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="path: '/no/such.jsonl' is not a file or folder"):
        SFTDataModule("/no/such.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=rf"path: '{tmp_path}/d.csv' is none of the files read: a name ending in"
                                        " .jsonl, .jsonl.gz, .json, .json.gz, .parquet, .arrow, or a"):
        SFTDataModule(tmp_path / "d.csv")
    with pytest.raises(DataError, match=rf"path: '{tmp_path}' is a folder that Dataset.save_to_disk did not write"):
        SFTDataModule(tmp_path)
    with pytest.raises(DataError, match="path: no file given"):
        SFTDataModule([])
    (tmp_path / "d.parquet").write_bytes(b"")
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else find_spec(name))
    with pytest.raises(DataError, match=r"is read with the datasets library, which is not installed: pip install"
                                        r" 'lightning-hybrid\[data\]' \(or pip install datasets\)"):
        check_paths([tmp_path / "d.parquet"])
    monkeypatch.setitem(sys.modules, "datasets", None)  # imported when read: the same words
    with pytest.raises(DataError, match=r"needs the datasets library: pip install 'lightning-hybrid\[data\]'"):
        read_records(tmp_path / "d.parquet")
