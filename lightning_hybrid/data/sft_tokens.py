"""Fine-tuning tokens: a conversation as token ids and per-token trained flags (`tokenize_conversation`), with the
tokenizer's chat template -- its ``{% generation %}`` blocks, a prefix-consistent rendering, or the assistant spans
located in the whole rendering -- or in the plain format; the ways and the format are those of
`lightning_hybrid.data.sft`'s module docstring. Imports no torch: the documents are lists."""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any, Callable, List, Optional, Tuple

from lightning_hybrid.data.chat_formats import Message
from lightning_hybrid.data.record_files import DataError

__all__ = ["Document", "tokenize_conversation"]

#: A document: token ids and, per token, whether it is trained (an assistant token).
Document = Tuple[List[int], List[bool]]
Pieces = List[Tuple[str, bool]]

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _encode(text: str, tokenizer: Any) -> List[int]:
    if tokenizer is None:
        return list(text.encode("utf-8"))
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def _encode_pieces(pieces: Pieces, tokenizer: Any, eos: Optional[int] = None) -> Document:
    """``(text, trained)`` pieces tokenised one by one, ``eos`` after each trained one."""
    ids: List[int] = []
    trained: List[bool] = []
    for text, is_answer in pieces:
        piece = _encode(text, tokenizer) + ([eos] if is_answer and eos is not None else [])
        ids += piece
        trained += [is_answer] * len(piece)
    return ids, trained


def _plain_pieces(messages: List[Message], tools: Optional[List[Any]]) -> Pieces:
    """``(text, trained)`` pieces of the plain format (see `lightning_hybrid.data.sft`'s docstring)."""
    pieces = [(f"<|tools|>\n{json.dumps(tools)}\n", False)] if tools else []
    for m in messages:
        content, calls = m.get("content", ""), m.get("tool_calls", [])
        body = f"{content}\n" if content or not calls else ""
        for call in calls:
            function = {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
            body += f"<tool_call>{json.dumps(function)}</tool_call>\n"
        pieces += [(f"<|{m['role']}|>\n", False), (body, m["role"] == "assistant")]
    return pieces


def _renderer(messages: List[Message], tools: Optional[List[Any]], tokenizer: Any) -> Callable[[int, bool], str]:
    """``render(n, generation_prompt)``: the chat template's text of ``messages[:n]``, each made once; a template's
    error is a `DataError` naming the prefix."""

    @functools.lru_cache(maxsize=None)
    def render(n: int, generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(messages[:n], tools=tools, tokenize=False,
                                                 add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja's and the template's own (raise_exception) errors: reported with the record
            raise DataError(f"the chat template failed on messages[:{n}]: {type(e).__name__}: {e}") from None

    return render


def _prefix_pieces(messages: List[Message], render: Callable[[int, bool], str]) -> Optional[Pieces]:
    """``(text, trained)`` pieces of a prefix-consistent rendering: the text each prefix adds to the one before it;
    ``None`` when a longer prefix does not extend a shorter one (or a prefix cannot be rendered)."""
    ends = []  # (prefix length, generation prompt, whether the text it adds is trained)
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and i > 0:
            ends.append((i, True, False))
        ends.append((i + 1, False, m["role"] == "assistant"))
    pieces, done = [], ""
    for n, generation_prompt, is_answer in ends:
        try:
            text = render(n, generation_prompt)
        except DataError:
            return None
        if not text.startswith(done):
            return None
        pieces.append((text[len(done):], is_answer))
        done = text
    return pieces


def _anchor(text: str, context: str, answer: str, start: int) -> Tuple[int, int]:
    """``(at, c)``: ``answer`` is at ``at`` in ``text``, at or after ``start``, preceded by the last ``c``
    characters of ``context``, the most of them found there (the first such place); ``(-1, 0)`` if ``answer`` is
    not there at all. An occurrence with ``c`` characters of context implies one with ``c - 1``: bisection."""
    def find(c: int) -> int:
        at = text.find(context[len(context) - c:] + answer, max(start - c, 0))
        return at + c if at >= 0 else -1

    if find(0) < 0:
        return -1, 0
    lo, hi = 0, len(context)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if find(mid) >= 0 else (lo, mid - 1)
    return find(lo), lo


def _located_document(messages: List[Message], render: Callable[[int, bool], str], tokenizer: Any) -> Document:
    """The whole rendering, tokenised once, trained where its tokens overlap the assistant spans (way 3 of
    `lightning_hybrid.data.sft`'s docstring)."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("the chat template is not prefix-consistent on this record, and locating the assistant"
                        " messages in its rendering needs a fast tokenizer's offsets (a tokenizer.json)")
    full = render(len(messages), False)
    spans: List[Tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        # Its text: the end of the rendering that ends with it, after the most of the generation prompt's rendering
        # (past what the two share from their start: a message the template drops adds no text).
        last, prompt = render(i + 1, False), (render(i, True) if i else "")
        at, matched = _anchor(last, prompt, "", len(os.path.commonprefix([last, prompt])))
        context, answer = last[:at], last[at:]
        if (i and not matched) or not answer:
            raise DataError(f"messages[{i}] (assistant): the chat template's rendering of messages[:{i + 1}] adds no"
                            f" text after its rendering of messages[:{i}] with the generation prompt (the template"
                            " drops or rewrites the message), so its tokens are unknown")
        at, _ = _anchor(full, context, answer, spans[-1][1] if spans else 0)
        if at < 0:
            raise DataError(f"messages[{i}] (assistant): the text the chat template renders for it as the last"
                            f" message, {answer[:60]!r}{'...' if len(answer) > 60 else ''}, is not in the rendering of"
                            " the whole conversation after the previous answer (the template renders it differently"
                            " when messages follow it): its tokens cannot be located")
        spans.append((at, at + len(answer)))
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    trained, k = [], 0
    for start, end in encoding["offset_mapping"]:
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        trained.append(k < len(spans) and end > spans[k][0])
    return list(encoding["input_ids"]), trained


def _generation_document(messages: List[Message], tools: Optional[List[Any]], tokenizer: Any) -> Document:
    """The template's ``{% generation %}`` blocks as the trained tokens (way 1 of `lightning_hybrid.data.sft`'s
    docstring)."""
    try:
        out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    except Exception as e:  # as in _renderer
        raise DataError(f"the chat template failed: {type(e).__name__}: {e}") from None
    return list(out["input_ids"]), [bool(t) for t in out["assistant_masks"]]


def tokenize_conversation(messages: List[Message], tokenizer: Any = None, tools: Optional[List[Any]] = None
                          ) -> Document:
    """A conversation (and its tools) as token ids and per-token trained flags (see `lightning_hybrid.data.sft`'s
    docstring): with ``tokenizer``'s chat template if it has one, else the plain format (``tokenizer`` ``None``:
    bytes). A record the template cannot render, or whose assistant tokens cannot be located, is a `DataError`."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        eos = None if tokenizer is None else tokenizer.eos_token_id
        return _encode_pieces(_plain_pieces(messages, tools), tokenizer, eos)
    if _GENERATION_BLOCK.search(tokenizer.get_chat_template(None, tools)):
        return _generation_document(messages, tools, tokenizer)
    render = _renderer(messages, tools, tokenizer)
    pieces = _prefix_pieces(messages, render)
    if pieces is not None:
        return _encode_pieces(pieces, tokenizer)
    return _located_document(messages, render, tokenizer)
