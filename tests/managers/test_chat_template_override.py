"""--chat-template: a template given as text or as a file replaces the tokenizer's (also for a tokenizer
that has none); a path that is not a file, or a template that does not parse, fails at start-up naming
the flag; a template that fails on a request is that request's 400."""

from __future__ import annotations

import pytest

from runtime import Engine
from runtime.config import ServerArgs
from runtime.errors import InvalidRequestError, ServerArgsError
from runtime.text.chat_template import read_chat_template
from runtime.text.tokenizer import Tokenizer, load_tokenizer

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
MESSAGES = [{"role": "user", "content": "Hello world"}]


def test_template_text_and_file_replace_the_tokenizers(tiny_llama, tmp_path):
    own = Tokenizer(tiny_llama)
    expected = own.encode("<user>Hello world<assistant>", add_special_tokens=False)
    assert own.apply_chat_template(MESSAGES) != expected  # the tiny tokenizer's own template is ChatML
    assert Tokenizer(tiny_llama, chat_template=TEMPLATE).apply_chat_template(MESSAGES) == expected
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert Tokenizer(tiny_llama, chat_template=str(path)).apply_chat_template(MESSAGES) == expected


def test_engine_uses_the_override(tiny_llama):
    with Engine(str(tiny_llama), device="cpu", max_total_tokens=1024, chat_template=TEMPLATE) as engine:
        ids = engine.tokenizer.apply_chat_template(MESSAGES)
        assert ids == engine.tokenizer.encode("<user>Hello world<assistant>", add_special_tokens=False)
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 3, "temperature": 0,
                                                               "ignore_eos": True})
        assert len(out["output_ids"]) == 3


def test_bad_templates_fail_at_startup_naming_the_flag(tiny_llama, tmp_path):
    with pytest.raises(ServerArgsError, match="--chat-template.*neither a readable UTF-8 file"):
        ServerArgs(chat_template=str(tmp_path / "missing.jinja"))
    latin1 = tmp_path / "latin1.jinja"
    latin1.write_bytes("café".encode("latin-1"))
    with pytest.raises(ServerArgsError, match="--chat-template.*UTF-8"):
        ServerArgs(chat_template=str(latin1))
    with pytest.raises(ServerArgsError, match="--chat-template.*not a valid Jinja template"):
        ServerArgs(chat_template="{% for m in messages %}no end")
    # Never mistaken for a missing tokenizer (which would quietly serve token ids only).
    with pytest.raises(ServerArgsError, match="--chat-template"):
        load_tokenizer(tiny_llama, (), "{% for m in messages %}no end")


def test_templates_transformers_accepts_are_accepted():
    # Loop controls and {% generation %} are transformers' extensions, not plain Jinja.
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
                "{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}")
    assert read_chat_template(template) == template
    assert ServerArgs(chat_template=template).chat_template == template


def test_a_template_failing_on_a_request_is_that_requests_error(tiny_llama):
    tok = Tokenizer(tiny_llama, chat_template="{{ raise_exception('only user turns') }}")
    with pytest.raises(InvalidRequestError, match="only user turns"):
        tok.apply_chat_template(MESSAGES)
