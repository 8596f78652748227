"""Chat templates: rendered as transformers renders them, and ``LLM.chat`` on top.

Real-world-style templates (Llama-3 single line, Qwen2.5 with tool calls and ``tojson``, and one
using every transformers extra: ``strftime_now``, ``raise_exception``, ``namespace``, ``dict``,
loop controls, ``{% generation %}``, ``tojson(indent=...)``) are written into a copy of the demo
checkpoint. Each rendering is compared with transformers' own ``apply_chat_template`` when
transformers is installed, and with a literal expected string where one is short enough to write.
"""

from __future__ import annotations

import json
import shutil
import sys
from datetime import datetime

import pytest
from tokenizers import Tokenizer

import modelopt_jax
from modelopt_jax import LLM, SamplingParams
from modelopt_jax.chat_template import ChatTemplate, conversations
from modelopt_jax.errors import (ChatTemplateError, MissingDependencyError, ModelOptJaxError, RequestError,
                                 RequestTypeError)

jinja2 = pytest.importorskip("jinja2")

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

QWEN2 = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
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

# Not indented with {%- -%}: trim_blocks / lstrip_blocks decide every newline and indent here.
EXTRAS = """{{ bos_token }}
{% set ns = namespace(turns=0, system='') %}
{% set meta = dict(today=strftime_now('%d %b %Y'), pad=pad_token) %}
Date: {{ meta.today }} (pad {{ meta.pad }})
  {% for message in messages %}
    {% if message.role == 'system' %}
      {% set ns.system = message.content %}
      {% continue %}
    {% endif %}
    {% if (message.role == 'user') != (ns.turns % 2 == 0) %}
      {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
    {% if message.role == 'assistant' %}
[A] {% generation %}{{ message.content }}{% endgeneration %}{{ eos_token }}
    {% else %}
[U] {{ message.content }}
      {% if message.meta is defined %}
{{ message.meta | tojson(indent=2, sort_keys=True) }}
      {% endif %}
    {% endif %}
    {% if ns.turns >= 6 %}{% break %}{% endif %}
  {% endfor %}
System: {{ ns.system }}
{% if add_generation_prompt %}[A] {% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Who is Mr. Darcy?"}],
    [{"role": "system", "content": "  Answer briefly.  "}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Tell me about Emma <b>&</b> \u00e9"}],
    [{"role": "user", "content": "Weather in Z\u00fcrich?", "meta": {"b": [1, 2], "a": "<x> & 'y'"}},
     {"role": "assistant", "content": None, "tool_calls": [
         {"type": "function", "function": {"name": "weather", "arguments": {"city": "Z\u00fcrich", "unit": "<C>"}}}]},
     {"role": "tool", "content": "21 C"}, {"role": "tool", "content": "sunny"}],
]


def _checkpoint(tmp_path, template=None, *, jinja_file=None, named=None):
    dst = tmp_path / "ckpt"
    shutil.copytree(modelopt_jax.demo_checkpoint_path(), dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    if template is not None:
        config["chat_template"] = template
    if named is not None:
        config["chat_template"] = [{"name": k, "template": v} for k, v in named.items()]
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja_file is not None:
        (dst / "chat_template.jinja").write_text(jinja_file)
    return str(dst)


def _hf_tokenizer(path):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(path)


@pytest.mark.parametrize("name,template", [("llama3", LLAMA3), ("qwen2", QWEN2), ("extras", EXTRAS)])
def test_rendering_equals_transformers(tmp_path, name, template):
    path = _checkpoint(tmp_path, template)
    ours = ChatTemplate.from_checkpoint(path)
    hf = _hf_tokenizer(path)
    compared = 0
    for conv in CONVERSATIONS:
        if name == "llama3" and any(m.get("content") is None for m in conv):
            continue  # the Llama-3 template concatenates content: a None there fails in both renderers
        for add in (True, False):
            (normalized,), _ = conversations(conv)
            try:
                want = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=add)
            except jinja2.TemplateError as e:  # the extras template refuses the tool conversation
                with pytest.raises(ChatTemplateError, match=str(e)):
                    ours.render(normalized, add_generation_prompt=add)
                compared += 1
                continue
            assert ours.render(normalized, add_generation_prompt=add) == want, (name, conv, add)
            ids = hf.apply_chat_template(conv, tokenize=True, add_generation_prompt=add, return_dict=False)
            # what LLM.chat feeds the model: the rendered text, no special tokens added
            assert Tokenizer.from_file(f"{path}/tokenizer.json").encode(want, add_special_tokens=False).ids == list(ids)
            compared += 1
    assert compared >= 4


def test_literal_renderings():
    """Without transformers too: what these templates must produce, written out."""
    tokens = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
    (conv,), _ = conversations(CONVERSATIONS[1])
    assert ChatTemplate(LLAMA3, tokens).render(conv) == (
        "<|bos|><|start_header_id|>system<|end_header_id|>\n\nAnswer briefly.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nTell me about Emma <b>&</b> \u00e9<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    today = datetime.now().strftime("%d %b %Y")
    (tools,), _ = conversations(CONVERSATIONS[2][:1])
    assert ChatTemplate(EXTRAS, tokens).render(conv, add_generation_prompt=False) == (
        f"<|bos|>\nDate: {today} (pad <|pad|>)\n[U] Hi\n[A] Hello!<|eos|>\n[U] Tell me about Emma <b>&</b> \u00e9\n"
        f"System:   Answer briefly.  \n")
    assert ChatTemplate(EXTRAS, tokens).render(tools).endswith(
        '[U] Weather in Z\u00fcrich?\n{\n  "a": "<x> & \'y\'",\n  "b": [\n    1,\n    2\n  ]\n}\nSystem: \n[A] ')
    (calls,), _ = conversations(CONVERSATIONS[2])
    assert ('<tool_call>\n{"name": "weather", "arguments": {"city": "Z\u00fcrich", "unit": "<C>"}}\n</tool_call>'
            '<|im_end|>\n<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\nsunny\n'
            '</tool_response><|im_end|>\n<|im_start|>assistant\n') in ChatTemplate(QWEN2).render(calls)


def test_where_the_template_comes_from(tmp_path):
    path = _checkpoint(tmp_path, "{{ 'from config' }}", jinja_file="{{ 'from file' }}")
    assert ChatTemplate.from_checkpoint(path).render([]) == "from file"  # chat_template.jinja wins
    (tmp_path / "ckpt" / "chat_template.jinja").unlink()
    assert ChatTemplate.from_checkpoint(path).render([]) == "from config"
    named = _checkpoint(tmp_path / "n", named={"default": "{{ 'd' }}", "tool_use": "{{ 't' }}"})
    assert ChatTemplate.from_checkpoint(named).render([]) == "d"
    assert ChatTemplate.from_checkpoint(named, "tool_use").render([]) == "t"
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}!")
    assert ChatTemplate.from_checkpoint(named, str(tmp_path / "t.jinja")).render([{"role": "u", "content": "x"}]) == "x!"
    assert ChatTemplate.from_checkpoint(named, "{{ eos_token }}").render([]) == "<|eos|>"
    with pytest.raises(ChatTemplateError, match="neither a file, nor a template name"):
        ChatTemplate.from_checkpoint(named, "no_such_name")
    nodefault = _checkpoint(tmp_path / "x", named={"a": "{{ 1 }}"})
    with pytest.raises(ChatTemplateError, match="none named 'default'"):
        ChatTemplate.from_checkpoint(nodefault)
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        ChatTemplate.from_checkpoint(modelopt_jax.demo_checkpoint_path())


@pytest.mark.parametrize("messages,error,match", [
    (None, RequestTypeError, "messages: a non-empty list"), ([], RequestError, "an empty list"),
    ({"role": "user"}, RequestTypeError, "messages: a non-empty list"),
    (["hi"], RequestTypeError, r"messages\[0\]: a message is a dict"),
    ([{"content": "hi"}], RequestError, r"messages\[0\]: 'role' must be a non-empty string"),
    ([{"role": "user", "content": 5}], RequestTypeError, r"messages\[0\]\['content'\]: a string or a list"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], RequestError,
     r"messages\[0\]\['content'\]\[0\]: only text parts"),
    ([[{"role": "user", "content": "a"}], []], RequestError, r"messages\[1\]: an empty conversation"),
    ([{"role": "user", "content": "a", "x": object()}], RequestTypeError, "JSON values only")])
def test_malformed_messages_are_typed_errors(messages, error, match):
    with pytest.raises(error, match=match) as info:
        conversations(messages)
    assert isinstance(info.value, ModelOptJaxError)


def test_text_parts_are_joined_and_none_keys_dropped():
    (conv,), batched = conversations([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}], "name": None}])
    assert conv == [{"role": "user", "content": "a\nb"}] and not batched


def test_template_failures_are_chat_template_errors():
    tokens = {"bos_token": "<s>"}
    (conv,), _ = conversations([{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="raised: Conversation roles must alternate"):
        ChatTemplate(EXTRAS, tokens).render(conv)
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")
    # the sandbox: no underscore attributes on a namespace, no mutation of the caller's data
    with pytest.raises(ChatTemplateError, match="underscore"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render(conv)
    with pytest.raises(ChatTemplateError, match="raised"):
        ChatTemplate("{{ messages.append(1) }}").render(conv)
    with pytest.raises(ChatTemplateError, match="raised"):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render(conv)


def test_missing_jinja2_is_a_clear_error(monkeypatch):
    from modelopt_jax import chat_template

    monkeypatch.setitem(sys.modules, "jinja2", None)  # what `import jinja2` sees without the package
    with pytest.raises(MissingDependencyError, match=r"pip install 'jinja2>=3.1.6'"):
        chat_template._compile("{{ 'not cached yet' }} " + str(id(monkeypatch)), "test")


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM(modelopt_jax.demo_checkpoint_path(), dtype="float32", max_model_len=128, compilation_cache_dir=None)


def test_llm_chat_generates_from_the_rendered_prompt(demo, tmp_path):
    path = _checkpoint(tmp_path, LLAMA3.replace("<|start_header_id|>", "").replace("<|end_header_id|>", ":")
                       .replace("<|eot_id|>", "\n"))
    llm = LLM(path, dtype="float32", max_model_len=128, compilation_cache_dir=None)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = llm.chat([CONVERSATIONS[0], CONVERSATIONS[1][:2]], params, use_tqdm=False)
    assert len(outs) == 2
    for out, conv in zip(outs, [CONVERSATIONS[0], CONVERSATIONS[1][:2]]):
        (normalized,), _ = conversations(conv)
        text = llm.get_chat_template().render(normalized)
        assert out.prompt == text and text.startswith("<|bos|>") and text.endswith("assistant:\n\n")
        # the template wrote the BOS: tokenized without adding special tokens, so exactly one
        assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False).ids
        assert out.prompt_token_ids.count(256) == 1
        (same,) = demo.generate({"prompt_token_ids": out.prompt_token_ids}, params, use_tqdm=False)
        assert out.token_ids == same.token_ids and out.text == same.text
    (single,) = llm.chat(CONVERSATIONS[0], params, use_tqdm=False)  # one conversation: one output
    assert single.token_ids == outs[0].token_ids
    (bare,) = llm.chat(CONVERSATIONS[0], params, add_generation_prompt=False, use_tqdm=False)
    assert not bare.prompt.endswith("assistant:\n\n")


def test_llm_chat_errors(demo):
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        demo.chat(CONVERSATIONS[0])
    with pytest.raises(RequestTypeError, match="messages: a non-empty list"):
        demo.chat("hello", chat_template=LLAMA3)
    with pytest.raises(RequestTypeError, match="unexpected keyword argument"):
        demo.chat(CONVERSATIONS[0], tools=[])
    with pytest.raises(RequestError, match="prompt 0 has .* tokens; max_model_len=128"):
        demo.chat([{"role": "user", "content": "x" * 200}], chat_template=LLAMA3)
