"""StepProfiler: a torch.profiler trace of one TP rank's steps, written as a Chrome trace (SGLang's and
vLLM's /start_profile, /stop_profile). torch.profiler records the operators of the thread that started it
only, and must be stopped on that thread, so TpWorker applies every ProfileControl on the thread that runs
its steps (the scheduler's on rank 0, the follow loop's on the other ranks). A TpWorker without a
profiler running holds None: a step pays one `is None` check."""

from __future__ import annotations

import logging
import os

import torch

from runtime.admin_messages import ProfileControl

logger = logging.getLogger(__name__)


class StepProfiler:
    def __init__(self, ctl: ProfileControl, rank: int, device: torch.device):
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] if "CPU" in ctl.activities else []
        if "CUDA" in ctl.activities and device.type == "cuda":
            acts.append(ProfilerActivity.CUDA)
        os.makedirs(ctl.output_dir, exist_ok=True)  # before anything runs: an unwritable folder fails the start
        self.path = os.path.join(ctl.output_dir, f"{ctl.trace_id}-tp{rank}.trace.json")
        self.steps_left = ctl.num_steps
        self._prof = profile(activities=acts or [ProfilerActivity.CPU], record_shapes=ctl.record_shapes,
                             with_stack=ctl.with_stack)
        self._prof.start()

    def step(self) -> bool:
        """After each step; True once num_steps have run (the caller stops it)."""
        self._prof.step()
        if self.steps_left is None:
            return False
        self.steps_left -= 1
        return self.steps_left <= 0

    def stop(self) -> str:
        """Stops and writes the trace; its path."""
        self._prof.stop()
        self._prof.export_chrome_trace(self.path)
        logger.info("profiler trace written to %s", self.path)
        return self.path
