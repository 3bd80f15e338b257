"""ModelRunner: one rank's model, KV pools, attention backend, CUDA graphs and sampler.

`run_batch(WorkerBatch) -> BatchResult` is all a TpWorker calls: build the ForwardBatch once, run the
forward (replaying a CUDA graph when the mode allows), sample."""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.future_tokens import resolve_future_ids
from runtime.attention.registry import create_attention_backend, resolve_backend_name
from runtime.attention.spec import AttentionSpec
from runtime.config import ServerArgs
from runtime.errors import ServerArgsError
from runtime.host_to_device import to_device
from runtime.layers.logits import LogitsOutput, LogitsProcessor
from runtime.layers.pooler import Pooler, create_pooler
from runtime.layers.sampler import SampleOutput, Sampler
from runtime.lora.lora_manager import LoraManager
from runtime.mem_cache.kv_pool import TokenToKVPool
from runtime.mem_cache.kv_quant import kv_storage_dtype
from runtime.mem_cache.req_to_token import ReqToTokenPool
from runtime.messages import BatchResult, SamplingBatch, WorkerBatch
from runtime.model_config import ModelConfig
from runtime.model_executor import cpu_config
from runtime.model_executor.cpu_fused_layers import fuse_cpu_layers
from runtime.model_executor.cpu_memory import CpuMemoryTrimmer
from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.int4_weights import resolve_weight_quantization
from runtime.model_executor.kv_cache_format import KVCacheFormat
from runtime.model_executor.kv_calibrator import KVCalibrator
from runtime.model_executor.memory_report import MemoryReport
from runtime.model_executor.weight_loader import build_model, dummy_checkpoint, iterate_safetensors
from runtime.models.parallel_context import ParallelContext
from runtime.models.registry import get_model_class
from runtime.speculative.draft_footprint import DraftFootprint
from runtime.text.pooling_config import PoolingConfig

if TYPE_CHECKING:
    from runtime.model_executor.spec_decode_runner import SpecDecodeRunner

logger = logging.getLogger(__name__)

CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():  # else an assertion deep in the first layer
        raise ServerArgsError("--device", "cuda was asked for, but torch sees no CUDA device here "
                              f"(torch {torch.__version__}); use --device cpu or auto")
    return torch.device(name)


class ModelRunner:
    def __init__(self, args: ServerArgs, model_path: str, ctx: ParallelContext | None = None,
                 device: torch.device | None = None, *, req_to_token_pool: ReqToTokenPool | None = None,
                 kv_pool_size: int | None = None):
        """req_to_token_pool / kv_pool_size: a speculative draft model shares the target's token table and
        has as many KV slots, so one slot index holds a token's KV in both pools."""
        self.args = args
        self.spec: SpecDecodeRunner | None = None  # set by the TpWorker when speculative decoding is on
        self.ctx = ctx or ParallelContext()
        self.device = device or resolve_device(args.device)
        dtype = args.dtype
        # CPU: arenas capped before the weights, trims from the end of a build (a failed one leaves no thread)
        self.memory_trimmer = CpuMemoryTrimmer() if self.device.type == "cpu" else None
        overrides = args.hf_config_overrides  # --hf-overrides: on every rank, over config.json
        if self.device.type == "cpu":  # threads from the cores given; "auto" → bf16 where the CPU has bf16 math
            dtype = cpu_config.configure(dtype, ModelConfig.from_pretrained(model_path, overrides=overrides).dtype)
        self.model_config = ModelConfig.from_pretrained(model_path, dtype=dtype, overrides=overrides,
                                                        generation_config=args.generation_config)
        if overrides and self.ctx.attn.rank == 0 and self.ctx.mlp.rank == 0:
            logger.info("config.json overridden by --hf-overrides: %s",
                        ", ".join(f"{k}={v!r}" for k, v in sorted(overrides.items())))
        self.model_config.check_task(args.is_embedding, model_path)  # before any device memory is taken
        # An embedding server's pooling, read now: a bidirectional model is refused before anything loads.
        pooling = PoolingConfig.for_model(args, model_path)
        if self.device.type == "cuda" and not (args.disable_custom_all_reduce or args.disable_cuda_graph):
            # Collective over the ranks: each gets a one-shot all-reduce for graph-sized activations,
            # or all fall back to NCCL together (e.g. ranks on different nodes).
            graph_bs = min(args.cuda_graph_max_bs, args.max_running_requests)  # CudaGraphRunner's bound
            self.ctx = self.ctx.with_fast_all_reduce(self.model_config.dtype, self.device, graph_bs,
                                                     self.model_config.hidden_size)
            if self.ctx.mlp.size > 1:
                logger.info("TP all-reduce inside CUDA graphs: %s",
                            "symmetric-memory one-shot" if self.ctx.mlp.fast is not None else "NCCL")
        self.context_len = args.context_length or self.model_config.max_position_embeddings
        if self.context_len > self.model_config.max_position_embeddings:
            # The rotary table must cover every position a request may reach (it indexed past its end:
            # an IndexError, or NaN keys on CUDA); beyond the trained length outputs are the user's risk.
            logger.warning("--context-length %d is longer than the model's max_position_embeddings %d: "
                           "positions past it were never trained", self.context_len,
                           self.model_config.max_position_embeddings)
            self.model_config = dataclasses.replace(self.model_config, max_position_embeddings=self.context_len)
        self.model = self._load_model(model_path)
        self.kv_dtype = kv_storage_dtype(args.kv_cache_dtype, self.model_config.dtype)
        # Scales and rotation before the pool and graphs: kernels take the scales as floats. Before the CPU's
        # packed weights too: a KV rotation may fold V's change of basis into W_v / W_o.
        kv_format = KVCacheFormat.resolve(args, self.model, self.model_config, self.kv_dtype, model_path,
                                          self.context_len, self.ctx, self.device)
        # --enable-lora: adapters on the projections (16-bit, FP8 or 4-bit; runtime/lora/lora_attach.py)
        self.lora = LoraManager(args, self.model) if args.enable_lora else None
        if self.device.type == "cpu":  # with LoRA no packed-weight forwards (they would skip its term)
            (cpu_config.prepare_model if self.lora is None else fuse_cpu_layers)(self.model)
        self.max_total_tokens = kv_pool_size or self._kv_pool_size()
        self.max_running_requests = args.max_running_requests + 4  # + requests mid chunked prefill
        self.req_to_token_pool = req_to_token_pool or ReqToTokenPool(self.max_running_requests,
                                                                     self.context_len + 1, self.device)
        attn0 = self.model.model.layers[0].self_attn
        self.token_to_kv_pool = TokenToKVPool(self.max_total_tokens, self.model_config.num_hidden_layers,
                                              attn0.num_kv_heads, attn0.head_dim, self.kv_dtype,
                                              self.device, kv_format.scales, kv_format.rotation)
        self.attn_backend_name = resolve_backend_name(args.attention_backend, self.device, self.model_config.dtype,
                                                      self.model_config.has_sliding_window, attn0.head_dim)
        attn = self.model.model.layers[0].self_attn.attn
        self.attn_backend = create_attention_backend(self.attn_backend_name, AttentionSpec(
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            scaling=attn.scaling, dtype=self.model_config.dtype, device=self.device,
            req_to_token=self.req_to_token_pool.req_to_token, max_bs=self.max_running_requests,
            has_sliding_window=self.model_config.has_sliding_window, kv_dtype=self.kv_dtype))
        self.logits_processor = LogitsProcessor(self.model.compute_logits)
        self.sampler = Sampler()
        self.pooler: Pooler | None = None  # an embedding server's (--is-embedding): pools instead of sampling
        if pooling is not None:
            self.pooler = create_pooler(pooling.pooling_type, self.max_running_requests, self.device)
            logger.info("embedding model: %s pooling%s (from %s)", pooling.pooling_type,
                        ", L2-normalized" if pooling.normalize else "", pooling.source)
        # Row r: the token just sampled for request row r (overlap scheduling); one scratch row past them
        # for a CUDA graph's padded rows.
        self.future_token_ids = torch.zeros(self.max_running_requests + 1, dtype=torch.int64, device=self.device)
        self.cuda_graph_runner = self._init_cuda_graphs()
        if self.ctx.attn.rank == 0 and self.ctx.mlp.rank == 0:
            pool = self.token_to_kv_pool
            logger.info("%s", MemoryReport.of(self.max_total_tokens, [*pool.k_buffers, *pool.v_buffers], self.kv_dtype,
                                              self.model, self.context_len, self.device).line())
        if self.memory_trimmer is not None:
            self.memory_trimmer.start()

    def _load_model(self, model_path: str) -> torch.nn.Module:
        cfg = self.model_config
        t0 = time.perf_counter()
        # 4-bit (AWQ / GPTQ / compressed-tensors W4A16) or FP8 weights, from config.json or --quantization. An
        # embedding server never computes logits: no LM head (an untied 151k x 8k one is ~1.2 GB).
        quant = resolve_weight_quantization(self.args, model_path)
        model_class = get_model_class(cfg.architecture)
        model = build_model(lambda: model_class(cfg, self.ctx, embedding_only=self.args.is_embedding), quant,
                            self.device)
        if self.args.load_format == "dummy":
            # tie_word_embeddings: no random LM head drawn for an embedding model, which has none
            shapes = dataclasses.replace(cfg, tie_word_embeddings=True) if self.args.is_embedding else cfg
            model.load_weights(dummy_checkpoint(shapes, self.args.random_seed, self.device))
        else:
            show = self.ctx.attn.rank == 0 and self.ctx.mlp.rank == 0
            weights = iterate_safetensors(model_path, show_progress=show)
            model.load_weights(self._embedding_checkpoint(weights, bool(cfg.classifier_token_ids))
                               if self.args.is_embedding else weights)
        if quant is not None:
            quant.finish(model, cfg.dtype, None if self.args.load_format == "dummy"
                       else lambda: self._calibration_prefill(model, model_path))
        model.eval()
        logger.info("loaded %s (%s, %s) in %.1f s", cfg.architecture, cfg.dtype, self.args.load_format,
                    time.perf_counter() - t0)
        return model

    @staticmethod
    def _embedding_checkpoint(weights: Iterable[tuple[str, torch.Tensor]], keep_lm_head: bool = False
                              ) -> Iterator[tuple[str, torch.Tensor]]:
        """An embedding model's tensors: the LM head skipped (none here; keep_lm_head: a reranker made from a
        causal LM by classifier_from_token takes its score rows from it), a bare *Model's (e5-mistral-instruct,
        Qwen3-Embedding) named with 'model.' as vLLM's pooling adapter loads them; `score.weight` as it is."""
        for name, tensor in weights:
            if not name.startswith("lm_head."):
                yield (name if name.startswith(("model.", "score.")) else "model." + name), tensor
            elif keep_lm_head:
                yield name, tensor

    def _calibration_prefill(self, model: torch.nn.Module, model_path: str) -> None:
        """One prefill of the KV calibration text through `model` (FP8 act_weighted weight scales read it)."""
        ids = KVCalibrator.calibration_ids_for(self.args, self.model_config, self.context_len, model_path)
        KVCalibrator(model, self.model_config.num_hidden_layers, self.ctx, self.device).amax(ids)

    def _kv_pool_size(self) -> int:
        cfg, args = self.model_config, self.args
        attn0 = self.model.model.layers[0].self_attn
        per_token = TokenToKVPool.bytes_per_token(cfg.num_hidden_layers, attn0.num_kv_heads, attn0.head_dim,
                                                  self.kv_dtype)
        if self.device.type != "cuda":
            return args.max_total_tokens or CPU_DEFAULT_MAX_TOTAL_TOKENS
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        draft = DraftFootprint.of(args, self.ctx.attn.size)  # a STANDALONE draft model still to load
        budget = total * args.mem_fraction_static - (total - free) - draft.weight_bytes
        size = int(budget // (per_token + draft.kv_bytes_per_token))
        if self.ctx.attn.size > 1 or self.ctx.mlp.size > 1:  # every rank must agree on the pool size
            t = torch.tensor([size], device=self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.ctx.mlp.group)
            size = int(t.item())
        if args.max_total_tokens:
            size = min(size, args.max_total_tokens)
        if size < 16:
            raise RuntimeError(f"not enough GPU memory for a KV pool ({size} tokens); raise --mem-fraction-static")
        return size

    def _init_cuda_graphs(self):
        # An embedding server only prefills (EXTEND, which runs eagerly): the decode graphs would never replay,
        # and their capture computes logits, which its model has no head for.
        if self.device.type != "cuda" or self.args.disable_cuda_graph or not self.attn_backend.supports_cuda_graph \
                or self.args.is_embedding:
            return None
        from runtime.model_executor.cuda_graph_runner import CudaGraphRunner

        return CudaGraphRunner(self)

    def release(self) -> None:
        """Drops weights, KV pool and graphs and returns the device memory (the runner is unusable after)."""
        if self.spec is not None and self.spec.draft is not None:
            self.spec.draft.release()
        if self.memory_trimmer is not None:
            self.memory_trimmer.stop()
        if self.device.type != "cuda":
            return
        self.cuda_graph_runner = None
        self.model = self.token_to_kv_pool = self.attn_backend = self.logits_processor = None  # type: ignore[assignment]
        gc.collect()
        torch.cuda.empty_cache()

    # ---- one step -------------------------------------------------------------------------------------
    def apply_prefix_writes(self, batch: WorkerBatch) -> None:
        for w in batch.prefix_writes:
            self.req_to_token_pool.write(w.req_pool_idx, w.start, to_device(w.kv_indices, torch.int64, self.device))

    def build_forward_batch(self, batch: WorkerBatch, write_table: bool = True) -> ForwardBatch:
        """write_table=False: the step's KV slots stay out of the request→token table (a staged replay's)."""
        self.apply_prefix_writes(batch)
        fb = ForwardBatch.init_new(batch, self.req_to_token_pool, self.token_to_kv_pool, self.attn_backend,
                                   self.device)
        if write_table:
            fb.write_req_to_token()
        return fb

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, stage_inputs: bool = False) -> LogitsOutput:
        """stage_inputs: a DECODE whose placeholders and token-table writes the graph replay's staging takes
        over (CudaGraphRunner.stages_inputs() said it can)."""
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(fb):
            return self.cuda_graph_runner.replay(fb, stage_inputs=stage_inputs)
        self.attn_backend.init_forward_metadata(fb)
        if self.lora is not None:
            self.lora.prepare(fb.lora_slots, fb.input_ids.shape[0])
        hidden = self.model(fb.input_ids, fb.positions, fb)
        return self.logits_processor(hidden, fb.input_ids, fb)

    @torch.inference_mode()
    def run_batch(self, batch: WorkerBatch) -> BatchResult:
        return self.finish_batch(self.launch_batch(batch))

    @torch.inference_mode()
    def launch_batch(self, batch: WorkerBatch, sample_later: bool = False,
                     keep_on_device: bool = False) -> LaunchedBatch:
        """Enqueues the forward and the sampling without waiting for the device, so the scheduler can
        prepare the next batch meanwhile (overlap scheduling). finish_batch() collects the result.
        sample_later: enqueue only the forward; sample_deferred() adds the grammar masks and samples (the
        masks need the previous batch's tokens, which the scheduler collects while this forward runs).
        keep_on_device: a TP follower's step: its tokens only feed its next step (future_token_ids), so
        nothing is copied to the host and finish_batch() is never called."""
        t0 = time.perf_counter()
        if self.ctx.dp_attention:
            # Every DP rank steps together: agree on token counts first; skip the forward if all are idle.
            counts = self.ctx.mlp.all_gather(torch.tensor([len(batch.input_ids)], device=self.device), dim=0)
            batch.global_num_tokens = counts.tolist()
            if not any(batch.global_num_tokens):
                return LaunchedBatch(batch.batch_id, t0, done=BatchResult(batch_id=batch.batch_id,
                                                                          next_token_ids=[], all_idle=True))
        events = None
        if self.device.type == "cuda":  # device busy time per batch, for the GPU idle fraction
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        if batch.lora_loads:  # adapters into the slots this step's requests took (runtime/lora/lora_slots.py)
            self.lora.load_slots(batch.lora_loads)
        fb = self.build_forward_batch(batch, write_table=False)
        graphs = self.cuda_graph_runner
        staged = graphs is not None and graphs.stages_inputs(fb)  # the replay's staging launch does both below
        if not staged:
            fb.write_req_to_token()
            # A negative id -(r+1) stands for the token just sampled for request row r, which the scheduler
            # has not seen yet (overlap scheduling): take it from the device-side buffer.
            fb.input_ids = resolve_future_ids(fb.input_ids, self.future_token_ids)
        if batch.embed_done:  # an embedding server's prefill: pooled from the hidden states, no logits
            return self._pool(batch, fb, t0, events)
        if fb.forward_mode.is_target_verify():  # drafts, one forward over them, acceptance: synchronous
            if self.spec is None:
                raise ValueError("a TARGET_VERIFY batch needs a worker started with --speculative-algorithm")
            return self.spec.verify(batch, fb, t0)
        out = self.forward(fb, stage_inputs=staged)
        if self.spec is not None:
            self.spec.mirror(batch)  # the draft model keeps its KV in step with the target's
        if fb.batch_size == 0 or batch.sampling is None:
            return LaunchedBatch(batch.batch_id, t0, done=BatchResult(batch_id=batch.batch_id, next_token_ids=[]))
        launched = LaunchedBatch(batch.batch_id, t0, input_logprobs=out.input_logprobs,
                                 input_top_logprobs=out.input_top_logprobs,
                                 input_token_ranks=out.input_token_ranks, events=events)
        if sample_later:
            launched.deferred = (batch.sampling, out.next_token_logits, fb.req_pool_indices)
            return launched
        return self._sample(launched, batch.sampling, out.next_token_logits, fb.req_pool_indices, keep_on_device,
                            out.greedy_ids)

    def _pool(self, batch: WorkerBatch, fb: ForwardBatch, t0: float, events: tuple | None) -> LaunchedBatch:
        """One embedding EXTEND: the forward up to the final norm, then each finished prompt's vector."""
        if self.pooler is None:
            raise ValueError("an embedding batch needs a worker started with --is-embedding")
        self.attn_backend.init_forward_metadata(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        rows = iter(self.pooler(hidden, fb, batch.embed_done).tolist())  # waits for the device
        embeddings = [next(rows) if done else [] for done in batch.embed_done]
        device_s = 0.0
        if events is not None:
            events[1].record()
            events[1].synchronize()
            device_s = events[0].elapsed_time(events[1]) / 1e3
        return LaunchedBatch(batch.batch_id, t0, done=BatchResult(
            batch_id=batch.batch_id, next_token_ids=[], embeddings=embeddings,
            forward_s=time.perf_counter() - t0, device_s=device_s))

    @torch.inference_mode()
    def sample_deferred(self, launched: LaunchedBatch, grammar_rows: list[int], grammar_mask: bytes) -> LaunchedBatch:
        """Samples a batch launched with sample_later, its constrained rows under the given masks."""
        sampling, logits, req_pool_indices = launched.deferred
        launched.deferred = None
        sampling.grammar_rows, sampling.grammar_mask = grammar_rows, grammar_mask
        return self._sample(launched, sampling, logits, req_pool_indices)

    def _sample(self, launched: LaunchedBatch, sampling: SamplingBatch, logits: torch.Tensor,
                req_pool_indices: torch.Tensor, keep_on_device: bool = False,
                greedy_ids: torch.Tensor | None = None) -> LaunchedBatch:
        if greedy_ids is not None and sampling.raw_argmax:  # the graph's greedy tail chose them and wrote
            # them to future_token_ids. They sit in the graphs' static buffer, which the next replay (launched
            # before this batch is collected) overwrites: on CUDA the host copy below is queued ahead of it;
            # elsewhere (tests' stand-in graphs) keep a copy.
            sample = launched.sample = SampleOutput(greedy_ids if self.device.type == "cuda" else greedy_ids.clone())
        else:
            sample = launched.sample = self.sampler(logits, sampling)
            self.future_token_ids[req_pool_indices] = sample.next_token_ids
        if launched.events is not None:
            launched.events[1].record()
        if self.device.type == "cuda" and not keep_on_device:
            # Queue the device→host copy of the tokens now, right behind this batch's kernels. A plain
            # .tolist() in finish_batch() would queue it behind the *next* batch, already launched by
            # then, and collecting this batch would wait for that one too: no overlap at all.
            launched.token_ids_host = torch.empty_like(sample.next_token_ids, device="cpu").pin_memory()
            launched.token_ids_host.copy_(sample.next_token_ids, non_blocking=True)
            if sample.logprobs is not None:
                launched.logprobs_host = torch.empty_like(sample.logprobs, device="cpu").pin_memory()
                launched.logprobs_host.copy_(sample.logprobs, non_blocking=True)
            launched.copied = torch.cuda.Event()
            launched.copied.record()
        return launched

    def finish_batch(self, launched: LaunchedBatch) -> BatchResult:
        if launched.done is not None:
            return launched.done
        sample = launched.sample
        ids, logprobs = sample.next_token_ids, sample.logprobs
        if launched.copied is not None:
            launched.copied.synchronize()
            ids = launched.token_ids_host
            logprobs = launched.logprobs_host if logprobs is not None else None
        return BatchResult(
            batch_id=launched.batch_id, next_token_ids=ids.tolist(),
            logprobs=logprobs.tolist() if logprobs is not None else None,
            top_logprobs=sample.top_logprobs, input_logprobs=launched.input_logprobs,
            input_top_logprobs=launched.input_top_logprobs, input_token_ranks=launched.input_token_ranks,
            forward_s=time.perf_counter() - launched.t0,
            device_s=launched.events[0].elapsed_time(launched.events[1]) / 1e3 if launched.events else 0.0)


@dataclass(slots=True)
class LaunchedBatch:
    batch_id: int
    t0: float
    sample: SampleOutput | None = None
    input_logprobs: list[list[float]] | None = None
    input_top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    input_token_ranks: list[list[int]] | None = None
    done: BatchResult | None = None  # already complete (idle, nothing to sample)
    events: tuple | None = None  # CUDA start/end events around the batch's device work
    token_ids_host: torch.Tensor | None = None  # pinned copies, filled asynchronously (CUDA)
    logprobs_host: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None  # recorded after those copies
    deferred: tuple | None = None  # (SamplingBatch, logits, req_pool_indices) until sample_deferred()
