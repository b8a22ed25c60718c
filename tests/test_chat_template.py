"""rtpcore.engine.text.chat_template: real-world chat templates render exactly as transformers'
apply_chat_template(..., tokenize=False) renders them on the same checkpoint folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rtpcore.engine.text.chat_template import ChatTemplate
from rtpcore.errors import ChatTemplateError, CheckpointError
from tokenizer_files import write_tokenizer

# --- the templates, as their model cards' tokenizer_config.json ship them ---------------------

# meta-llama/Meta-Llama-3-8B-Instruct
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# meta-llama/Llama-3.1-8B-Instruct
LLAMA31 = r"""{{- bos_token }}
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
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
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
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
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
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Qwen/Qwen2-7B-Instruct (ChatML with a default system prompt)
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# HuggingFaceTB/SmolLM2-135M-Instruct (ChatML)
SMOLLM = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# deepseek-ai/DeepSeek-V3
DEEPSEEK_V3 = (
    r"{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    r"{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}"
    r"{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    r"{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}"
    r"{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}"
    r"{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}{%- if message['role'] == 'user' %}"
    r"{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    r"{%- if message['role'] == 'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}"
    r"{%- for tool in message['tool_calls']%}{%- if not ns.is_first %}"
    r"{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}"
    r"{%- set ns.is_first = true -%}{%- else %}"
    r"{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}"
    r"{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}"
    r"{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}"
    r"{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}"
    r"{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    r"{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    r"{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"
    r"{%- set ns.is_output_first = false %}{%- else %}"
    r"{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}"
    r"{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    r"{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"
)

LLAMA_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
CHATML_TOKENS = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
DEEPSEEK_TOKENS = {
    "bos_token": {"__type": "AddedToken", "content": "<｜begin▁of▁sentence｜>", "lstrip": False, "normalized": True,
                  "rstrip": False, "single_word": False},
    "eos_token": {"__type": "AddedToken", "content": "<｜end▁of▁sentence｜>", "lstrip": False, "normalized": True,
                  "rstrip": False, "single_word": False},
}
TEMPLATES = {
    "llama3": (LLAMA3, LLAMA_TOKENS),
    "llama3.1": (LLAMA31, LLAMA_TOKENS),
    "qwen2": (QWEN2, CHATML_TOKENS),
    "smollm2": (SMOLLM, CHATML_TOKENS),
    "deepseek-v3": (DEEPSEEK_V3, DEEPSEEK_TOKENS),
}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city — «now»",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}
TOOL_CALL = {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "one user message": ([{"role": "user", "content": "What is the capital of France?"}], None),
    "system, then user": ([{"role": "system", "content": "  Answer briefly.  "},
                           {"role": "user", "content": "Capital of 日本? 😀"}], None),
    "multi-turn": ([{"role": "system", "content": "Be terse."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello! <b>&amp;</b>"},
                    {"role": "user", "content": "Two\nlines \"quoted\""}], None),
    "content None is dropped": ([{"role": "user", "content": "Hi", "name": None}], None),
}
TOOL_CONVERSATIONS = {
    # DeepSeek-V3: an assistant turn with tool calls, two tool outputs (its ns.is_tool /
    # ns.is_output_first namespace), an answer
    "deepseek-v3": ([{"role": "user", "content": "Weather in Paris and Rome?"},
                     {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL, {**TOOL_CALL, "id": "call_2"}]},
                     {"role": "tool", "content": "18C", "tool_call_id": "call_1"},
                     {"role": "tool", "content": "21C", "tool_call_id": "call_2"},
                     {"role": "assistant", "content": "Paris 18C, Rome 21C."},
                     {"role": "user", "content": "Thanks"}], None),
    # Llama 3.1: tools in the first user message (tojson(indent=4)), a call and its result
    "llama3.1": ([{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                      "name": "get_weather", "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": {"temperature": "18C"}}], [WEATHER_TOOL]),
}


def _checkpoint(path: Path, template: str, tokens: dict[str, Any], *, in_file: bool = False) -> Path:
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **tokens}
    if in_file:
        (path / "chat_template.jinja").parent.mkdir(parents=True, exist_ok=True)
        (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    else:
        config["chat_template"] = template
    return write_tokenizer(path, config)


def _transformers_render(path: Path, messages: list[dict[str, Any]], tools: Any = None, **kwargs: Any) -> str:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    return str(tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs))


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_render_equals_transformers_apply_chat_template(tmp_path: Path, name: str, conversation: str) -> None:
    """Each real-world template renders each conversation exactly as transformers does."""
    template, tokens = TEMPLATES[name]
    path = _checkpoint(tmp_path, template, tokens)
    messages, tools = CONVERSATIONS[conversation]
    got = ChatTemplate.from_pretrained(path).render(messages, tools=tools)
    assert got == _transformers_render(path, messages, tools)


@pytest.mark.parametrize("name", sorted(TOOL_CONVERSATIONS))
def test_tool_calls_render_equal_transformers(tmp_path: Path, name: str) -> None:
    """Tool definitions (through tojson with indent) and tool-call turns render as transformers does."""
    template, tokens = TEMPLATES[name]
    path = _checkpoint(tmp_path, template, tokens)
    messages, tools = TOOL_CONVERSATIONS[name]
    got = ChatTemplate.from_pretrained(path).render(messages, tools=tools)
    assert got == _transformers_render(path, messages, tools)
    assert {"llama3.1": '"name": "get_weather"', "deepseek-v3": "21C<｜tool▁output▁end｜>"}[name] in got


def test_a_null_content_is_dropped_as_transformers_drops_it(tmp_path: Path) -> None:
    """A message key whose value is None is left out, as transformers 5 leaves it out: DeepSeek-V3's
    `content is none` branch is then not taken and its `+ message['content']` fails in both."""
    import jinja2

    template, tokens = TEMPLATES["deepseek-v3"]
    path = _checkpoint(tmp_path, template, tokens)
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}]
    with pytest.raises(ChatTemplateError, match="content"):
        ChatTemplate.from_pretrained(path).render(messages)
    with pytest.raises(jinja2.exceptions.UndefinedError):
        _transformers_render(path, messages)


def test_the_special_tokens_and_extra_variables_reach_the_template(tmp_path: Path) -> None:
    """Llama 3 starts with the checkpoint's bos_token; a keyword (date_string) overrides a default."""
    path = _checkpoint(tmp_path, LLAMA31, LLAMA_TOKENS)
    messages = [{"role": "user", "content": "Hi"}]
    got = ChatTemplate.from_pretrained(path).render(messages, date_string="01 Jan 2030")
    assert got.startswith("<|begin_of_text|><|start_header_id|>system")
    assert "Today Date: 01 Jan 2030" in got
    assert got == _transformers_render(path, messages, date_string="01 Jan 2030")
    assert ChatTemplate.from_pretrained(path).render(messages, add_generation_prompt=False).endswith("Hi<|eot_id|>")


def test_chat_template_jinja_takes_priority_over_tokenizer_config(tmp_path: Path) -> None:
    """chat_template.jinja in the folder wins over tokenizer_config.json's chat_template, as in transformers."""
    path = _checkpoint(tmp_path, QWEN2, CHATML_TOKENS, in_file=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": SMOLLM}))
    messages = [{"role": "user", "content": "Hi"}]
    got = ChatTemplate.from_pretrained(path).render(messages)
    assert "You are a helpful assistant." in got
    assert got == _transformers_render(path, messages)


def test_a_list_of_named_templates_uses_default_and_tool_use_with_tools(tmp_path: Path) -> None:
    """chat_template as [{name, template}]: 'default' without tools, 'tool_use' with them."""
    templates = [{"name": "default", "template": QWEN2}, {"name": "tool_use", "template": "TOOLS {{ tools | tojson }}"}]
    path = write_tokenizer(tmp_path, {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                                      "chat_template": templates})
    chat = ChatTemplate.from_pretrained(path)
    messages = [{"role": "user", "content": "Hi"}]
    assert chat.render(messages) == _transformers_render(path, messages)
    tools = [WEATHER_TOOL]
    assert chat.render(messages, tools=tools) == _transformers_render(path, messages, tools)
    assert chat.render(messages, tools=tools).startswith('TOOLS [{"type": "function"')


def test_strftime_now_loopcontrols_and_generation_blocks_work(tmp_path: Path) -> None:
    """strftime_now, {% break %} and a training template's {% generation %} block render."""
    template = (
        "{{ strftime_now('%Y') }}|{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    path = _checkpoint(tmp_path, template, LLAMA_TOKENS)
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    got = ChatTemplate.from_pretrained(path).render(messages)
    assert got == _transformers_render(path, messages)
    assert got.endswith("|a") and got[:4].isdigit()


def test_a_template_raising_is_a_chat_template_error(tmp_path: Path) -> None:
    """raise_exception in the template becomes ChatTemplateError carrying its message."""
    template = "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    path = _checkpoint(tmp_path, template, LLAMA_TOKENS)
    with pytest.raises(ChatTemplateError) as excinfo:
        ChatTemplate.from_pretrained(path).render([{"role": "user", "content": "x"}])
    assert "roles must alternate" in str(excinfo.value) and excinfo.value.checkpoint == path
    assert isinstance(excinfo.value, ValueError)


@pytest.mark.parametrize("messages", [
    "just a string",
    [{"role": "user", "content": "x"}, "not an object"],
    [{"role": "user"}],  # content missing: the template's '+' fails
])
def test_malformed_messages_are_chat_template_errors(tmp_path: Path, messages: Any) -> None:
    """Messages of the wrong shape fail as ChatTemplateError, never another exception type."""
    path = _checkpoint(tmp_path, QWEN2, CHATML_TOKENS)
    with pytest.raises(ChatTemplateError):
        ChatTemplate.from_pretrained(path).render(messages)


def test_the_sandbox_refuses_attribute_escapes(tmp_path: Path) -> None:
    """A template reaching for Python internals fails in the sandbox (as a ChatTemplateError)."""
    path = _checkpoint(tmp_path, "{{ messages.__class__.__mro__ }}", LLAMA_TOKENS)
    with pytest.raises(ChatTemplateError):
        ChatTemplate.from_pretrained(path).render([{"role": "user", "content": "x"}])


def test_a_checkpoint_without_a_template_is_an_error_naming_it(tmp_path: Path) -> None:
    """No chat_template.jinja and no chat_template in tokenizer_config.json: CheckpointError naming both."""
    write_tokenizer(tmp_path, {"eos_token": "<|eot_id|>"})
    with pytest.raises(CheckpointError) as excinfo:
        ChatTemplate.from_pretrained(tmp_path)
    message = str(excinfo.value)
    assert str(tmp_path) in message and "chat_template.jinja" in message and "tokenizer_config.json" in message


def test_a_template_that_does_not_compile_is_a_checkpoint_error(tmp_path: Path) -> None:
    """A syntax error in the template is reported when the template is loaded, naming the checkpoint."""
    path = _checkpoint(tmp_path, "{% for m in messages %}", LLAMA_TOKENS)
    with pytest.raises(CheckpointError, match="does not compile") as excinfo:
        ChatTemplate.from_pretrained(path)
    assert excinfo.value.path == path


def test_importing_the_module_loads_no_jinja2() -> None:
    """rtpcore.engine.text.chat_template imports jinja2 only when a template is compiled."""
    import subprocess
    import sys

    code = "import sys, rtpcore.engine.text.chat_template; print('jinja2' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
