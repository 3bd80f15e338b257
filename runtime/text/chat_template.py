"""read_chat_template: the --chat-template value (a Jinja template, or a file holding one) as template
text, checked the way transformers will compile it, so a bad one fails at start naming the flag."""

from __future__ import annotations

from pathlib import Path

from runtime.errors import ServerArgsError


def read_chat_template(value: str) -> str:
    if "{" in value:
        template = value
    else:
        try:
            template = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ServerArgsError("--chat-template", f"{value!r} is neither a readable UTF-8 file nor a Jinja "
                                                     f"template ({e})") from None
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        _compile_jinja_template(template)  # transformers' own environment: loop controls, {% generation %}
    except ImportError:  # a transformers without it: the closest plain environment
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        try:
            ImmutableSandboxedEnvironment(extensions=[loopcontrols]).parse(template)
        except jinja2.TemplateSyntaxError as e:
            raise ServerArgsError("--chat-template", f"not a valid Jinja template: {e}") from None
    except jinja2.TemplateSyntaxError as e:
        raise ServerArgsError("--chat-template", f"not a valid Jinja template: {e}") from None
    return template
