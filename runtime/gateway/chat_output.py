"""ChatOutput: one chat choice's text turned into OpenAI's message parts — reasoning_content (with
--reasoning-parser), content, and tool_calls (tool_choice auto with --tool-call-parser, "required" or
a named function) — both as the finished message and as stream deltas. The stream is the same parse
of the growing text, sent as differences: a call's id, type and name in its first delta once its name is
whole (with its arguments so far), the rest of its arguments in the pieces that follow as the model writes them (ToolParser.streams_partial_calls;
CallSpan.stable holds back what may still change), so the deltas concatenate to the non-streamed message.
A call in the model's own format that never settles (the output ends inside it, its JSON breaks) is
content in the finished message; a stream cannot take back what it sent, so it keeps that call as far as
it went, and its raw text comes as content as well: the streamed content is always the message's."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.gateway.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from runtime.gateway.reasoning_parsers import ReasoningParser
from runtime.gateway.tool_parsers import ParsedOutput, ToolParser
from runtime.gateway.tool_parsers.json_scan import CallSpan


@dataclass(slots=True)
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


@dataclass(slots=True)
class _SentCall:
    id: str
    index: int  # its index in the stream: calls count in the order they first went out
    args: str = ""  # its arguments sent so far (what the parser returns next always extends them)


def _key(call: CallSpan, i: int) -> int:
    """Which call this is from one parse to the next: where it starts in the text (a call that went out and
    then turned out to be content leaves later calls at new list positions), else its list position."""
    return call.start if call.start >= 0 else -1 - i


class ChatOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None):
        self.reasoning_parser, self.tool_parser = reasoning, tools
        self.reasoning = ""
        self.parsed = ParsedOutput("")
        self._sent_reasoning = self._sent_content = 0
        self._calls: dict[int, _SentCall] = {}  # by _key

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
            settled = call.complete or final or call.stable is None
            args = call.arguments if settled else call.arguments[:call.stable]
            sent = self._calls.get(_key(call, i))
            if sent is None:
                # the parser's id (calls come only from a parser): Mistral's templates refuse any but 9
                # letters or digits in the next turn. The first piece of arguments rides in the same entry:
                # OpenAI and vLLM never repeat a call's index within one chunk.
                sent = self._calls[_key(call, i)] = _SentCall(self.tool_parser.new_call_id(), len(self._calls), args)
                delta.tool_calls.append(DeltaToolCall(index=sent.index, id=sent.id, type="function",
                                                      function=DeltaFunctionCall(name=call.name, arguments=args)))
            elif len(args) > len(sent.args):
                delta.tool_calls.append(DeltaToolCall(index=sent.index,
                                                      function=DeltaFunctionCall(arguments=args[len(sent.args):])))
                sent.args = args
        return delta

    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(id=sent.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                for i, c in enumerate(self.parsed.calls) if (sent := self._calls.get(_key(c, i))) is not None]

    @property
    def content(self) -> str:
        return self.parsed.content
