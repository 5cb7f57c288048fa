"""A checkpoint's chat template (jinja2), rendered with the semantics transformers' ``apply_chat_template``
gives it, so that the same messages become the same prompt text here as there.

Those semantics (transformers' documentation on chat templates): an immutable sandboxed jinja2
environment with ``trim_blocks`` and ``lstrip_blocks`` and the ``loopcontrols`` extension; a ``tojson``
filter that does not escape HTML (``json.dumps`` with ``ensure_ascii=False`` and optional ``indent``,
``separators``, ``sort_keys``); the globals ``raise_exception(message)`` and ``strftime_now(format)``; a
``{% generation %}...{% endgeneration %}`` block that renders its body; and the variables ``messages``,
``tools``, ``documents``, ``add_generation_prompt`` plus the special tokens (``bos_token``,
``eos_token``, ...). Templates are untrusted code from a checkpoint: the sandbox refuses attribute access
to Python internals.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from colibri_plan.errors import FormatError, InputError

__all__ = ["ChatTemplate", "compile_template"]


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}`` marks the assistant's part for training masks; rendering keeps its body."""

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
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=8)
def compile_template(source: str):
    """The compiled jinja2 template of ``source`` (cached: a server renders one template many times).

    Raises:
        FormatError: a syntax error (line and message).
    """
    import jinja2

    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise FormatError(f"the chat template does not compile (line {exc.lineno}: {exc.message})") from None


class ChatTemplate:
    """A chat template with the special tokens it is rendered with.

    Args:
        source: the jinja2 text (tokenizer_config.json's ``chat_template`` or ``chat_template.jinja``).
        special_tokens: ``{"bos_token": "<s>", "eos_token": "</s>", ...}`` passed to the template.
        where: the file it came from, for messages.

    Raises:
        FormatError: the template does not compile.
    """

    def __init__(self, source: str, special_tokens: dict | None = None, where: str = "chat template"):
        self.source, self.where = source, where
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = compile_template(source)
        except FormatError as exc:
            raise FormatError(f"{where}: {exc}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
               documents: list | None = None, **extra) -> str:
        """The prompt text of ``messages`` (``[{"role": ..., "content": ...}, ...]``), ending with the
        assistant's opening when ``add_generation_prompt``.

        Raises:
            InputError: the template refused the messages (its ``raise_exception``, e.g. roles that do not
            alternate) or failed on them (a missing field, a wrong type), with the template's message.
        """
        import jinja2

        check_messages(messages)
        try:
            return self._template.render(messages=messages, tools=tools, documents=documents,
                                         add_generation_prompt=bool(add_generation_prompt),
                                         **{**self.special_tokens, **extra})
        except jinja2.exceptions.SecurityError as exc:
            raise InputError(f"{self.where}: the sandbox refused the template: {exc}") from None
        except jinja2.exceptions.TemplateError as exc:
            raise InputError(f"the chat template refused the messages: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise InputError(f"the chat template failed on these messages ({type(exc).__name__}: {exc}); "
                             "check each message's role and content") from None


def check_messages(messages) -> None:
    """Refuse what no template can render: not a non-empty list of objects with a string ``role``.

    Raises:
        InputError: naming the first bad message.
    """
    if not isinstance(messages, list) or not messages:
        raise InputError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InputError(f"messages[{i}] must be an object with a string 'role'")
