"""ChatOutput: one chat choice's text turned into OpenAI's message parts — reasoning_content (with
--reasoning-parser), content, and tool_calls (tool_choice auto with --tool-call-parser, "required" or
a named function) — both as the finished message and as stream deltas. The stream is the same parse
of the growing text, sent as differences: a call's id, type and name in its first delta, its arguments
in the pieces that follow, so the deltas concatenate to the non-streamed message. A call in the model's
own format (tool_choice "auto") goes out only once it settled (ToolParser.streams_partial_calls): one
the output ends inside is content in the end, and a stream cannot take back a delta it sent."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.gateway.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from runtime.gateway.reasoning_parsers import ReasoningParser
from runtime.gateway.tool_parsers import ParsedOutput, ToolParser


@dataclass(slots=True)
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


@dataclass(slots=True)
class _SentCall:
    id: str
    args_sent: int = 0


class ChatOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None):
        self.reasoning_parser, self.tool_parser = reasoning, tools
        self.reasoning = ""
        self.parsed = ParsedOutput("")
        self._sent_reasoning = self._sent_content = 0
        self._calls: list[_SentCall] = []

    def update(self, text: str, final: bool) -> ChatDelta:
        """Parses the whole text so far; returns what is new since the previous update."""
        reasoning, content = self.reasoning_parser.split(text, final) if self.reasoning_parser else ("", text)
        try:
            parsed = self.tool_parser.parse(content, final) if self.tool_parser else ParsedOutput(content)
        except ValueError:  # not the format after all (a malformed call): the text is plain content
            parsed = ParsedOutput(content)
        self.reasoning, self.parsed = reasoning, parsed
        delta = ChatDelta(reasoning[self._sent_reasoning:], parsed.content[self._sent_content:])
        self._sent_reasoning = max(self._sent_reasoning, len(reasoning))
        self._sent_content = max(self._sent_content, len(parsed.content))
        partial_ok = self.tool_parser is not None and self.tool_parser.streams_partial_calls
        for i, call in enumerate(parsed.calls):
            if call.name is None or not (call.complete or partial_ok):
                break  # nothing of a call goes out before its name, nor before it settled where it may not
            if i == len(self._calls):
                # the parser's id (calls come only from a parser): Mistral's templates refuse any but 9
                # letters or digits in the next turn
                self._calls.append(_SentCall(self.tool_parser.new_call_id()))
                delta.tool_calls.append(DeltaToolCall(index=i, id=self._calls[i].id, type="function",
                                                      function=DeltaFunctionCall(name=call.name, arguments="")))
            sent = self._calls[i]
            piece = call.arguments[sent.args_sent:]
            if piece:
                delta.tool_calls.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=piece)))
                sent.args_sent = len(call.arguments)
        return delta

    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(id=sent.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                for c, sent in zip(self.parsed.calls, self._calls)]

    @property
    def content(self) -> str:
        return self.parsed.content
