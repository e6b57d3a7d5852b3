"""Chat templates: a conversation checked (:func:`check_messages`) and rendered with a
checkpoint's Jinja template as transformers' ``apply_chat_template`` renders it, in a
sandboxed environment (``ImmutableSandboxedEnvironment``, ``trim_blocks``,
``lstrip_blocks``, loop controls), with ``messages``, ``add_generation_prompt``, the
tokenizer's special tokens (``bos_token``, ``eos_token``, ...), ``raise_exception``,
``strftime_now`` and a ``tojson`` that does not escape HTML.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

# Roles a message may have: the chat roles every template family uses (``developer`` for
# OpenAI-style templates, ``ipython`` for Llama 3.1 tool output).
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")


class ChatTemplateError(ValueError):
    """No chat template, or a template that cannot render these messages."""


def check_messages(messages) -> None:
    """Raises ValueError/TypeError naming the first malformed message of a conversation."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence) \
            or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, "
                         f"got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got "
                            f"{m!r:.80}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]['role'] is {role!r}; known roles: "
                             f"{', '.join(ROLES)}")
        content = m.get("content")
        if not isinstance(content, str):
            raise TypeError(f"messages[{i}]['content'] must be a str, got "
                            f"{type(content).__name__}: {content!r:.80}")
        # A model's reply may be empty (an eos first); what is said to it may not.
        if not content.strip() and role != "assistant":
            raise ValueError(f"messages[{i}] ({role}) has empty content: {content!r}")


_JINJA_ENV = None


def _jinja_env():
    """The sandboxed environment transformers renders chat templates in."""
    global _JINJA_ENV  # built once, on first use (importing jinja2 only then)
    if _JINJA_ENV is not None:
        return _JINJA_ENV
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks assistant tokens
        with it): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body
                                          ).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    _JINJA_ENV = env
    return env


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True, **variables) -> str:
    """Renders a Jinja chat template with ``messages``, ``add_generation_prompt`` and
    ``variables`` (``bos_token``, ``eos_token``, ``tools``...) as transformers does.

    Raises:
      ChatTemplateError: the template does not parse, or raised while rendering.
    """
    import jinja2

    try:
        compiled = _jinja_env().from_string(template)
        return compiled.render(messages=[dict(m) for m in messages],
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {e}") from None
