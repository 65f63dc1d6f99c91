"""AlignerServer: the `Aligner` deployment. Word timestamps of a piece of served audio and its text.

`align(AlignRequest)` times one piece (PCM at 24 kHz) against its text. Each piece's host-side work (resampling,
normalizing, tokenizing: `prepare_piece`) runs as it arrives, on a small pool of threads, so it overlaps the device's
forwards instead of adding to them. Prepared pieces that arrive while a forward runs (many streams, several ingress
replicas) wait together and are timed in few batched forwards, on one thread that owns the device: at most
`max_batch_size` pieces, and at most `max_batch_audio_s` of padded audio (pieces x the longest piece's seconds), per
forward, in the order they became ready. The aligner pads a batch's waveforms to its longest as the official one
does, so a piece's times may differ by a class (80 ms) with what else shares its forward (docs/aligner.md).

A piece the aligner cannot time fails its own call alone with a 400 (`param: "timestamps"`): longer than the
aligner's `max_seconds` (`audio_too_long`), NaN samples or a malformed array (`cannot_align`), a language it does not
segment (`unsupported_language`), too many words (`text_too_long`). A piece with no word to time (empty text,
punctuation only) or shorter than the aligner's shortest input is answered [] without a forward: a piece may be
silence. The aligner is whatever `AlignerEngineProtocol` names; in production `stages.aligner.Aligner`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from deployments import constants as C
from deployments.aligner.engine_protocol import AlignerEngineProtocol
from deployments.coalescing import Coalescer
from deployments.config import AlignerDeploymentConfig
from deployments.errors import APIError
from deployments.loading import (
    Log,
    aligner_location,
    configure_torch,
    import_object,
    replica_log,
    resolve_device_dtype,
    this_replica,
)
from deployments.messages import AlignerInfo, AlignRequest
from deployments.metrics import AlignerMetrics
from stages.aligner.timestamps import Word
from stages.aligner.words import ALIGNABLE_LANGUAGES, alignable_language, split_words
from stages.contract import SAMPLE_RATE

DEFAULT_ENGINE_CLS = "stages.aligner.aligner:Aligner"
PARAM = "timestamps"  # the API field a refused piece names


@dataclass(frozen=True)
class Piece:
    """A checked piece, to prepare."""

    wave: np.ndarray  # float32 at SAMPLE_RATE
    text: str
    language: str  # split_words' hint: "" or one of ALIGNABLE_LANGUAGES

    @property
    def seconds(self) -> float:
        return self.wave.shape[0] / SAMPLE_RATE


@dataclass(frozen=True)
class Prepared:
    """A prepared piece waiting for a forward."""

    piece: Any  # what the engine's prepare_piece returned
    seconds: float
    since: float  # when it was ready (perf_counter): the wait for a forward is counted from here


@dataclass
class AlignerStats:
    """A replica's counters since it started: pieces prepared and the seconds that took on the preparing threads;
    forwards, the pieces and audio seconds they timed and the seconds the device thread spent on them; the pieces'
    summed wait from prepared to their forward's start (a queue that grows says the device thread is the limit); the
    longest forward, and the one-time work in forwards after the warm-up (the engine's `one_time_work`: graphs
    captured, functions traced, Triton kernels compiled, new convolution shapes; each cost a request's wait)."""

    prepared: int = 0
    prepare_s: float = 0.0
    forwards: int = 0
    pieces: int = 0
    audio_s: float = 0.0
    forward_s: float = 0.0
    queue_wait_s: float = 0.0
    max_forward_s: float = 0.0
    late_graphs: int = 0
    late_traces: int = 0
    late_kernels: int = 0
    late_conv_shapes: int = 0
    late_spectrogram_shapes: int = 0

    def add_late(self, late: dict[str, int]) -> None:
        """One forward's one-time work (the engine's `one_time_work` after minus before)."""
        self.late_graphs += late.get("graphs", 0)
        self.late_traces += late.get("traces", 0)
        self.late_kernels += late.get("kernels", 0)
        self.late_conv_shapes += late.get("conv_shapes", 0)
        self.late_spectrogram_shapes += late.get("spectrogram_shapes", 0)

    def add_prepared(self, seconds: float) -> None:
        self.prepared += 1
        self.prepare_s += seconds

    def add_forward(self, pieces: int, audio_s: float, seconds: float, waited_s: float) -> None:
        self.forwards += 1
        self.pieces += pieces
        self.audio_s += audio_s
        self.forward_s += seconds
        self.queue_wait_s += waited_s
        self.max_forward_s = max(self.max_forward_s, seconds)


def plan_forwards(seconds: list[float], max_items: int, max_padded_s: float) -> list[list[int]]:
    """Consecutive groups of the pieces (by index, arrival order kept) with at most `max_items` each and at most
    `max_padded_s` of padded audio (items x the group's longest); a piece over the budget alone makes a group."""
    groups: list[list[int]] = []
    longest = 0.0
    for i, s in enumerate(seconds):
        if groups and len(groups[-1]) < max_items and (len(groups[-1]) + 1) * max(longest, s) <= max_padded_s:
            groups[-1].append(i)
            longest = max(longest, s)
        else:
            groups.append([i])
            longest = s
    return groups


def refused(message: str, code: str) -> APIError:
    return APIError(400, message, param=PARAM, code=code)


class AlignerServer:
    async def __init__(self, config: AlignerDeploymentConfig):
        self._setup(config)
        await self.start()

    @classmethod
    def sync_init(cls, config: AlignerDeploymentConfig, engine: AlignerEngineProtocol | None = None) -> AlignerServer:
        """Built without Serve (tests): `start()` loads the configured aligner unless `engine` is given."""
        server = cls.__new__(cls)
        server._setup(config, engine)
        return server

    def _setup(self, config: AlignerDeploymentConfig, engine: AlignerEngineProtocol | None = None) -> None:
        self._config = config
        self._engine = engine
        self._ready = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="aligner")  # the only thread using the device
        self._preparers = ThreadPoolExecutor(C.ALIGNER_PREPARE_THREADS, thread_name_prefix="aligner-prepare")
        self._stats = AlignerStats()
        self._pending = 0  # pieces of align() calls waiting for or in a forward
        # heartbeat: when a forward last finished, or work arrived at an idle replica (check_health)
        self._clock = time.monotonic
        self._last_progress = self._clock()
        self._metrics: AlignerMetrics | None = None
        self._batches: Coalescer[Prepared, list[Word] | Exception] = Coalescer(self._align_pieces)
        self._log: Callable[[str], None] = replica_log(C.ALIGNER_DEPLOYMENT_NAME)

    async def start(self) -> None:
        log = self._log
        if self._engine is None:
            self._engine = await self._on_thread(load_aligner, self._config, log)
        if self._config.warmup:  # compiles and graph captures here rather than in a request's wait
            t0 = time.perf_counter()
            graphs = await self._on_thread(self._engine.warm_up, self._config.max_batch_size,
                                           self._config.max_batch_audio_s)
            log(f"warmed up in {time.perf_counter() - t0:.2f} s ({graphs} CUDA graphs captured)")
        self._metrics = AlignerMetrics()
        self._ready = True
        log(f"ready: pieces up to {self._engine.max_seconds:g} s, forwards of up to {self._config.max_batch_size} "
            f"pieces and {self._config.max_batch_audio_s:g} s of padded audio")

    async def info(self) -> AlignerInfo:
        return AlignerInfo(max_seconds=float(self._engine.max_seconds), languages=ALIGNABLE_LANGUAGES)

    async def align(self, request: AlignRequest) -> list[Word]:
        """The words of `request.text` with their start/end in seconds from the start of `request.pcm` (in order;
        [] when there is nothing to time). Raises APIError 400 for a piece the aligner cannot time."""
        t0 = time.perf_counter()
        try:
            piece = self._checked(request)
            if piece is None:
                return []
            if self._pending == 0:
                self._last_progress = self._clock()
            self._pending += 1
            try:
                prepared = await self._prepare(piece)
                result = await self._batches.submit(prepared)
            finally:
                self._pending -= 1
            if isinstance(result, Exception):
                raise result
            return result
        finally:
            if self._metrics is not None:
                self._metrics.call_latency_ms.observe((time.perf_counter() - t0) * 1000)

    def _checked(self, request: AlignRequest) -> Piece | None:
        """The piece to time, None when there is nothing to time, or an APIError 400 raised for it."""
        try:
            language = alignable_language(request.language)
        except ValueError as exc:
            raise refused(str(exc), "unsupported_language") from None
        pcm = request.pcm
        if not isinstance(pcm, np.ndarray) or pcm.ndim != 1 or pcm.dtype.kind not in "if":
            raise refused("the audio to time must be 1-D PCM samples", "cannot_align")
        if pcm.dtype.kind == "f":
            if not np.isfinite(pcm).all():
                raise refused("the audio to time contains NaN or infinite samples", "cannot_align")
            wave = pcm.astype(np.float32)
        else:
            wave = pcm.astype(np.float32) / 32768.0
        seconds = wave.shape[0] / SAMPLE_RATE
        if seconds > self._engine.max_seconds:
            raise refused(f"word timestamps cover at most {self._engine.max_seconds:g} s of audio per piece; this "
                          f"piece is {seconds:.1f} s", "audio_too_long")
        if not isinstance(request.text, str):
            raise refused("the text to time must be a string", "cannot_align")
        words = split_words(request.text, language)
        if len(words) > C.ALIGNER_MAX_WORDS:
            raise refused(f"word timestamps cover at most {C.ALIGNER_MAX_WORDS} words per piece; this piece has "
                          f"{len(words)}", "text_too_long")
        if not words or wave.shape[0] < self._engine.min_samples(SAMPLE_RATE):
            return None  # nothing to time, or too short to hold a word (silence)
        return Piece(wave, request.text, language)

    async def _prepare(self, piece: Piece) -> Prepared:
        t0 = time.perf_counter()
        try:
            prepared = await asyncio.get_running_loop().run_in_executor(
                self._preparers, self._engine.prepare_piece, piece.wave, piece.text, SAMPLE_RATE, piece.language)
        except ValueError as e:
            raise refused(f"the aligner cannot time this piece: {e}", "cannot_align") from None
        done = time.perf_counter()
        self._stats.add_prepared(done - t0)
        return Prepared(prepared, piece.seconds, done)

    async def _align_pieces(self, pieces: list[Prepared]) -> list[list[Word] | Exception]:
        """All pieces waiting, in forwards planned by `plan_forwards` -> per piece its words or its error."""
        results: list[list[Word] | Exception] = [[] for _ in pieces]
        cfg = self._config
        for group in plan_forwards([p.seconds for p in pieces], cfg.max_batch_size, cfg.max_batch_audio_s):
            answers = await self._on_thread(self._forward_isolated, [pieces[i] for i in group])
            for i, answer in zip(group, answers, strict=True):
                results[i] = answer
        return results

    def _forward_isolated(self, pieces: list[Prepared]) -> list[list[Word] | Exception]:
        """One forward of `pieces`; should the aligner refuse one of them (the checks above missed it), each piece
        again alone, so that only the refused one fails. Errors that are not the pieces' (the device's) fail them
        all."""
        try:
            return list(self._forward(pieces))
        except ValueError as e:
            if len(pieces) == 1:
                return [refused(f"the aligner cannot time this piece: {e}", "cannot_align")]
        except Exception as e:
            return [e] * len(pieces)
        return [answer for piece in pieces for answer in self._forward_isolated([piece])]

    def _forward(self, pieces: list[Prepared]) -> list[list[Word]]:
        t0 = time.perf_counter()
        before = self._engine.one_time_work()
        try:
            return self._engine.align_prepared([p.piece for p in pieces])
        finally:
            self._last_progress = self._clock()
            spent = time.perf_counter() - t0
            audio_s = sum(p.seconds for p in pieces)
            late = ({k: n - before.get(k, 0) for k, n in self._engine.one_time_work().items()} if self._ready
                    else {})
            self._stats.add_late(late)
            # a request waited for it: say what it was (a new convolution shape alone is common and cheap)
            if any(late.get(k) for k in ("graphs", "traces", "kernels")) or spent > C.ALIGNER_SLOW_FORWARD_S:
                self._log(f"a forward of {len(pieces)} pieces ({audio_s:.1f} s of audio, the longest "
                          f"{max(p.seconds for p in pieces):.1f} s) took {spent * 1e3:.0f} ms; in it "
                          f"{late.get('graphs', 0)} CUDA graphs captured, {late.get('traces', 0)} functions traced "
                          f"by torch.compile, {late.get('kernels', 0)} Triton kernels compiled, "
                          f"{late.get('conv_shapes', 0)} convolution and {late.get('spectrogram_shapes', 0)} "
                          "spectrogram (cuFFT) shapes met for the first time")
            self._stats.add_forward(len(pieces), audio_s, spent, sum(t0 - p.since for p in pieces))
            self._metrics.batch_size.observe(len(pieces))
            self._metrics.seconds_per_audio_second.observe(spent / audio_s)

    async def engine_stats(self) -> dict:
        """This replica's counters since it started (`AlignerStats`) and which replica answered: what
        bench/replica_stats.py reads to say where a timestamp's time goes."""
        return {"replica": this_replica(), **dataclasses.asdict(self._stats)}

    async def ready(self) -> bool:
        return self._ready

    def check_health(self) -> None:
        """Serve replaces the replica when this raises: pieces pending and no forward finished for too long."""
        if not self._ready:
            raise RuntimeError("the aligner is not running")
        stalled_for = self._clock() - self._last_progress
        if self._pending > 0 and stalled_for > self._config.stall_timeout_s:
            raise RuntimeError(f"the aligner made no progress for {stalled_for:.0f} s with {self._pending} pieces "
                               "pending")

    def __del__(self) -> None:
        self._executor.shutdown(wait=False)
        self._preparers.shutdown(wait=False)

    async def _on_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)


def load_aligner(config: AlignerDeploymentConfig, log: Log) -> AlignerEngineProtocol:
    """The configured aligner checkpoint (or the embedded tiny one) on the configured device (blocking)."""
    path = aligner_location(config.model, log)
    device, dtype = resolve_device_dtype(config)
    configure_torch(config, device)
    t0 = time.perf_counter()
    engine = import_object(DEFAULT_ENGINE_CLS).load(path, device, dtype)
    log(f"aligner {path} loaded on {device} ({dtype}) in {time.perf_counter() - t0:.1f} s")
    return engine
