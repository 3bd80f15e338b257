"""MemorySleep: one TP rank's device memory given back between RL rollouts and taken again — vLLM's sleep mode
(LLM.sleep(level) / wake_up(tags)) and SGLang's release_memory_occupation / resume_memory_occupation(tags).

There is no CuMem allocator to unmap under live addresses, so the memory is released through the tensors'
own storages: each storage (found once however many tensors alias it: tied weights, views, fused scales)
is resized to 0 bytes and later back to its size. Every Parameter, buffer and pool tensor stays the same
Python object with its dtype, shape and aliases, so nothing that holds one (tied heads, MoE scale views,
the FP8 KV pool's scales and rotation) needs to be rebuilt; only the addresses change, so the CUDA graphs
(which captured them) are dropped first and captured again once everything is back. LoRA's slot buffers
(each projection's LoraDelta) go with the weights, kept on the host at both levels (the adapters in the slots
stay loaded). Not released: the request table and attention workspaces.

Tags (SGLang's names): "weights" — level 1 copies every weight storage to host memory (pinned on CUDA) and
restores it bit for bit; level 2 discards the parameters (zeros after wake_up: the caller loads new ones,
e.g. update_weights_from_disk) and keeps the rest — buffers and derived tensors such as rotary tables or
an FP8 LM head copy — on the host, as vLLM keeps the model's buffers. A STANDALONE draft model is always
kept (level 1): nothing reloads it. "kv_cache" — the KV pool's K/V tensors are discarded and come back
zeroed, at the same size (the scheduler flushes its prefix cache first: every slot is free). "cuda_graph"
is accepted and implied: graphs go with anything released and come back when nothing is."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields, is_dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from runtime.admin_messages import CUDA_GRAPH, KV_CACHE, SLEEP_TAGS, WEIGHTS, AdminReply, SleepControl
from runtime.lora.lora_layer import LoraDelta
from runtime.models.parallel_context import ParallelContext

if TYPE_CHECKING:
    from runtime.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)
GiB = 1 << 30


@dataclass(slots=True)
class _Stash:
    tensor: torch.Tensor  # one tensor on the storage: resizing its storage resizes every alias
    nbytes: int
    copy: torch.Tensor | None  # the bytes on the host; None: discarded (zeros after wake_up)


class MemorySleep:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.released: dict[str, int] = {}  # tag -> the level it was released at
        self._stash: dict[str, list[_Stash]] = {}
        self._graphs: list[ModelRunner] = []  # runners whose CUDA graphs were dropped

    @property
    def asleep(self) -> bool:
        return bool(self.released)

    def tags(self) -> list[str]:
        return sorted(self.released)

    def _runners(self) -> list[ModelRunner]:
        draft = self.runner.spec.draft if self.runner.spec is not None else None
        return [self.runner] + ([draft] if draft is not None else [])

    # ---- the worker's entry point ------------------------------------------------------------------
    def apply(self, ctl: SleepControl) -> AdminReply:
        """Sleeps or wakes as ctl says, on the thread that runs this worker's steps, nothing running. The
        reply's sleeping_tags: what is released afterwards; its error names what failed (then nothing
        changed: a failed release restores what it took, a failed wake_up releases again what it got)."""
        if ctl.sleep and self.runner.ctx.dp_attention:  # its DP ranks step (and run collectives) together
            return AdminReply(error="sleep is not supported with --enable-dp-attention yet", sleeping_tags=self.tags())
        t0 = time.perf_counter()
        try:
            message = self.sleep(ctl.level, ctl.tags) if ctl.sleep else self.wake_up(ctl.tags, ctl.graphs)
        except torch.OutOfMemoryError as e:
            return AdminReply(error=f"not enough device memory to wake up ({e}); free some (the trainer's?) and "
                                    "call wake_up again", sleeping_tags=self.tags())
        except Exception as e:  # a torch error is still this call's failure, not a step's
            logger.exception("%s failed", "sleep" if ctl.sleep else "wake_up")
            return AdminReply(error=f"{'sleep' if ctl.sleep else 'wake_up'} failed: {type(e).__name__}: {e}",
                              sleeping_tags=self.tags())
        return AdminReply(message=f"{message} ({time.perf_counter() - t0:.2f} s)", sleeping_tags=self.tags())

    # ---- sleep ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def sleep(self, level: int, tags: tuple[str, ...]) -> str:
        todo = [t for t in SLEEP_TAGS if t in tags and t not in self.released]
        if not todo:  # vLLM's executor: a sleep while asleep is a no-op
            return f"already asleep ({', '.join(self.tags())} released): nothing more to release"
        self._drop_graphs()
        done = []
        try:
            for tag in todo:
                stash = self._take_weights(level) if tag == WEIGHTS else self._take_kv()
                # recorded before any storage goes, so a resize failing half-way is rolled back whole
                self._stash[tag], self.released[tag] = stash, level
                _resize(stash, release=True)  # every copy is made before any storage goes
                done.append(f"{_gib(stash)} of {_WHAT[tag](level)}")
                if tag == WEIGHTS:
                    _set_packed(self._runners(), empty=True)
        except Exception:
            # what this call took comes back, and the graphs if nothing else sleeps; one rank of a TP group
            # capturing alone would wait in its collectives, so there the graphs stay dropped (eager steps)
            self.wake_up((*todo, CUDA_GRAPH), graphs=self.runner.ctx.attn.size == 1)
            raise
        self._return_memory()
        return "Released " + " and ".join(done)

    def _take_weights(self, level: int) -> list[_Stash]:
        stash = []
        for runner in self._runners():
            keep_params = level == 1 or runner is not self.runner  # the draft has no other source
            for t, is_param in _storages(runner.model):
                copy = None if is_param and not keep_params else _host_copy(t)
                stash.append(_Stash(t, t.untyped_storage().nbytes(), copy))
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)  # the host copies are in place before any storage goes
        return stash

    def _take_kv(self) -> list[_Stash]:
        seen: set[int] = set()
        stash = []
        for runner in self._runners():
            pool = runner.token_to_kv_pool
            for t in (*pool.k_buffers, *pool.v_buffers):
                if _key(t) not in seen and t.untyped_storage().nbytes():
                    seen.add(_key(t))
                    stash.append(_Stash(t, t.untyped_storage().nbytes(), None))
        return stash

    def _drop_graphs(self) -> None:
        for runner in self._runners():
            if runner.cuda_graph_runner is not None:
                runner.cuda_graph_runner = None
                if runner not in self._graphs:
                    self._graphs.append(runner)

    # ---- wake up -------------------------------------------------------------------------------------
    @torch.no_grad()
    def wake_up(self, tags: tuple[str, ...], graphs: bool = True) -> str:
        todo = [t for t in SLEEP_TAGS if t in tags and t in self.released]
        if not todo:
            if not self.released and self._graphs and CUDA_GRAPH in tags and graphs:
                self._capture_graphs()  # a TP group's second phase (SleepControl.graphs)
                return "CUDA graphs captured again"
            if self.released:
                return f"nothing of {', '.join(t for t in tags if t != CUDA_GRAPH)} is asleep (still released: " \
                       f"{', '.join(self.tags())})"
            return "not asleep: nothing to wake up"
        done = []
        for tag in todo:
            stash = self._stash[tag]
            try:
                _resize(stash, release=False)
            except Exception:
                _resize(stash, release=True)  # all of this tag stays released: the caller may retry
                raise
            for s in stash:
                _restore(s)
            if tag == WEIGHTS:
                _set_packed(self._runners(), empty=False)
            if self.runner.device.type == "cuda":
                torch.cuda.synchronize(self.runner.device)
            del self._stash[tag]
            level = self.released.pop(tag)
            done.append(f"{_gib(stash)} of {_WHAT[tag](level)}")
        stash = []  # the host copies go; their pinned blocks would stay in torch's host cache, the trainer's memory
        if self.runner.device.type == "cuda" and (empty := getattr(torch._C, "_host_emptyCache", None)) is not None:
            empty()
        if not self.released and graphs:
            self._capture_graphs()
        return "Restored " + " and ".join(done) + ("" if not self.released else
                                                   f"; still released: {', '.join(self.tags())}")

    def _capture_graphs(self) -> None:
        graphs, self._graphs = self._graphs, []
        for runner in graphs:
            runner.cuda_graph_runner = runner._init_cuda_graphs()

    def _return_memory(self) -> None:
        gc.collect()  # the dropped graphs' pool goes once nothing refers to it
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
            # cuBLAS keeps a workspace per (handle, stream), 32 MiB each on Hopper, until cleared: the capture's
            # warm-up stream and the scheduler thread's handle added ~168 MB a wake_up that sleep never gave
            # back (an H200, 2026-11-28); no graph is alive now to have captured one
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            torch.cuda.empty_cache()


_WHAT = {WEIGHTS: lambda level: "weights" + (" (kept in host memory)" if level == 1 else
                                            " (discarded: load new ones after wake_up)"),
         KV_CACHE: lambda level: "KV cache (discarded)"}


def _key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def _storages(model: nn.Module) -> Iterator[tuple[torch.Tensor, bool]]:
    """(one tensor per storage, whether a Parameter uses it) of every tensor the model's modules hold:
    parameters, buffers, and plain tensor attributes (one level into dataclasses such as an FP8 head)."""
    found: dict[tuple[str, int], list] = {}

    def add(t: torch.Tensor, is_param: bool) -> None:
        if t.layout != torch.strided or t.device.type == "meta" or t.untyped_storage().nbytes() == 0:  # oneDNN packed copies: _set_packed
            return
        entry = found.setdefault(_key(t), [t, False])
        entry[1] = entry[1] or is_param

    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                add(p, True)
        for b in m._buffers.values():
            if b is not None:
                add(b, False)
        for name, v in vars(m).items():
            if not name.startswith("_"):
                for t in _loose(v):
                    add(t, False)
    for t, is_param in found.values():
        yield t, is_param


def _loose(v: object, deep: bool = True) -> Iterator[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _loose(x, False)
    elif isinstance(v, LoraDelta):  # a projection's adapter slots (module.lora)
        yield v.a
        yield v.b
    elif deep and is_dataclass(v) and not isinstance(v, (type, ParallelContext)):  # never the collectives' buffers
        for f in fields(v):
            yield from _loose(getattr(v, f.name), False)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of t as one flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    src = _as_bytes(t)
    if t.device.type != "cuda":
        return src.clone()
    dst = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)
    return dst


def _resize(stash: list[_Stash], release: bool) -> None:
    for s in stash:
        s.tensor.untyped_storage().resize_(0 if release else s.nbytes)


def _restore(s: _Stash) -> None:
    if s.copy is None:
        _as_bytes(s.tensor).zero_()
    else:
        _as_bytes(s.tensor).copy_(s.copy, non_blocking=True)


def _set_packed(runners: list[ModelRunner], empty: bool) -> None:
    """CPU oneDNN packed weights (cpu_linear.py) are opaque copies with no storage to resize: dropped while
    asleep (an empty placeholder keeps them marked) and packed again from the restored weights."""
    from runtime.model_executor.cpu_linear import repack_linear_weights

    for runner in runners:
        if runner.device.type != "cpu":
            continue
        if not empty:
            repack_linear_weights(runner.model)
            continue
        for m in runner.model.modules():
            if getattr(m, "packed_weight", None) is not None:
                m.packed_weight = torch.empty(0)


def _gib(stash: list[_Stash]) -> str:
    n = sum(s.nbytes for s in stash)
    return f"{n / GiB:.2f} GiB" if n >= GiB / 100 else f"{n / (1 << 20):.2f} MiB"
