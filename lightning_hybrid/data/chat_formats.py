"""Chat records as users have them: the files they come in and the shapes of the records, read into messages.

Files (`read_records`; `check_paths` at configuration time): those of `lightning_hybrid.data.record_files` --
``.jsonl``, ``.jsonl.gz``, ``.json`` (an array, or JSON lines), ``.json.gz``, and with the ``datasets`` library
``.parquet``, ``.arrow`` and ``Dataset.save_to_disk`` folders -- each record located as ``file:line`` or
``file:row N``.

Records (`parse_record`), each read into messages ``{"role": "system" | "user" | "assistant" | "tool", ...}`` and
the record's tools:

* OpenAI chat: ``{"messages": [...], "tools": [...] (optional)}``. ``content`` is a string, absent / null (an
  assistant message with only ``tool_calls``), or a list of parts ``{"type": "text", "text": str}`` joined with
  newlines (as vLLM joins them for a text-only model); an assistant's ``tool_calls`` are OpenAI's
  ``[{"type": "function", "function": {"name": str, "arguments": str | object}, "id": str}]``; a tool message
  carries ``tool_call_id`` and / or ``name``. Messages and tools are kept as given (other keys too, e.g. a
  template's ``reasoning_content``) but for keys whose value is null, which are dropped: Arrow rows hold null where
  a record had no such key;
* ShareGPT: ``{"conversations": [{"from": ..., "value": str}, ...], "system": str (optional), "tools": ...
  (optional)}``: ``system`` -> system, ``human`` / ``user`` -> user, ``gpt`` / ``assistant`` -> assistant,
  ``tool`` / ``observation`` -> tool, ``function_call`` -> an assistant message whose ``tool_calls`` are its value,
  JSON ``{"name": str, "arguments": ...}`` or a list of them; the record's ``system`` string is a first system
  message. ``conversations`` may also hold OpenAI messages;
* instruction: ``{"prompt" | "instruction": str, "input": str (optional), "response" | "output" | "completion":
  str}``, read as ``[user: instruction (+ "\\n\\n" + input), assistant: response]``.

``tools`` is a list of tool schemas, or a JSON string of one (as ``datasets`` files often store it). A record of
none of these shapes, or with a bad role or value, is a `DataError` saying what is wrong and what is valid;
`read_records` collects them (``"file:line: why"``) instead of stopping at the first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from lightning_hybrid.data.record_files import FILE_SUFFIXES, DataError, check_datasets, is_saved_dataset, read_items

__all__ = ["FILE_SUFFIXES", "ROLES", "SHAREGPT_ROLES", "Record", "check_paths", "parse_record", "read_records"]

PathLike = Union[str, os.PathLike]
Message = Dict[str, Any]

#: The roles of a message.
ROLES = ("system", "user", "assistant", "tool")
#: ShareGPT's ``from`` -> role (``function_call``: an assistant message with ``tool_calls``).
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "function_call": "assistant", "tool": "tool", "observation": "tool"}
_PROMPT_KEYS = ("prompt", "instruction")
_RESPONSE_KEYS = ("response", "output", "completion")
_TOOL_CALL = '{"type": "function", "function": {"name": str, "arguments": str | object}, "id": str}'


class Record(NamedTuple):
    """One conversation, where it was read (``"file:line"`` or ``"file:row N"``) and its tools (``None``: none)."""

    where: str
    messages: List[Message]
    tools: Optional[List[Any]] = None


# ---------------------------------------------------------------------------------------------- record shapes
def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _present(entry: Dict[str, Any]) -> Dict[str, Any]:
    """``entry`` without its null values (an Arrow row's absent keys)."""
    return {key: value for key, value in entry.items() if value is not None}


def _text(content: Any, name: str) -> str:
    """A message's content as a string: a string, or a list of text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise DataError(f"{name}.content = {_short(content)} must be a string or a list of text parts"
                        ' [{"type": "text", "text": str}, ...]')
    texts = []
    for j, part in enumerate(content):
        part = _present(part) if isinstance(part, dict) else part
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise DataError(f"{name}.content[{j}] is a {kind!r} part: only text parts"
                            ' {"type": "text", "text": str} can be trained on as text')
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(calls: Any, name: str) -> List[Any]:
    """An assistant's OpenAI ``tool_calls``, checked; each kept as given but for its null keys."""
    if not isinstance(calls, list):
        raise DataError(f"{name}.tool_calls = {_short(calls)} must be a list [{_TOOL_CALL}, ...]")
    checked = []
    for j, call in enumerate(calls):
        call = _present(call) if isinstance(call, dict) else call
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments"), (str, dict))
                or call.get("type", "function") != "function"):
            raise DataError(f"{name}.tool_calls[{j}] = {_short(call)} must be {_TOOL_CALL}")
        checked.append(call)
    return checked


def _function_calls(value: str, name: str) -> List[Any]:
    """ShareGPT's ``function_call`` value (JSON ``{"name", "arguments"}`` or a list of them) as OpenAI tool calls."""
    try:
        calls = json.loads(value)
    except json.JSONDecodeError:
        calls = None
    calls = [calls] if isinstance(calls, dict) else calls
    if not isinstance(calls, list) or not calls or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise DataError(f'{name}: a "function_call" value must be JSON {{"name": str, "arguments": ...}} or a list'
                        f" of them, got {_short(value)}")
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}}
            for c in calls]


def _message(entry: Any, name: str) -> Message:
    """One OpenAI or ShareGPT message as an OpenAI message (see the module docstring)."""
    if not isinstance(entry, dict):
        raise DataError(f"{name} = {_short(entry)} must be an object")
    entry = _present(entry)
    if "from" in entry:
        source, value = entry["from"], entry.get("value")
        if source not in SHAREGPT_ROLES:
            raise DataError(f"{name}: 'from' = {source!r} is none of {list(SHAREGPT_ROLES)}")
        if not isinstance(value, str):
            raise DataError(f"{name}: 'value' must be a string, got {_short(value)}")
        if source == "function_call":
            return {"role": "assistant", "tool_calls": _function_calls(value, name)}
        return {"role": SHAREGPT_ROLES[source], "content": value}
    role = entry.get("role")
    if role not in ROLES:
        raise DataError(f"{name} = {_short(entry)} must have a 'role', one of {list(ROLES)} (or ShareGPT's 'from',"
                        f" one of {list(SHAREGPT_ROLES)})")
    message = dict(entry)
    if not message.get("tool_calls"):
        message.pop("tool_calls", None)  # an empty list: no call
    elif role != "assistant":
        raise DataError(f"{name}: a {role} message has 'tool_calls': only an assistant's may")
    else:
        message["tool_calls"] = _tool_calls(message["tool_calls"], name)
    if "content" in message:
        message["content"] = _text(message["content"], name)
    elif "tool_calls" not in message:
        raise DataError(f"{name} has no 'content' (a string or a list of text parts); only an assistant message"
                        " with 'tool_calls' may have none")
    for key in ("tool_call_id", "name"):
        if key in message and not isinstance(message[key], str):
            raise DataError(f"{name}.{key} = {_short(message[key])} must be a string")
    return message


def _tools(tools: Any) -> Optional[List[Any]]:
    """A record's tools: a list of schemas (objects), or a JSON string of one; ``None`` when none."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(f"'tools' is a string but not JSON ({e.msg}): it must be a list of tool schemas, or a"
                            " JSON string of one") from None
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"'tools' = {_short(tools)} must be a list of tool schemas (objects), or a JSON string of one")
    return tools


def parse_record(record: Any) -> Tuple[List[Message], Optional[List[Any]]]:
    """The messages and tools of an OpenAI, ShareGPT or instruction record (see the module docstring);
    `DataError` saying what is wrong and what is valid otherwise."""
    if not isinstance(record, dict):
        raise DataError(f"got a JSON {type(record).__name__}, not an object (a record)")
    record = _present(record)
    for key in ("messages", "conversations"):
        if key not in record:
            continue
        entries = record[key]
        if not isinstance(entries, list) or not entries:
            raise DataError(f"{key!r} must be a non-empty list of messages, got {_short(entries)}")
        messages = [_message(entry, f"{key}[{i}]") for i, entry in enumerate(entries)]
        system = record.get("system")
        if system is not None and not isinstance(system, str):
            raise DataError(f"'system' = {_short(system)} must be a string")
        if system:
            messages.insert(0, {"role": "system", "content": system})
        return messages, _tools(record.get("tools"))
    prompts = [k for k in _PROMPT_KEYS if k in record]
    responses = [k for k in _RESPONSE_KEYS if k in record]
    if len(prompts) != 1 or len(responses) != 1:
        raise DataError(f"a record needs 'messages' (OpenAI chat), 'conversations' (ShareGPT), or an instruction:"
                        f" exactly one of {list(_PROMPT_KEYS)} and one of {list(_RESPONSE_KEYS)} ('input'"
                        f" optional); got keys {sorted(record)}")
    fields = {"prompt": record[prompts[0]], "input": record.get("input", ""), "response": record[responses[0]]}
    for name, value in fields.items():
        if not isinstance(value, str):
            raise DataError(f"{name!r} must be a string, got {_short(value)}")
    prompt = fields["prompt"] + ("\n\n" + fields["input"] if fields["input"] else "")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": fields["response"]}], None


# ---------------------------------------------------------------------------------------------- files
def check_paths(paths: Sequence[PathLike]) -> List[str]:
    """``paths`` as strings, each an existing file of `FILE_SUFFIXES` or a ``save_to_disk`` folder (a
    ``FileNotFoundError`` or `DataError` naming it and what is valid otherwise; also when one needs ``datasets`` and
    it is not installed)."""
    if not paths:
        raise DataError(f"path: no file given (a file ending in {', '.join(FILE_SUFFIXES)}, a save_to_disk folder, or"
                        " a list of them)")
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"path: {str(p)!r} is not a file or folder (a chat / instruction file ending in"
                                    f" {', '.join(FILE_SUFFIXES)}, or a Dataset.save_to_disk folder)")
        if p.is_dir() and not is_saved_dataset(p):
            raise DataError(f"path: {str(p)!r} is a folder that Dataset.save_to_disk did not write (no state.json):"
                            f" give the files in it (ending in {', '.join(FILE_SUFFIXES)})")
        if p.is_file() and not p.name.endswith(FILE_SUFFIXES):
            raise DataError(f"path: {str(p)!r} is none of the files read: a name ending in"
                            f" {', '.join(FILE_SUFFIXES)}, or a Dataset.save_to_disk folder")
        check_datasets(p)
    return [str(p) for p in paths]


def read_records(paths: Union[PathLike, Sequence[PathLike]]) -> Tuple[List[Record], List[str]]:
    """The records of a file or folder (see the module docstring) or several, in order, and the malformed ones as
    ``"file:line: why"`` (bad JSON, a shape that is not a record): every one of them, the whole input read. A file
    that cannot be read at all is a `DataError`."""
    records, malformed = [], []
    for path in map(Path, [paths] if isinstance(paths, (str, os.PathLike)) else paths):
        for where, item in read_items(path):
            try:
                if isinstance(item, DataError):
                    raise item
                records.append(Record(where, *parse_record(item)))
            except DataError as e:
                malformed.append(f"{where}: {e}")
    return records, malformed
