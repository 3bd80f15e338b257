"""ResponseItems: the output items of one /v1/responses answer — a reasoning item (with
--reasoning-parser), the assistant message, function calls — built from the same parse of the growing
text that chat completions stream (ChatOutput's deltas), with the stream events that announce them.

Both answers run through it: a stream feeds each delta as it comes; the non-streamed body feeds the
whole final parse at once and drops the events. So an item's id, order and text in the final Response
are the ones its stream events named, which the openai SDK's stream accumulator checks.

One item is open at a time, as OpenAI streams them: reasoning closes when the answer or a call begins,
the message when a call begins, a call when the next one or text after it begins (its arguments are whole
by then: a tool parser settles a call before it names the next or reads text past it; a call it streamed
but that never settled stays as far as it went, a stream taking back nothing). Every event takes the
next sequence_number.

Logprobs (include message.output_text.logprobs) go with the message's text: each text delta carries
those of the tokens the caller gave it, and the item keeps them all for its done event and its part."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from msgspec import UNSET

from runtime.gateway.chat_output import ChatDelta
from runtime.gateway.protocol import ChatTokenLogprob, DeltaToolCall
from runtime.gateway.responses_protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    FunctionCallItem,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningItem,
    ReasoningText,
    TextDeltaEvent,
    TextDoneEvent,
)

_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class _Item:
    kind: str  # reasoning | message | function_call
    id: str
    output_index: int
    text: str = ""  # the reasoning, the message's text, or the call's arguments
    call_id: str = ""
    name: str = ""
    status: str = "in_progress"
    logprobs: list[ChatTokenLogprob] = field(default_factory=list)  # the message's, in order

    def part(self) -> OutputText | ReasoningText:
        if self.kind == "reasoning":
            return ReasoningText(text=self.text)
        return OutputText(text=self.text, logprobs=list(self.logprobs))

    def struct(self, with_part: bool = True) -> OutputItem:
        """A fresh Struct of the item as it is now (events are encoded later: they must not share state).
        with_part False: as announced, before its content part exists."""
        parts = [self.part()] if with_part else []
        if self.kind == "message":
            return OutputMessage(id=self.id, content=parts, status=self.status)
        if self.kind == "reasoning":
            return ReasoningItem(id=self.id, content=parts, status=self.status)
        return FunctionCallItem(id=self.id, call_id=self.call_id, name=self.name, arguments=self.text,
                                status=self.status)


class ResponseItems:
    def __init__(self) -> None:
        self.items: list[_Item] = []
        self._open: _Item | None = None
        self._calls: dict[int, _Item] = {}  # ChatOutput's tool-call index → its item
        self._seq = 0

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq - 1

    @property
    def open_kind(self) -> str | None:
        return self._open.kind if self._open is not None else None

    def feed(self, d: ChatDelta, logprobs: list[ChatTokenLogprob] | None = None) -> list[Any]:
        """Events for one delta of the parsed output; logprobs: its text's tokens (with content only)."""
        events: list[Any] = []
        if d.reasoning:
            item = self._ensure_open("reasoning", events)
            item.text += d.reasoning
            events.append(ReasoningDeltaEvent(sequence_number=self.next_seq(), item_id=item.id,
                                              output_index=item.output_index, content_index=0, delta=d.reasoning))
        # One delta may hold the open call's last pieces and the text after the call: the pieces land
        # first, as the text that follows closes the call (its done event carries its whole arguments).
        rest = d.tool_calls
        if (call := self._open) is not None and call.kind == "function_call":
            rest = [tc for tc in d.tool_calls if tc.id is not UNSET or self._calls.get(tc.index) is not call]
            for tc in d.tool_calls:
                if tc.id is UNSET and self._calls.get(tc.index) is call:
                    self._arguments(call, tc, events)
        if d.content:
            events += self.text_delta(d.content, logprobs or [])
        for tc in rest:
            if tc.id is not UNSET:  # a new call: its id and name open its item; the entry may carry a first piece
                self._close(events)
                self._calls[tc.index] = self._add("function_call", events, call_id=tc.id, name=tc.function.name)
            self._arguments(self._calls[tc.index], tc, events)
        return events

    def _arguments(self, item: _Item, tc: DeltaToolCall, events: list[Any]) -> None:
        piece = tc.function.arguments if tc.function is not UNSET else ""
        if piece:
            item.text += piece
            events.append(ArgumentsDeltaEvent(sequence_number=self.next_seq(), item_id=item.id,
                                              output_index=item.output_index, delta=piece))

    def text_delta(self, text: str, logprobs: list[ChatTokenLogprob]) -> list[Any]:
        """A text delta of the message (opened if need be). Empty text with logprobs: tokens that showed
        no text of their own (an end token, a stop string) still reach the message's logprobs."""
        events: list[Any] = []
        item = self._ensure_open("message", events)
        item.text += text
        item.logprobs += logprobs
        events.append(TextDeltaEvent(sequence_number=self.next_seq(), item_id=item.id, output_index=item.output_index,
                                     content_index=0, delta=text, logprobs=logprobs))
        return events

    def finish(self, incomplete: bool) -> list[Any]:
        """Closes the output: an answer with no item at all still gets its (empty) message, so
        output_text is "" rather than missing; the item the output ended in is incomplete on a length end."""
        events: list[Any] = []
        if not self.items:
            self._ensure_open("message", events)
        self._close(events, "incomplete" if incomplete else "completed")
        return events

    def abandon(self) -> None:
        """A failed output: the open item ends incomplete, announced by no event (the stream is over)."""
        if self._open is not None:
            self._open.status = "incomplete"
            self._open = None

    def output(self) -> list[OutputItem]:
        return [item.struct() for item in self.items]

    # ---- items ------------------------------------------------------------------------------------
    def _ensure_open(self, kind: str, events: list[Any]) -> _Item:
        if self._open is not None and self._open.kind == kind:
            return self._open
        self._close(events)
        item = self._add(kind, events)
        if kind != "function_call":
            events.append(ContentPartEvent(type="response.content_part.added", sequence_number=self.next_seq(),
                                           item_id=item.id, output_index=item.output_index, content_index=0,
                                           part=item.part()))
        return item

    def _add(self, kind: str, events: list[Any], call_id: str = "", name: str = "") -> _Item:
        item = _Item(kind, new_id(_PREFIX[kind]), len(self.items), call_id=call_id, name=name)
        self.items.append(item)
        self._open = item
        events.append(OutputItemEvent(type="response.output_item.added", sequence_number=self.next_seq(),
                                      output_index=item.output_index, item=item.struct(with_part=False)))
        return item

    def _close(self, events: list[Any], status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item.status = status
        where = {"item_id": item.id, "output_index": item.output_index}
        seq = self.next_seq()
        if item.kind == "function_call":
            events.append(ArgumentsDoneEvent(sequence_number=seq, name=item.name, arguments=item.text, **where))
        else:
            done: ReasoningDoneEvent | TextDoneEvent
            if item.kind == "reasoning":
                done = ReasoningDoneEvent(sequence_number=seq, content_index=0, text=item.text, **where)
            else:
                done = TextDoneEvent(sequence_number=seq, content_index=0, text=item.text,
                                     logprobs=list(item.logprobs), **where)
            events += [done, ContentPartEvent(type="response.content_part.done", sequence_number=self.next_seq(),
                                              content_index=0, part=item.part(), **where)]
        events.append(OutputItemEvent(type="response.output_item.done", sequence_number=self.next_seq(),
                                      output_index=item.output_index, item=item.struct()))
