"""Typed errors. Each names what was wrong so the boundary that caught it can say so (HTTP 4xx, CLI)."""

from __future__ import annotations


class ShoalError(Exception):
    """Base of every error Shoal raises on purpose."""


class InvalidRequestError(ShoalError, ValueError):
    """A request that can never be served as sent (the gateway maps it to HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request_error"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ContextLengthError(InvalidRequestError):
    def __init__(self, prompt_tokens: int, max_new_tokens: int, context_len: int):
        super().__init__(
            f"This model's maximum context length is {context_len} tokens, but the request has "
            f"{prompt_tokens} prompt tokens and asks for up to {max_new_tokens} new tokens "
            f"({prompt_tokens + max_new_tokens} in total). Shorten the prompt or lower max_tokens.",
            param="prompt",
            code="context_length_exceeded",
        )
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.context_len = context_len

    def __reduce__(self):  # pickled across Ray actors: rebuilt from its own arguments, not the message
        return type(self), (self.prompt_tokens, self.max_new_tokens, self.context_len)


class ServerArgsError(ShoalError, ValueError):
    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag, self.detail = flag, message

    def __reduce__(self):  # pickled across Ray actors (a gateway actor's start-up error reaches the CLI)
        return type(self), (self.flag, self.detail)


class ModelConfigError(ShoalError, ValueError):
    """config.json names an unsupported architecture or has a missing/invalid field."""


class WeightLoadError(ShoalError, RuntimeError):
    """A checkpoint file or tensor is missing or has the wrong shape."""


class UnsupportedQuantizationError(WeightLoadError):
    """A checkpoint's quantization layout (config.json quantization_config) that Shoal cannot load."""

    def __init__(self, layout: str, detail: str = ""):
        self.layout, self.detail = layout, detail
        super().__init__(f"unsupported quantization layout {layout!r}" + (f": {detail}" if detail else "")
                         + "; Shoal loads FP8 checkpoints (compressed-tensors float-quantized with channel or "
                           "tensor scales, fbgemm_fp8, quant_method fp8 per tensor or with weight_block_size), "
                           "4-bit ones (AWQ gemm, GPTQ v1, compressed-tensors pack-quantized int4), or quantizes "
                           "bf16/fp16 ones with --quantization fp8")

    def __reduce__(self):
        return type(self), (self.layout, self.detail)


class DoubleFreeError(ShoalError, RuntimeError):
    """A KV or request slot was freed twice: an accounting bug, never a user error."""


class RequestAbortedError(ShoalError):
    """The request was aborted (client disconnect, explicit abort) before it finished."""


class EngineUnavailableError(ShoalError):
    """The engine is starting, shutting down, or the replica holding the request died."""
