"""Step-level trace: per step, decode tokens, prefill tokens, padding and wall time (for benches and plots)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class StepRecord:
    bucket: int
    decode_tokens: int
    prefill_tokens: int
    padding: int
    num_seqs: int
    seconds: float       # launch -> tokens on host (overlaps the next step's launch)
    host_ms: float = 0.0     # host time to form and launch this step (scheduler, metadata, dispatches)
    wait_ms: float = 0.0     # host time blocked reading its tokens (~0: the GPU waits for the host)
    put_ms: float = 0.0      # part of host_ms: input copy to the device
    dispatch_ms: float = 0.0  # part of host_ms: enqueueing the step's programs
    preempted: int = 0       # requests swapped out to host memory to make room for this step
    prompt_tokens: int = 0   # prompt tokens of the requests admitted in this step
    reused_tokens: int = 0   # of which the prefix cache supplied (not prefilled)
    # the engine thread's CPU time in host_ms and wait_ms (near them: busy, e.g. spinning; far below: blocked),
    # and the host time turning its tokens into outputs after the read
    host_cpu_ms: float = 0.0
    wait_cpu_ms: float = 0.0
    process_ms: float = 0.0
    slowest_program: str = ""        # the step's program whose enqueue took longest (embed, layers<i>, head)
    slowest_program_ms: float = 0.0


@dataclass
class StepTrace:
    steps: list[StepRecord] = field(default_factory=list)

    def record(self, handle, seconds: float, wait_ms: float = 0.0, wait_cpu_ms: float = 0.0) -> StepRecord:
        """A read step: its batch and launch times from its `runner.StepHandle`, the read's from the caller."""
        batch = handle.batch
        dec = batch.num_decode
        tot = batch.num_tokens
        rec = StepRecord(batch.bucket, dec, tot - dec, batch.bucket - tot, len(batch.seqs), seconds, handle.host_ms,
                         wait_ms, handle.put_ms, handle.dispatch_ms, len(batch.swap_out), batch.prompt_tokens,
                         batch.reused_tokens, host_cpu_ms=handle.host_cpu_ms, wait_cpu_ms=wait_cpu_ms,
                         slowest_program=handle.slowest_program, slowest_program_ms=handle.slowest_program_ms)
        self.steps.append(rec)
        return rec

    def summary(self) -> dict:
        n = len(self.steps)
        prompt = sum(s.prompt_tokens for s in self.steps)
        reused = sum(s.reused_tokens for s in self.steps)
        return {"steps": n,
                "decode_tokens": sum(s.decode_tokens for s in self.steps),
                "prefill_tokens": sum(s.prefill_tokens for s in self.steps),
                "padding_tokens": sum(s.padding for s in self.steps),
                "preemptions": sum(s.preempted for s in self.steps),
                "steps_with_preemption": sum(1 for s in self.steps if s.preempted),
                "prefix_reused_tokens": reused, "prefix_hit_rate": reused / prompt if prompt else 0.0}

    def to_json(self) -> str:
        return json.dumps([asdict(s) for s in self.steps])
