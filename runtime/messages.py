"""Typed messages that cross a boundary: gateway ⇄ scheduler (requests, output deltas, stats) and
scheduler → TP workers (one WorkerBatch per step, one BatchResult back). msgspec Structs, so the
same objects pass by reference in one process and encode cheaply between Ray actors."""

from __future__ import annotations

from itertools import zip_longest

import msgspec

from runtime.admin_messages import ProfileControl
from runtime.lora.lora_messages import LoraLoad as LoraLoad  # re-exported: the LoRA messages live there
from runtime.lora.lora_messages import LoraRequests
from runtime.lora.lora_messages import LoraUpdate as LoraUpdate
from runtime.sampling.params import SamplingParams


class GenerateRequest(msgspec.Struct, kw_only=True):
    rid: str
    # A tuple (a list given is made one): CPython stops tracking a tuple of ints at the first collection it
    # survives, so the prompts a gateway or engine holds while requests run are not walked by every full
    # collection, which stops the process (runtime/gc_guard.py).
    input_ids: tuple[int, ...]
    sampling_params: SamplingParams
    return_input_logprob: bool = False
    # Top N of each prompt position after the first (0 = none); implies return_input_logprob, since the
    # prompt is scored the same way (whole, never from the prefix cache) and OpenAI lists both.
    input_top_logprobs_num: int = 0
    arrival_time: float = 0.0
    # Failover: output tokens this request already produced (and streamed) on a replica that died. The
    # scheduler starts it as if retracted with them (sampling positions, penalties, stop checks and
    # max_new_tokens all count them) and streams only what comes after.
    resumed_output_ids: list[int] = []
    # An embedding request (an --is-embedding server's only kind): prefilled, pooled, finished; no token.
    embed: bool = False
    # --enable-lora: the adapter (a --lora-modules name) this request runs with; None: the base model.
    lora_name: str | None = None
    priority: int = 0  # --enable-priority-scheduling: queue order and preemption (runtime/managers/priority.py)
    # vLLM's and SGLang's: prefix-cache KV is shared only between requests of equal salt (None with None), so
    # one tenant's cache hits (timing, cached_tokens) tell nothing of another's prompts. Non-empty.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if type(self.input_ids) is not tuple:
            self.input_ids = tuple(self.input_ids)


class FinishReason(msgspec.Struct, frozen=True):
    kind: str  # "length" | "stop" | "abort" | "error"
    matched: int | str | None = None  # the stop token id or stop string that ended it
    message: str | None = None
    # The request parameter an "error" is the user's to fix (a 400 naming it), e.g. allowed_token_ids that
    # leave a grammar no token; None: the engine's own failure.
    param: str | None = None
    # An "error" that is the engine's, not the request's (runtime/engine_client.py: ENGINE_UNHEALTHY, REPLICA_FAILED):
    # the gateway answers 503, the Ray client moves the request to another replica. None: the request's own.
    code: str | None = None

    def openai_reason(self) -> str:
        return {"length": "length", "stop": "stop"}.get(self.kind, self.kind)


class FirstTokenTrace(msgspec.Struct, kw_only=True):
    """Where a request's first token spent its time on the way out (CLOCK_MONOTONIC seconds, one clock for
    every process of a host: time.monotonic / time.perf_counter on Linux). Each hop stamps its own field;
    0.0 = a hop this path does not have (the in-process Engine has no actor queue, poll or client pump)."""

    scheduled: float  # its prefill was put in a batch
    result: float  # that batch's result reached the scheduler
    queued: float = 0.0  # scheduler actor: the delta was queued for its consumer
    polled: float = 0.0  # scheduler actor: the answer carrying it (pushed frame or poll reply) was about to go
    received: float = 0.0  # Ray client: its pump decoded that poll answer


class RequestOutput(msgspec.Struct, kw_only=True):
    """A delta: tokens generated since the previous output of the same request."""

    rid: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    input_logprobs: list[float | None] | None = None  # only in the first delta, when asked
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None  # likewise; position 0 is None
    # With input_logprobs: each prompt token's rank in its distribution (1 = the most likely); position 0 None.
    input_token_ranks: list[int | None] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_time_s: float = 0.0
    trace: FirstTokenTrace | None = None  # on the delta carrying the first output token
    embedding: list[float] | None = None  # an embedding request's pooled vector, on its final output

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by a later one of the same request, as one delta (a slow consumer takes
        what piled up in one go instead of paying per-delta costs)."""
        def cat(a, b):
            return None if a is None and b is None else (a or []) + (b or [])

        return RequestOutput(
            rid=self.rid, new_token_ids=self.new_token_ids + later.new_token_ids,
            new_logprobs=cat(self.new_logprobs, later.new_logprobs),
            new_top_logprobs=cat(self.new_top_logprobs, later.new_top_logprobs),
            input_logprobs=self.input_logprobs if self.input_logprobs is not None else later.input_logprobs,
            input_top_logprobs=(self.input_top_logprobs if self.input_top_logprobs is not None
                                else later.input_top_logprobs),
            input_token_ranks=(self.input_token_ranks if self.input_token_ranks is not None
                               else later.input_token_ranks),
            finished=later.finished, finish_reason=later.finish_reason, prompt_tokens=later.prompt_tokens,
            completion_tokens=later.completion_tokens, cached_tokens=later.cached_tokens,
            queue_time_s=self.queue_time_s, trace=self.trace if self.trace is not None else later.trace,
            embedding=later.embedding if later.embedding is not None else self.embedding)


class SamplingBatch(msgspec.Struct, kw_only=True):
    """Per-request sampling settings of one batch, in batch order."""

    temperatures: list[float]
    top_ps: list[float]
    top_ks: list[int]
    min_ps: list[float]
    seeds: list[int]
    steps: list[int]  # output position of the token being sampled: seeds the per-request noise
    repetition_penalties: list[float]
    frequency_penalties: list[float]
    presence_penalties: list[float]
    penalty_tokens: list[list[int]]  # prompt + output ids where a penalty is set, else []
    prompt_lens: list[int]
    blocked_token_ids: list[list[int]]  # EOS/stop ids banned until min_new_tokens is reached
    top_logprobs_nums: list[int]
    return_logprob: bool = False
    logit_biases: list[list[tuple[int, float]]] = []  # per request (token, bias); [] when no request has any
    # Structured output: the rows a grammar constrains this step and their allowed tokens, an int32
    # bitmask [len(grammar_rows), ceil(vocab / 32)] as little-endian bytes (bit t of word t // 32 set:
    # token t allowed). In the message, so every TP rank masks, and so samples, alike.
    grammar_rows: list[int] = []
    grammar_mask: bytes = b""
    # allowed_token_ids: the rows limited to a set of ids, and those sets as int32 bitmasks in the grammar
    # mask's layout, all rows one width (each request's own, ceil((max id + 1) / 32) words, zero-padded to
    # the widest: an id past the mask is not allowed). Each Req packs its mask once; a step only joins them.
    allowed_rows: list[int] = []
    allowed_mask: bytes = b""
    # Bad words: per request its token id sequences, and its last output ids their prefixes are matched
    # against (-1: a token still sampling on the device, which matches any); both [] when no request has any.
    bad_words_ids: list[list[list[int]]] = []
    bad_words_context: list[list[int]] = []

    @property
    def all_greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperatures)

    @property
    def edits_logits(self) -> bool:
        """Penalties, biases, banned or allowed ids or a grammar change some row's logits before the choice."""
        return (any(self.penalty_tokens) or any(self.blocked_token_ids) or any(self.logit_biases)
                or bool(self.grammar_rows) or bool(self.allowed_rows) or any(self.bad_words_ids))

    @property
    def raw_argmax(self) -> bool:
        """Every row's token is the argmax of its raw logits and nothing else is asked (no logprobs)."""
        return self.all_greedy and not self.edits_logits and not self.return_logprob


class PrefixWrite(msgspec.Struct, array_like=True):
    """KV slots of a cached prefix to copy into a request's row of the worker's token table."""

    req_pool_idx: int
    start: int
    kv_indices: list[int]


class SpecInfo(msgspec.Struct, kw_only=True):
    """A TARGET_VERIFY step's speculative part, per request in batch order. Request i's new tokens are its
    last token then num_drafts[i] drafts (zeros when the worker's draft model fills them in)."""

    num_drafts: list[int]
    draft_on_worker: bool = False  # STANDALONE: the worker's draft model proposes the drafts
    # STANDALONE: tokens before the last whose draft-model KV is missing (a fully accepted step leaves its
    # final draft so), with their KV slots: the draft re-reads them in its DRAFT_EXTEND.
    lag_ids: list[list[int]] = []
    lag_slots: list[list[int]] = []
    min_new_left: list[int] = []  # outputs still below min_new_tokens: EOS/stop stay blocked that many rows


class WorkerBatch(msgspec.Struct, kw_only=True):
    """One step's work for every TP rank. Requests are ordered extend-first (MIXED: then decodes);
    each has prefix_len cached tokens and seq_len - prefix_len new ones (a decode has exactly one)."""

    batch_id: int
    forward_mode: int
    input_ids: list[int]
    req_pool_indices: list[int]
    seq_lens: list[int]
    prefix_lens: list[int]
    out_cache_loc: list[int]
    prefix_writes: list[PrefixWrite] = []
    sampling: SamplingBatch | None = None
    return_input_logprob: list[bool] = []
    input_top_logprobs_nums: list[int] = []  # per request where any asks (else []): top N of each input position
    # DP attention: every rank's token count this step, so the MLP gather is sized alike everywhere.
    global_num_tokens: list[int] | None = None
    spec: SpecInfo | None = None  # TARGET_VERIFY only
    # An embedding server's EXTEND (non-empty only there): per request, whether this chunk ends its prompt,
    # so the worker pools it; no logits, no sampling.
    embed_done: list[bool] = []
    # --enable-lora, where some request of the step runs an adapter (else []): per request its slot (0: base).
    lora_ids: list[int] = []
    # --enable-lora: [slot, adapter id] pairs to load before this step (a slot's previous adapter unused now).
    lora_loads: list[list[int]] = []
    # --enable-lora: ids of adapters unloaded at run time whose last request has finished: every rank forgets them.
    lora_drops: list[int] = []
    profile: ProfileControl | None = None  # a control frame (batch_id -1, nothing to run): ranks 1.. apply it


class BatchResult(msgspec.Struct, kw_only=True):
    batch_id: int
    next_token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    input_logprobs: list[list[float]] | None = None  # per request that asked, logprob of each input token after the first
    # Per request where any asked top N (else None): for each input token after the first, the top N
    # (id, logprob) of the distribution it was drawn from, best first; [] for a request that asked none.
    input_top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    input_token_ranks: list[list[int]] | None = None  # alongside input_logprobs: each token's rank, 1 = most likely
    forward_s: float = 0.0
    all_idle: bool = False  # DP attention: every rank was idle, so nothing ran
    device_s: float = 0.0  # device time of the batch (CUDA events); 0 on CPU
    # TARGET_VERIFY: tokens each request emits (accepted drafts + one); next_token_ids, logprobs and
    # top_logprobs then hold those tokens of all requests back to back.
    spec_counts: list[int] | None = None
    # An embedding batch: per request its pooled vector where embed_done, else []; None for other batches.
    embeddings: list[list[float]] | None = None


# vLLM's bounds of vllm:iteration_tokens_total (tokens per engine step): SchedulerStats.iteration_tokens' buckets.
ITERATION_TOKEN_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ModeStats(msgspec.Struct):
    batches: int = 0
    tokens: int = 0
    time_s: float = 0.0  # forward time of those batches: tokens / time_s is the mode's recent rate


class SchedulerStats(msgspec.Struct, kw_only=True):
    num_running_reqs: int = 0
    num_queue_reqs: int = 0
    num_used_tokens: int = 0  # KV slots held by running requests
    num_cached_tokens: int = 0  # KV slots held only by the evictable prefix cache
    max_total_tokens: int = 0
    gen_throughput: float = 0.0
    forward_modes: dict[str, ModeStats] = {}
    retractions: int = 0
    evictions: int = 0
    cache_hit_tokens: int = 0
    cache_query_tokens: int = 0
    waiting_tokens: int = 0  # prompt tokens still to prefill; least_load routing uses it
    device_busy_s: float = 0.0  # summed device time of all batches: 1 - busy/wall is the idle fraction
    overlap: bool = False  # overlap scheduling on (the worker runs asynchronously)
    max_running_reqs: int = 0  # the running-batch cap (admission estimates a full batch's wait)
    remaining_decode_tokens: int = 0  # running requests' max_new_tokens still to go (an upper bound)
    waiting_decode_tokens: int = 0  # the same for waiting requests
    spec_verify_reqs: int = 0  # request-steps of TARGET_VERIFY batches with at least one draft
    spec_draft_tokens: int = 0  # drafts proposed in them
    spec_accepted_tokens: int = 0  # drafts accepted
    gc_pause_s: float = 0.0  # the scheduler process's garbage collections, summed (runtime/gc_guard.py)
    gc_slow_pauses: int = 0  # collections over GcGuard's warning threshold
    # What admission's wait estimate needs of output lengths (ForwardModeStats.admission_fields):
    remaining_known_decode_tokens: int = 0  # the part of remaining_decode_tokens only the length can end
    waiting_known_decode_tokens: int = 0  # likewise of waiting_decode_tokens (Req.length_known)
    finished_open_reqs: int = 0  # requests that could stop early (EOS, stop) and ended by stop or length, so far
    finished_open_output_tokens: int = 0  # their output tokens
    finished_open_max_new_tokens: int = 0  # their max_new_tokens: output / this is how much of it they use
    reserved_decode_tokens: int = 0  # KV the engine holds back for the running requests' output (Retractor)
    waiting_reserved_decode_tokens: int = 0  # what it will hold back for the waiting ones as they start
    paused_replicas: int = 0  # schedulers paused by /pause_generation (summed: how many of them are)
    iteration_tokens: list[int] = []  # engine steps by tokens: per ITERATION_TOKEN_BOUNDS bound, then past it
    iteration_tokens_sum: int = 0  # the tokens of those steps
    lora: LoraRequests | None = None  # --enable-lora: the adapters of the requests running and waiting; None: off

    @property
    def spec_accept_length(self) -> float:
        """Mean tokens a request emits per verify step (accepted drafts + the target's own one)."""
        return (self.spec_accepted_tokens + self.spec_verify_reqs) / max(self.spec_verify_reqs, 1)

    @property
    def spec_accept_rate(self) -> float:
        return self.spec_accepted_tokens / max(self.spec_draft_tokens, 1)

    @staticmethod
    def summed(parts: list[SchedulerStats]) -> SchedulerStats:
        """Replicas' stats added up (a cluster-wide view for /metrics): every counter and gauge is summed,
        overlap is any replica's; a mode's time is the replicas' mean (they run side by side, so
        tokens / time stays the cluster's rate); the LoRA adapters are merged (LoraRequests.merged)."""
        total = SchedulerStats()
        numeric = [f.name for f in msgspec.structs.fields(SchedulerStats)
                   if type(f.default) in (int, float)]  # not bool (overlap), not the per-mode dict
        modes: dict[str, ModeStats] = {}
        for s in parts:
            for name in numeric:
                setattr(total, name, getattr(total, name) + getattr(s, name))
            total.overlap = total.overlap or s.overlap
            for mode, m in s.forward_modes.items():
                acc = modes.setdefault(mode, ModeStats())
                acc.batches += m.batches
                acc.tokens += m.tokens
                acc.time_s += m.time_s
            # zip_longest: a replica of another release may count at more or fewer bounds; zip would cut
            # to the shorter and drop the +Inf bucket (and with it steps from the count).
            total.iteration_tokens = [a + b for a, b in zip_longest(total.iteration_tokens, s.iteration_tokens,
                                                                    fillvalue=0)]
        for m in modes.values():
            m.time_s /= max(len(parts), 1)
        total.forward_modes = modes
        total.lora = LoraRequests.merged([s.lora for s in parts])
        return total

    @property
    def kv_usage_ratio(self) -> float:
        return self.num_used_tokens / max(self.max_total_tokens, 1)

    @property
    def kv_cache_ratio(self) -> float:
        return self.num_cached_tokens / max(self.max_total_tokens, 1)


class WorkerInfo(msgspec.Struct, kw_only=True):
    """What a TP worker reports once loaded; the scheduler sizes its allocator and tables from it."""

    max_total_tokens: int
    max_reqs: int
    context_len: int
    vocab_size: int
    eos_token_ids: list[int]
    attention_backend: str
    device: str
    all_reduce: str = "none"  # the TP all-reduce in use (ParallelGroup.all_reduce_kind)
    pooling: str | None = None  # an embedding server's pooling type (last / mean / cls); None: generation


class CacheEvents(msgspec.Struct, kw_only=True):
    """What a replica's prefix cache stored and dropped since sequence number `since`, as chained hashes
    of full token pages (runtime.mem_cache.block_hash): a gateway keeps the set and routes on it.
    snapshot=True: `stored` is the whole current set (the consumer was too far behind, or new)."""

    seq: int  # the log position this brings the consumer to
    stored: list[int] = []
    removed: list[int] = []
    snapshot: bool = False


class LinkHello(msgspec.Struct, tag="hello", kw_only=True):
    """First frame on each connection of a client's link to a scheduler actor (runtime.cluster.link_server):
    which consumer it is and which way the connection carries. outputs: cache_seq as in a poll."""

    consumer: str
    outputs: bool  # True: the actor pushes OutputPoll frames on it; False: the client sends requests on it
    cache_seq: int | None = None


class LinkSubmit(msgspec.Struct, tag="submit"):
    req: GenerateRequest


class LinkAbort(msgspec.Struct, tag="abort"):
    rid: str


LinkMessage = LinkHello | LinkSubmit | LinkAbort


class OutputPoll(msgspec.Struct, kw_only=True):
    """One poll's answer: the consumer's new deltas, and whether the replica can still serve. It crosses
    the actor boundary as msgpack bytes (encode/decode): Ray would pickle the Structs one by one, and at
    a few hundred deltas a step that pickling held the scheduler actor's GIL for milliseconds."""

    outputs: list[RequestOutput] = []
    healthy: bool = True
    error: str | None = None
    cache: CacheEvents | None = None  # prefix-cache changes since the consumer's last seen seq, when asked

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def decode(raw: bytes) -> OutputPoll:
        return msgspec.msgpack.decode(raw, type=OutputPoll)
