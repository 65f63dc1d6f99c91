"""What the talker engine counts, and the snapshot it reports (`TalkerEngine.stats()`).

The engine thread adds to one `EngineCounters`; `snapshot` reads it together with the scheduler's queue state.
Counters are sums since start, so a caller that reads twice gets the means of what happened in between.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from stages.talker.scheduler import Scheduler
from stages.talker.step_clock import DeviceClockStats

HOST_BOUND_WAIT_S = 2e-4  # a step output read waiting less than this found it ready (EngineStats.host_bound_steps)


@dataclass(frozen=True)
class EngineStats:
    waiting: int  # requests queued (not yet admitted)
    running: int
    max_running: int  # rows (max_num_seqs)
    kv_reserved_tokens: int  # KV positions reserved by running requests (whole blocks)
    kv_total_tokens: int
    steps: int
    frames: int
    prefills: int = 0  # batched prefills run (admissions)
    burst_prefills: int = 0  # of them, launched after another in the same iteration (max_prefills_per_step)
    prefill_seconds: float = 0.0  # engine-thread time spent launching them (they never wait for the device)
    step_seconds: float = 0.0  # engine-thread time spent launching steps and reading their output
    device_wait_seconds: float = 0.0  # of step_seconds, blocked until a step's output was ready: the rest is host
    # work (Python, launches, waiting for the GIL); near zero means the device waits for the host instead
    host_bound_steps: int = 0  # steps whose output was ready before the engine thread read it (it had launched
    # the next step already, so the device idled since, unless a prefill or another process kept it busy)
    max_step_batch: int = 0  # the most rows one decode step has computed
    parked: int = 0  # live text: prefilled requests waiting for text, off the rows (they keep slot and KV)
    held: int = 0  # live text: opened requests without the text their prefill needs (no slot, no KV)
    live_evictions: int = 0  # live requests ended to free their slot for waiting work, or past their lifetime
    # from `add_request` (or a live request's first text) inside the engine: what the engine adds to first audio,
    # against what a client sees (the rest is the serving path)
    admitted: int = 0  # requests admitted (first prefill)
    admission_wait_seconds: float = 0.0  # their time from add to admission
    command_wait_seconds: float = 0.0  # of it, from add until the engine thread took the request (the rest: queued)
    first_chunks: int = 0  # requests whose first chunk with frames was handed to their stream
    first_chunk_seconds: float = 0.0  # their time from add to that hand-over
    # the device's clock around the steps (CUDA; stages/talker/step_clock.py): their own GPU time and the gaps
    # between them (prefills, or the device waiting for the host); all zero without a device clock
    device_clock: DeviceClockStats = field(default_factory=DeviceClockStats)


@dataclass
class EngineCounters:
    """Sums since start, written by the engine thread only."""

    steps: int = 0
    frames: int = 0
    prefills: int = 0
    burst_prefills: int = 0
    prefill_seconds: float = 0.0
    step_seconds: float = 0.0
    device_wait_seconds: float = 0.0
    host_bound_steps: int = 0
    max_step_batch: int = 0
    admitted: int = 0
    admission_wait_seconds: float = 0.0
    command_wait_seconds: float = 0.0
    first_chunks: int = 0
    live_evictions: int = 0  # live requests ended to free a slot for waiting work, or past their lifetime
    first_chunk_seconds: float = 0.0
    parks: int = 0  # live text: requests parked / resumed
    unparks: int = 0

    def step_read(self, waited_s: float, rows: int) -> None:
        """One step's output was read after waiting `waited_s` for the device."""
        self.steps += 1
        self.device_wait_seconds += waited_s
        self.host_bound_steps += waited_s < HOST_BOUND_WAIT_S
        self.max_step_batch = max(self.max_step_batch, rows)


def snapshot(counters: EngineCounters, scheduler: Scheduler | None, queued: int, slots: int,
             device_clock: DeviceClockStats | None) -> EngineStats:
    """The engine's stats now; `queued`: adds not yet taken by the engine thread (they count as waiting)."""
    if scheduler is None:
        return EngineStats(queued, 0, 0, 0, 0, 0, 0)
    c = counters
    return EngineStats(
        waiting=scheduler.num_waiting + queued, running=scheduler.num_running, max_running=slots,
        kv_reserved_tokens=scheduler.reserved_positions,
        kv_total_tokens=scheduler.blocks.num_blocks * scheduler.blocks.block_size,
        steps=c.steps, frames=c.frames, prefills=c.prefills, burst_prefills=c.burst_prefills,
        prefill_seconds=c.prefill_seconds, step_seconds=c.step_seconds, device_wait_seconds=c.device_wait_seconds,
        host_bound_steps=c.host_bound_steps, max_step_batch=c.max_step_batch,
        parked=scheduler.num_parked, held=scheduler.num_held, live_evictions=c.live_evictions,
        admitted=c.admitted, admission_wait_seconds=c.admission_wait_seconds,
        command_wait_seconds=c.command_wait_seconds,
        first_chunks=c.first_chunks, first_chunk_seconds=c.first_chunk_seconds,
        # a copy (the engine thread adds on); none while the runner is still being built (graph capture)
        device_clock=replace(device_clock) if device_clock is not None else DeviceClockStats(),
    )
