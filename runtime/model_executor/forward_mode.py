"""ForwardMode: what kind of forward a batch is, with predicates so callers never compare raw values."""

from __future__ import annotations

from enum import IntEnum, auto


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill, possibly on top of a cached prefix
    DECODE = auto()  # one new token per request
    MIXED = auto()  # extend tokens followed by decode tokens in one flat batch
    IDLE = auto()  # zero tokens: keeps collectives in step on a DP rank with no work
    TARGET_VERIFY = auto()  # speculative decoding: the target model checks draft tokens
    DRAFT_EXTEND = auto()  # speculative decoding: the draft model extends on accepted tokens
    DLLM_EXTEND = auto()  # diffusion LLM block extend
    SPLIT_PREFILL = auto()  # a prefill split across layers (PD-multiplexing)

    def is_extend(self) -> bool:
        """Modes whose attention runs the extend path (new tokens over a cached prefix)."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND,
                        ForwardMode.TARGET_VERIFY, ForwardMode.SPLIT_PREFILL, ForwardMode.DLLM_EXTEND)

    def is_pure_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self is ForwardMode.MIXED

    def is_idle(self) -> bool:
        return self is ForwardMode.IDLE

    def is_target_verify(self) -> bool:
        return self is ForwardMode.TARGET_VERIFY

    def is_draft_extend(self) -> bool:
        return self is ForwardMode.DRAFT_EXTEND

    def is_dllm_extend(self) -> bool:
        return self is ForwardMode.DLLM_EXTEND

    def is_split_prefill(self) -> bool:
        return self is ForwardMode.SPLIT_PREFILL

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_cuda_graph(self) -> bool:
        """Modes with a fixed shape per batch size, so a captured graph can replay them."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)

    def is_executable(self) -> bool:
        """Modes the ModelRunner runs today; the rest wait for diffusion decoding / PD-multiplexing."""
        return self in (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.IDLE,
                        ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)
