"""The check of ServerArgs' speculative-decoding flags (moved out of runtime/config.py to keep it short)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.errors import ServerArgsError

if TYPE_CHECKING:
    from runtime.config import ServerArgs


def check_speculative_flags(args: ServerArgs) -> None:
    algo = args.speculative_algorithm
    if args.speculative_num_draft_tokens < 1:
        raise ServerArgsError("--speculative-num-draft-tokens", f"must be positive, got {args.speculative_num_draft_tokens}")
    lo, hi = args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size
    if not 1 <= lo <= hi:
        raise ServerArgsError("--speculative-ngram-min-match-window-size", f"need 1 <= min <= max, got {lo}, {hi}")
    if algo == "STANDALONE" and not args.speculative_draft_model_path:
        raise ServerArgsError("--speculative-draft-model-path", "STANDALONE needs a draft model folder")
    if args.speculative_draft_model_path and algo != "STANDALONE":
        raise ServerArgsError("--speculative-draft-model-path", "is used only with --speculative-algorithm STANDALONE")
    if algo == "STANDALONE" and args.enable_dp_attention:
        # Every draft forward is a collective across DP ranks; IDLE ranks would have to mirror them all.
        raise ServerArgsError("--speculative-algorithm", "STANDALONE does not run with --enable-dp-attention "
                                                         "yet; use NGRAM")
