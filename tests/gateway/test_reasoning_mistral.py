"""--reasoning-parser mistral (Magistral's [THINK]...[/THINK]) on fixed text, parsed whole and streamed alike
(check_stream), alone and before a v11 tool call; its tags for grammar_gate; and one request through the
gateway."""

from __future__ import annotations

import json

import openai
import pytest
from test_tool_parser_qwen3_coder import check_stream, streamed_chat

from runtime import ServerArgs
from runtime.gateway.chat_output import ChatOutput
from runtime.gateway.reasoning_parsers import create_reasoning_parser, reasoning_parser_names, reasoning_tags
from runtime.gateway.reasoning_parsers.grammar_gate import GrammarGate, grammar_gate
from runtime.gateway.server import serve_in_thread
from runtime.gateway.tool_parsers import create_tool_parser


@pytest.mark.parametrize("text, reasoning, content", [
    ("[THINK]Let me think.\n[/THINK]\n\nParis.", "Let me think.\n", "Paris."),
    ("Paris, no thinking.", "", "Paris, no thinking."),
    ("[THINK]cut off mid tho", "cut off mid tho", ""),
    ("Before. [THINK]why[/THINK]After.", "why", "Before. After."),
    ("stray[/THINK] end tag", "", "stray end tag"),
    ("[THINK]a[/THINK]b [THINK] again", "a", "b [THINK] again"),
    ("[THINK][/THINK]", "", ""),
    ("[THINK ] is text", "", "[THINK ] is text"),
])
def test_split(text, reasoning, content):
    assert "mistral" in reasoning_parser_names()
    out = check_stream(lambda: ChatOutput(create_reasoning_parser("mistral"), None), text)
    assert (out.reasoning, out.content) == (reasoning, content)


def test_reasoning_then_v11_tool_call():
    args = json.dumps({"city": "Paris"})
    text = f"[THINK]I need the weather.[/THINK][TOOL_CALLS]get_weather[ARGS]{args}"
    out = check_stream(lambda: ChatOutput(create_reasoning_parser("mistral"), create_tool_parser("mistral")), text)
    assert (out.reasoning, out.content) == ("I need the weather.", "")
    assert [(c.function.name, c.function.arguments) for c in out.tool_calls()] == [("get_weather", args)]


class _Tok:
    """A tokenizer stand-in: [/THINK] is one token (35); </think> three."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return {"[/THINK]": [35], "</think>": [1, 2, 3]}[text]


def test_grammar_gate_waits_for_the_parsers_own_tag():
    tags = reasoning_tags("mistral")
    assert tags == ("[THINK]", "[/THINK]") and reasoning_tags("qwen3") == ("<think>", "</think>")
    tok = _Tok()
    assert grammar_gate(tok, "[INST]hi[/INST]", tags) == GrammarGate(35, False)
    assert grammar_gate(tok, "[INST]hi[/INST][THINK]done[/THINK]", tags) == GrammarGate(None, True)
    assert grammar_gate(tok, "[INST]hi[/INST]") is None  # </think> is no single token here
    with pytest.raises(ValueError, match="mistral"):
        reasoning_tags("nope")


def test_through_the_gateway(gw_engine):
    with serve_in_thread(gw_engine, ServerArgs(reasoning_parser="mistral"), port=0) as h:
        client = openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(model="llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=120, temperature=0,
                  extra_body={"regex": r"\[THINK\][a-z]{1,8}\[/THINK\][A-Z][a-z]{1,8}\."})
        msg = client.chat.completions.create(**kw).choices[0].message
        reasoning, content = msg.model_extra["reasoning_content"], msg.content
        assert reasoning.isalpha() and reasoning.islower() and content[0].isupper() and content.endswith(".")
        s_content, s_reasoning, _ = streamed_chat(client, **kw)
        assert (s_reasoning, s_content) == (reasoning, content)
