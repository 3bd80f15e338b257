"""The vLLM and SGLang extension fields of /v1/completions, /v1/chat/completions and /v1/responses (which
reads them through an OpenAISamplingFields made of its body's) that are more than a SamplingParams field:
the ones Shoal cannot honour, refused with a 400 naming them (answering without them would be a different
answer than the client asked for: beam search, server-side logits processors, stop regexes, a top-level
structural tag); SGLang's spellings of what Shoal has under vLLM's names (no_stop_trim, lora_path), which
must agree with those where both are given; and vLLM's documents, which join the chat template's
variables."""

from __future__ import annotations

from typing import Any

from runtime.gateway.errors import bad_request, not_supported
from runtime.gateway.protocol import OpenAISamplingFields
from runtime.gateway.state import GatewayState


def check_unhonoured(body: OpenAISamplingFields) -> None:
    """A 400 naming the first field whose value asks for what Shoal does not do."""
    if body.use_beam_search:
        raise not_supported("beam search (use_beam_search)", "use_beam_search")
    if body.length_penalty is not None and body.length_penalty != 1:
        raise not_supported("length_penalty other than 1 (it weighs beam search's hypotheses)", "length_penalty")
    if body.logits_processors:
        raise not_supported("logits_processors (server-side code)", "logits_processors")
    if body.custom_logit_processor:
        raise not_supported("custom_logit_processor (server-side code)", "custom_logit_processor")
    if body.structural_tag:
        raise not_supported("structural_tag", "structural_tag")
    if body.stop_regex:
        raise not_supported("stop_regex (stop takes strings)", "stop_regex")


def keeps_stop_str(body: OpenAISamplingFields) -> bool:
    """vLLM's include_stop_str_in_output, or SGLang's no_stop_trim (the same knob): a 400 if they disagree."""
    vllm, sglang = body.include_stop_str_in_output, body.no_stop_trim
    if vllm is not None and sglang is not None and vllm != sglang:
        raise bad_request(f"no_stop_trim ({str(sglang).lower()}) and include_stop_str_in_output "
                          f"({str(vllm).lower()}) are the same setting: give one, or agree", param="no_stop_trim")
    return bool(vllm if vllm is not None else sglang)


def request_lora(state: GatewayState, body: OpenAISamplingFields) -> str | None:
    """The adapter a body runs with: the one `model` names, or SGLang's lora_path (an adapter's name or its
    --lora-modules folder, as /generate reads it); an unknown one is a 400 naming lora_path, and with both
    they must name the same adapter."""
    by_model = state.lora_name(body.model)
    if body.lora_path is None:
        return by_model
    by_path = state.adapter_of(body.lora_path, "lora_path")
    if by_model is not None and by_model != by_path:
        raise bad_request(f"model names the adapter {by_model!r} but lora_path {body.lora_path!r} names "
                          f"{by_path!r}: give one, or the same", param="lora_path")
    return by_path


def template_kwargs(documents: list[dict[str, str]] | None,
                    kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs with vLLM's documents among them (Tokenizer.render_chat hands them to the
    template as apply_chat_template's documents); documents given both ways must be the same."""
    if documents is None:
        return kwargs
    if kwargs is not None and "documents" in kwargs and kwargs["documents"] != documents:
        raise bad_request("documents and chat_template_kwargs.documents differ: give them once",
                          param="documents")
    return {**(kwargs or {}), "documents": documents}
