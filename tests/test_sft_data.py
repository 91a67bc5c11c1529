"""Fine-tuning data (`lightning_hybrid.sft`, `lightning_hybrid.chat_formats`): the files and record shapes users
have (JSON lines, JSON arrays, gzip, Parquet / Arrow / save_to_disk through ``datasets``; OpenAI messages with tools
and tool calls, ShareGPT, instructions) read or refused with their place; the plain format; the trained tokens under
real chat templates (ChatML, Qwen2.5 with tools, Llama 3.1 with tools, Mistral v0.3, Gemma, a ``{% generation %}``
template), each checked against the text written out by hand; packed and padded rows in the batch format (exact
ids, labels, masks, positions); what is dropped, cut or malformed counted in ``statistics()`` and warned of; the
data module's loaders and splits; the ``data=sft`` config. Pure and fast: no process group, no download (the
tokenizers are trained here)."""

from __future__ import annotations

import functools
import gzip
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate

from lightning_hybrid.chat_formats import check_paths, parse_record, read_records
from lightning_hybrid.config import register_configs
from lightning_hybrid.data import DataError, statistics_line
from lightning_hybrid.recipe import ConfigError, check
from lightning_hybrid.sft import (
    IGNORE_INDEX,
    SFTDataModule,
    _located_document,
    _prefix_pieces,
    _renderer,
    batch_statistics,
    pack_documents,
    tokenize_conversation,
)

ROOT = Path(__file__).resolve().parents[1]
N = IGNORE_INDEX
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hi"}, {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "well, thank you"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _call(city: str, id_: str = "call00001") -> dict:
    return {"type": "function", "id": id_, "function": {"name": "get_weather", "arguments": {"city": city}}}


#: A tool call, its result and the answer (Mistral's tool call ids are 9 characters).
TOOL_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "tool_calls": [_call("Paris")]},
             {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "22 C"},
             {"role": "assistant", "content": "It is 22 C in Paris."}]
#: Two calls at once, two results.
PARALLEL_CHAT = [{"role": "user", "content": "Weather in Paris and Rome?"},
                 {"role": "assistant", "tool_calls": [_call("Paris"), _call("Rome", "call00002")]},
                 {"role": "tool", "tool_call_id": "call00001", "content": "22 C"},
                 {"role": "tool", "tool_call_id": "call00002", "content": "25 C"},
                 {"role": "assistant", "content": "Paris 22 C, Rome 25 C."}]

# ---------------------------------------------------------------------------------------------- real templates
# The chat templates of the models' tokenizer_config.json, as they ship.

#: Qwen/Qwen2.5-*-Instruct.
QWEN2_5 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided\
 with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within\
 <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\
\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant"\
 and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

#: Qwen2.5's template with the assistant's output in {% generation %} blocks (TRL's training variant,
#: trl/chat_templates/qwen2_5_training.jinja): the masks come from transformers.
QWEN2_5_GENERATION = QWEN2_5.replace(
    """    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role ==\
 "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}""",
    """    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant' }}
        {%- generation %}
        {%- if not message.tool_calls %}
            {{- '\\n' + message.content + '<|im_end|>\\n' }}
        {%- else %}
        {%- if message.content %}""").replace(
    """        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}""",
    """        {{- '<|im_end|>\\n' }}
        {%- endif %}
        {%- endgeneration %}
    {%- elif message.role == "tool" %}""")

#: meta-llama/Llama-3.1-8B-Instruct.
LLAMA3_1 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function\
 call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim +\
 '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

#: mistralai/Mistral-7B-Instruct-v0.3: the system prompt and the tools go into the last user turn, so a longer
#: conversation's rendering does not start with a shorter one's.
MISTRAL_V0_3 = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and\
 message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate\
 user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional\
 system message!") }}
    {%- endif %}
{%- endfor %}
"""

#: google/gemma-2-*-it (and gemma-1.1): no system role, "model" for the assistant.
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")

#: Each template's special tokens: (bos, eos).
SPECIAL = {CHATML: (None, "<|im_end|>"), QWEN2_5: (None, "<|im_end|>"), QWEN2_5_GENERATION: (None, "<|im_end|>"),
           LLAMA3_1: ("<|begin_of_text|>", "<|eot_id|>"), MISTRAL_V0_3: ("<s>", "</s>"), GEMMA: ("<bos>", "<eos>")}
CONTROL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]",
                  "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "<bos>", "<eos>",
                  "<start_of_turn>", "<end_of_turn>"]


@functools.lru_cache(maxsize=None)
def _trained_bpe() -> str:
    """A byte-level BPE tokenizer (JSON) trained here on the test conversations, with every template's control
    tokens as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = " ".join(str(m.get("content")) for m in CHAT + TOOL_CHAT + PARALLEL_CHAT) + " system user assistant" * 20
    tokenizer.train_from_iterator([text, json.dumps(TOOLS)], trainers.BpeTrainer(
        vocab_size=400, special_tokens=CONTROL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tokenizer.to_str()


def _chat_tokenizer(folder: Path, template: str | None = CHATML) -> Path:
    """A Hugging Face folder with the tokenizer of `_trained_bpe`, ``template`` and its bos / eos tokens (ChatML's
    without a template)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    bos, eos = SPECIAL.get(template, SPECIAL[CHATML])
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_trained_bpe()), bos_token=bos, eos_token=eos)
    fast.chat_template = template
    fast.save_pretrained(folder)
    return folder


def _load(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _jsonl(path: Path, records: list, raw_lines: tuple = ()) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "".join(raw_lines))
    return path


def _prompt_answer(prompt: str, answer: str) -> tuple[list[int], list[bool]]:
    """The plain format by hand, in bytes: header and prompt untrained, the answer and its newline trained."""
    head = f"<|user|>\n{prompt}\n<|assistant|>\n".encode()
    tail = f"{answer}\n".encode()
    return list(head + tail), [False] * len(head) + [True] * len(tail)


def _trained_text(tokenizer, document) -> str:
    ids, trained = document
    return tokenizer.decode([i for i, t in zip(ids, trained) if t])


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
