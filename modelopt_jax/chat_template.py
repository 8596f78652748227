"""Chat templates, rendered the way Hugging Face transformers renders them.

A checkpoint's chat template is Jinja source from ``chat_template.jinja`` (which wins, as in
transformers) or the ``chat_template`` entry of ``tokenizer_config.json`` (a string, or a list of
named templates: ``default`` is used). Rendering matches ``tokenizer.apply_chat_template(...,
tokenize=False)``: a sandboxed, immutable Jinja environment with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension and a ``{% generation %}`` block, the globals
``raise_exception`` and ``strftime_now``, a ``tojson`` filter that does not HTML-escape (and takes
``indent``/``separators``/``sort_keys``), and ``dict`` / ``namespace`` without underscore
attributes. The template sees ``messages``, ``add_generation_prompt``, ``tools`` / ``documents``
(None) and the named special tokens (``bos_token``, ``eos_token``, ...) as strings. Templates are
untrusted code from the hub, hence the sandbox; jinja2 >= 3.1.6 (earlier ones had sandbox escapes).

Everything that can go wrong is a :class:`~modelopt_jax.errors.RequestError` naming the argument:
malformed ``messages`` (``RequestTypeError`` for wrong types), and :class:`ChatTemplateError` for a
missing template, one that does not parse, or one that raises.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from typing import Any, Mapping

from modelopt_jax.checkpoint.files import open_regular
from modelopt_jax.errors import CheckpointError, ChatTemplateError, MissingDependencyError, RequestError, \
    RequestTypeError

TEMPLATE_FILE = "chat_template.jinja"
# The special tokens transformers passes to a template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: str) -> dict:
    with open_regular(path, "r") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """One chat template plus the special-token strings it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None, *, origin: str = "chat_template"):
        if not isinstance(source, str):
            raise RequestTypeError(f"chat_template must be a string, got {type(source).__name__}")
        self.source, self.origin = source, origin
        self.special_tokens = dict(special_tokens or {})
        self._compiled = _compile(source, origin)  # a syntax error is reported when the template is chosen

    @classmethod
    def from_checkpoint(cls, directory: str, chat_template: str | None = None) -> "ChatTemplate":
        """The template of checkpoint ``directory``, or ``chat_template``: a template name the
        checkpoint defines, a path to a Jinja file, or Jinja source (vLLM's ``--chat-template``)."""
        config_path = os.path.join(directory, "tokenizer_config.json")
        config = _read_json(config_path) if os.path.isfile(config_path) else {}
        named, origin = _checkpoint_templates(directory, config, config_path)
        tokens = special_tokens(directory, config)
        if chat_template is not None:
            if not isinstance(chat_template, str):
                raise RequestTypeError(f"chat_template must be a string (Jinja source, a file or a template name), "
                                       f"got {type(chat_template).__name__}")
            if chat_template in named:
                return cls(named[chat_template], tokens, origin=f"{origin} ({chat_template!r})")
            if os.path.isfile(chat_template):
                with open(chat_template, encoding="utf-8") as f:
                    return cls(f.read(), tokens, origin=chat_template)
            if "{{" in chat_template or "{%" in chat_template:
                return cls(chat_template, tokens, origin="chat_template argument")
            raise ChatTemplateError(f"chat_template={chat_template!r} is neither a file, nor a template name of "
                                    f"{directory} ({sorted(named) or 'it has none'}), nor Jinja source")
        if not named:
            raise ChatTemplateError(f"{directory} has no chat template (no {TEMPLATE_FILE}, no 'chat_template' in "
                                    f"tokenizer_config.json): pass chat_template= (Jinja source or a file), or "
                                    f"serve --chat-template FILE")
        if "default" not in named:
            raise ChatTemplateError(f"{origin} defines templates {sorted(named)} but none named 'default': pass "
                                    f"chat_template= with one of the names")
        return cls(named["default"], tokens, origin=origin)

    def render(self, conversation: list[dict], *, add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt text for one normalized conversation (see :func:`conversations`)."""
        import jinja2

        context = {**self.special_tokens, **variables}
        try:
            return self._compiled.render(messages=conversation, tools=None, documents=None,
                                         add_generation_prompt=bool(add_generation_prompt), **context)
        except jinja2.TemplateError as e:  # raise_exception(), a sandbox violation, an undefined call ...
            raise ChatTemplateError(f"the chat template ({self.origin}) raised: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
            raise ChatTemplateError(f"the chat template ({self.origin}) failed on these messages: "
                                    f"{type(e).__name__}: {e}") from e


def _checkpoint_templates(directory: str, config: dict, config_path: str) -> tuple[dict[str, str], str]:
    """({name: source}, where they came from): chat_template.jinja wins over tokenizer_config.json."""
    path = os.path.join(directory, TEMPLATE_FILE)
    if os.path.exists(path):
        with open_regular(path, "rb") as f:
            return {"default": f.read().decode("utf-8")}, path
    value = config.get("chat_template")
    if value is None:
        return {}, config_path
    if isinstance(value, str):
        return {"default": value}, config_path
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}, config_path
    raise CheckpointError(f"{config_path}: 'chat_template' must be a string or a list of "
                          f"{{'name': ..., 'template': ...}}, got {type(value).__name__}")


def special_tokens(directory: str, config: dict | None = None) -> dict[str, str]:
    """The named special tokens as strings: tokenizer_config.json's, then special_tokens_map.json
    for those it lacks, plus model-specific names (``extra_special_tokens`` given as a dict)."""
    if config is None:
        path = os.path.join(directory, "tokenizer_config.json")
        config = _read_json(path) if os.path.isfile(path) else {}
    path = os.path.join(directory, "special_tokens_map.json")
    fallback = _read_json(path) if os.path.isfile(path) else {}
    extra = config.get("extra_special_tokens")
    names = list(SPECIAL_TOKENS) + (list(extra) if isinstance(extra, dict) else [])
    sources = [config, extra if isinstance(extra, dict) else {}, fallback]
    out = {}
    for name in names:
        for source in sources:
            text = _token_text(source.get(name))
            if text is not None:
                out[name] = text
                break
    return out


# ---- messages --------------------------------------------------------------------------------

def conversations(messages, *, argument: str = "messages") -> tuple[list[list[dict]], bool]:
    """(normalized conversations, whether ``messages`` was a list of them): vLLM's ``LLM.chat`` forms.

    A conversation is a non-empty list of messages; a message a dict with a string ``role`` and a
    ``content`` that is a string, None, or a list of ``{"type": "text", "text": ...}`` parts (joined
    with newlines, as vLLM's "string" content format does for text-only templates). Keys holding
    None are dropped (as transformers does); other keys (``name``, ``tool_calls``, ...) pass through.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise (RequestError if isinstance(messages, (list, tuple)) else RequestTypeError)(
            f"{argument}: a non-empty list of messages (or of conversations), got "
            f"{'an empty list' if isinstance(messages, (list, tuple)) else type(messages).__name__}")
    batched = isinstance(messages[0], (list, tuple))
    convs = list(messages) if batched else [messages]
    out = []
    for c, conv in enumerate(convs):
        where = f"{argument}[{c}]" if batched else argument
        if not isinstance(conv, (list, tuple)):
            raise RequestTypeError(f"{where}: a list of messages, got {type(conv).__name__}")
        if not conv:
            raise RequestError(f"{where}: an empty conversation")
        out.append([_message(m, f"{where}[{i}]") for i, m in enumerate(conv)])
    return out, batched


def _message(message, where: str) -> dict:
    if not isinstance(message, Mapping):
        raise RequestTypeError(f"{where}: a message is a dict with 'role' and 'content', got "
                               f"{type(message).__name__}")
    message = {k: v for k, v in message.items() if v is not None}
    # transformers copies a message's reasoning under the names templates read (Qwen3, gpt-oss)
    reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning") if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    if not isinstance(message.get("role"), str) or not message["role"]:
        raise RequestError(f"{where}: 'role' must be a non-empty string, got {message.get('role')!r}")
    content = message.get("content")
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}['content'][{j}]: only text parts ({{'type': 'text', 'text': ...}}) "
                                   f"are supported, got {part!r}"[:300])
            texts.append(part["text"])
        message["content"] = "\n".join(texts)
    elif content is not None and not isinstance(content, str):
        raise RequestTypeError(f"{where}['content']: a string or a list of text parts, got {type(content).__name__}")
    return _plain(message, where)


def _plain(value, where: str):
    """A copy built from JSON types only: the sandbox then sees no object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    raise RequestTypeError(f"{where}: messages hold JSON values only, got {type(value).__name__}")


# ---- the Jinja environment -------------------------------------------------------------------

@functools.lru_cache(maxsize=16)
def _compile(source: str, origin: str):
    jinja2 = _jinja2()
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template ({origin}) does not parse: {e.message} (line {e.lineno})") from e


def _jinja2():
    try:
        import jinja2
    except ImportError as e:
        raise MissingDependencyError("chat templates need jinja2: pip install 'jinja2>=3.1.6' (it comes with the "
                                     "'[serve]' extra: pip install \".[serve]\")") from e
    major, minor, patch = (int(p) if p.isdigit() else 0 for p in (jinja2.__version__.split(".") + ["0", "0"])[:3])
    if (major, minor, patch) < (3, 1, 6):
        raise MissingDependencyError(f"chat templates need jinja2 >= 3.1.6 (earlier versions have sandbox "
                                     f"escapes), found {jinja2.__version__}")
    return jinja2


@functools.lru_cache(maxsize=1)
def _environment():
    """transformers' environment (utils/chat_template_utils.py), built once."""
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; rendering
        is unchanged, so the block just renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson HTML-escapes (<, >, &, ') and takes no separators: templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        """``dict(...)`` and ``dict.fromkeys`` without the dict type itself (no class attribute walks)."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """``namespace(...)`` that refuses underscore attributes (a way into CPython internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env
