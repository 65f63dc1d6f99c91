"""Requests spread over worker processes: a load generator that is never the bottleneck it measures.

One Python event loop reading hundreds of streams' chunks falls behind (2026-11-22: 53 ms event-loop lag at
c=512), and its lag lands in every latency it reports. `ProcessPoolClient` has `SpeechClient`'s interface, so the
load shapes in `runner.py` stay as they are: the parent loop only schedules requests (one message out and one back
per request), and each of N spawned workers runs a real `SpeechClient` on its own loop and reads the bodies.

Times stay comparable across processes because `time.perf_counter()` is the system-wide monotonic clock on Linux
and macOS: a worker measures `perf_counter() - origin` with the parent's `origin`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from .client import SpeechClient, SpeechSettings
from .records import RequestResult
from .runner import lag_monitor

STOP_TIMEOUT_S = 10.0


class WorkerLost(RuntimeError):
    """A worker process ended while requests it was running were outstanding."""


@dataclass
class _Worker:
    process: mp.process.BaseProcess
    conn: Connection
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    sent: int = 0  # requests handed to this worker so far


class ProcessPoolClient:
    """`SpeechClient`'s interface (`synthesize`, `inflight`, `peak_inflight`, `reset_peak`) over `processes`
    worker processes; a request goes to the worker with the fewest outstanding."""

    def __init__(self, base_url: str, settings: SpeechSettings, processes: int):
        if processes < 1:
            raise ValueError("processes must be >= 1")
        self.base_url, self.settings, self.processes = base_url, settings, processes
        self.peak_inflight = 0
        self._workers: list[_Worker] = []
        self._ids = itertools.count()
        self._lag_s: list[float] = []

    async def __aenter__(self) -> ProcessPoolClient:
        ctx = mp.get_context("spawn")  # never fork a process that runs an event loop
        loop = asyncio.get_running_loop()
        for i in range(self.processes):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_worker_main, args=(child, self.base_url, self.settings),
                                  name=f"loadgen-worker-{i}", daemon=True)
            process.start()
            child.close()
            worker = _Worker(process, parent)
            self._workers.append(worker)
            loop.add_reader(parent.fileno(), self._on_readable, worker)
        return self

    async def __aexit__(self, *exc) -> None:
        loop = asyncio.get_running_loop()
        for w in self._workers:
            loop.remove_reader(w.conn.fileno())
            with contextlib.suppress(OSError):
                w.conn.send(("stop",))
        for w in self._workers:
            await asyncio.to_thread(w.process.join, STOP_TIMEOUT_S)
            if w.process.is_alive():
                w.process.terminate()
            w.conn.close()
            self._fail_pending(w)
        self._workers = []

    @property
    def inflight(self) -> int:
        return sum(len(w.pending) for w in self._workers)

    @property
    def requests_per_worker(self) -> list[int]:
        return [w.sent for w in self._workers]

    def reset_peak(self) -> None:
        self.peak_inflight = self.inflight

    def worker_loop_lag(self) -> list[float]:
        """The workers' event-loop lag samples since the last call."""
        samples, self._lag_s = self._lag_s, []
        return samples

    async def synthesize(self, r: RequestResult, origin: float) -> None:
        """Run `r` in a worker and copy its outcome into `r`; on cancellation the worker cancels it too."""
        assert self._workers, "use `async with ProcessPoolClient(...)`"
        worker = min(self._workers, key=lambda w: len(w.pending))
        rid = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        worker.pending[rid] = future
        worker.sent += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        try:
            worker.conn.send(("run", rid, r, origin))
            done: RequestResult = await future
            vars(r).update(vars(done))
        except asyncio.CancelledError:
            with contextlib.suppress(OSError):
                worker.conn.send(("cancel", rid))
            r.failure, r.done, r.end_s = "aborted", True, time.perf_counter() - origin
            raise
        except (WorkerLost, OSError) as e:
            r.failure, r.error, r.done, r.end_s = "worker_lost", str(e), True, time.perf_counter() - origin
        finally:
            worker.pending.pop(rid, None)

    def _on_readable(self, worker: _Worker) -> None:
        try:
            while worker.conn.poll():
                _, rid, result, lag_s = worker.conn.recv()
                self._lag_s.extend(lag_s)
                future = worker.pending.get(rid)
                if future is not None and not future.done():
                    future.set_result(result)
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(worker.conn.fileno())
            self._fail_pending(worker)

    def _fail_pending(self, worker: _Worker) -> None:
        for future in worker.pending.values():
            if not future.done():
                future.set_exception(WorkerLost(f"{worker.process.name} exited ({worker.process.exitcode})"))


def _worker_main(conn: Connection, base_url: str, settings: SpeechSettings) -> None:
    try:
        import uvloop  # as the parent: the GPU image has it

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(conn, base_url, settings))


async def _serve(conn: Connection, base_url: str, settings: SpeechSettings) -> None:
    """Run the parent's requests until it says stop (or goes away); answer each with its filled result."""
    loop = asyncio.get_running_loop()
    stopped = loop.create_future()
    tasks: dict[int, asyncio.Task] = {}
    lag_s: list[float] = []

    async def run(client: SpeechClient, rid: int, r: RequestResult, origin: float) -> None:
        with contextlib.suppress(asyncio.CancelledError):  # synthesize marks r aborted; the parent ignores it
            await client.synthesize(r, origin)
        tasks.pop(rid, None)
        samples = lag_s[:]
        lag_s.clear()
        with contextlib.suppress(OSError):
            conn.send(("done", rid, r, samples))

    async with SpeechClient(base_url, settings) as client:
        def on_readable() -> None:
            try:
                while conn.poll():
                    msg = conn.recv()
                    if msg[0] == "run":
                        _, rid, r, origin = msg
                        tasks[rid] = loop.create_task(run(client, rid, r, origin))
                    elif msg[0] == "cancel" and msg[1] in tasks:
                        tasks[msg[1]].cancel()
                    elif msg[0] == "stop" and not stopped.done():
                        stopped.set_result(None)
            except (EOFError, OSError):
                if not stopped.done():
                    stopped.set_result(None)

        loop.add_reader(conn.fileno(), on_readable)
        monitor = loop.create_task(lag_monitor(lag_s))
        try:
            await stopped
        finally:
            loop.remove_reader(conn.fileno())
            for task in [monitor, *tasks.values()]:
                task.cancel()
            await asyncio.gather(monitor, *tasks.values(), return_exceptions=True)
    conn.close()
