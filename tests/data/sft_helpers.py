"""What the fine-tuning data tests share (`tests/data/test_sft_*.py`): conversations in the shapes users
have (chat, tool calls, parallel calls), the chat templates of real models' tokenizer_config.json as they
ship, a byte-level BPE tokenizer trained here on those conversations (no download), and small builders of
records files and of the plain format by hand."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from lightning_hybrid.data.sft import IGNORE_INDEX

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
