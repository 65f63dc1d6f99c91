"""Where a request's first audio spent its time, hop by hop: the `Server-Timing` header of a speech response.

Each process on the path stamps wall-clock times (`time.time()`) on the stream's first chunk only: the Talker
when its `generate` starts, when its engine prefilled the request (`talker_queue` ends there: the wait for a row,
KV and the prefill's turn), when the first chunk reached the replica and when it leaves (`CodecChunk.stamps`, by
name; in between the Talker may decode it itself, deployments/talker/first_chunk_decoder.py), Code2Wav when the decode
call holding the chunk arrives and when the batch holding it starts and ends decoding (`DecodedChunk.stamps`);
the ingress adds its arrival, its Talker call, the first codec chunk's and the first PCM's receipt, and the
response. The differences are the stages of `STAGES`. A stage that crosses processes compares two processes'
clocks: exact on one machine, off by the nodes' clock skew across machines (a negative stage says so).

The header is standard (W3C Server-Timing: browsers' developer tools show it; `bench.loadgen` collects it per
request), and each stage is also a histogram, `tts_first_audio_stage_ms{stage}`, in the Ray dashboard.

A first chunk without the Talker's stamps (a Talker that sets none) has its stages merged into `talker_and_back`;
a first chunk the Talker decoded has no Code2Wav stages.

A live context (WebSocket) times its first audio from its first text instead (`live`): its Talker request started
when the context opened and waits for text, so its path is the text's way in (the ingress's mailbox, the Talker
replica's poll of it: `to_talker_text`, up to the Talker's stamp of the first text handed to its engine; before it
`to_talker_call`, the part of that way spent before the request's call started in the Talker), then `talker_text`
(until the text made its first prefill's text final: a word sent as " word" waits for the next one), `talker_queue`
and the same hops as a request's from the Talker on, and `respond` up to the first audio message sent. Its stages go to the
client in the context's `done` message (docs/websocket.md), not to the histogram: their `talker` and `total` mean
something else than a request's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

STAGES: dict[str, str] = {
    "ingress": "arrival at the ingress to its Talker call: validation, routing, tokenization, voice",
    "to_talker": "the call's hop to a Talker replica, until its generate runs",
    "ingress_call": "live: the first text waiting for the ingress to make its request's Talker call (0 when the call "
                    "was made before the text came)",
    "to_talker_call": "live: the first text waiting for its request's call to reach a Talker replica and start there, "
                      "from the later of the text's arrival and the call (0 when it started before the text came)",
    "to_talker_text": "live: the first text's way from the ingress to the Talker's engine (its mailbox, the poll)",
    "talker_text": "live: in the Talker's engine, its first text waiting for the text that makes its first prefill's "
                   "text final (the next word, a flush or the end)",
    "talker_queue": "in the Talker's engine queue until its prefill: a row, KV blocks and its turn among the arrivals",
    "talker": "in the Talker replica from its prefill (without the engine's stamps: from the call) to the first chunk "
              "out of its engine: the first chunk's frames",
    "talker_decode": "the Talker decoding the first chunk itself (deployments/talker/first_chunk_decoder.py; ~0 if not)",
    "to_ingress": "the first codec chunk's hop back to the ingress",
    "to_code2wav": "the ingress's decode batching and the hop to a Code2Wav replica",
    "code2wav_queue": "waiting in Code2Wav for the decoder (the batch before it)",
    "code2wav": "the decode batch that held the first chunk",
    "from_code2wav": "the first PCM's hop back to the ingress",
    "respond": "the ingress, from the first PCM to its response (live: to the first audio message sent)",
    "talker_and_back": "to_talker .. to_ingress, where the first chunk came without the Talker's stamps",
    "total": "arrival at the ingress to its response (live: its first text's arrival to its first audio sent)",
}


def now() -> float:
    """The clock every stamp uses (wall time: comparable between the processes of one machine)."""
    return time.time()


@dataclass
class FirstAudioTiming:
    """The ingress's stamps of one request, and the stages' stamps carried back with its first chunk."""

    arrived: float
    talker_called: float | None = None
    chunk_received: float | None = None
    # CodecChunk.stamps: "started" (generate), "cut" (the first chunk out of the engine), "left" (out of the replica),
    # the engine's "queued" and "prefilled", live "text_in" (the first text handed to the engine)
    talker: dict[str, float] = field(default_factory=dict)
    decoded_received: float | None = None
    code2wav: tuple[float, ...] = ()  # (call arrived, batch started, batch ended): DecodedChunk.stamps
    responded: float | None = None
    live: bool = False  # a live context's: `arrived` is its first text's arrival, set when that text comes

    def stages_ms(self) -> dict[str, float]:
        """The stages that this request's stamps determine, in ms, in path order (plus `total`)."""
        if self.live:
            return self._stages_ms(self._live_marks())
        marks: list[tuple[str, float | None]] = [("ingress", self.talker_called)]
        t = self.talker
        if "cut" in t:
            marks.append(("to_talker", t["started"]))
            marks += self._engine_marks(("talker_queue", "prefilled"), after=t["started"])
            marks += self._replica_marks()
        else:
            marks.append(("talker_and_back", self.chunk_received))
        return self._stages_ms(marks + self._code2wav_marks())

    def _engine_marks(self, *stages: tuple[str, str], after: float) -> list[tuple[str, float | None]]:
        """The engine's stages (stage, stamp) that its stamps give in order, between `after` and the cut; none if
        one is missing or out of order (another engine, or a request queued before its first text came)."""
        times = [self.talker.get(stamp) for _, stamp in stages]
        if any(x is None for x in times):
            return []
        chain = [after, *times, self.talker["cut"]]
        if sorted(chain) != chain:
            return []
        return [(name, x) for (name, _), x in zip(stages, times, strict=True)]

    def _replica_marks(self) -> list[tuple[str, float | None]]:
        t = self.talker
        return [("talker", t["cut"]), ("talker_decode", t["left"]), ("to_ingress", self.chunk_received)]

    def _live_marks(self) -> list[tuple[str, float | None]]:
        """The Talker's stamps from its first text on (without that stamp, `talker` runs from the text's arrival
        here); the request's admission and prefill happened before the text came."""
        marks: list[tuple[str, float | None]] = []
        t = self.talker
        if "text_in" in t:
            # a burst of opens can start the Talker's side of a request after its first text reached the ingress:
            # the ingress made the call late (its loop busy with the other opens), or the call took long to arrive
            called = max(self.arrived, self.talker_called or self.arrived)
            marks += [("ingress_call", called), ("to_talker_call", max(called, t["started"])),
                      ("to_talker_text", t["text_in"])]
            if "cut" in t:
                marks += self._engine_marks(("talker_text", "queued"), ("talker_queue", "prefilled"), after=t["text_in"])
        if "cut" in t:
            marks += self._replica_marks()
        else:
            marks.append(("talker_and_back", self.chunk_received))
        return marks + self._code2wav_marks()

    def _code2wav_marks(self) -> list[tuple[str, float | None]]:
        marks: list[tuple[str, float | None]] = []
        if len(self.code2wav) == 3:
            marks += [("to_code2wav", self.code2wav[0]), ("code2wav_queue", self.code2wav[1]),
                      ("code2wav", self.code2wav[2]), ("from_code2wav", self.decoded_received)]
        return marks + [("respond", self.responded)]

    def _stages_ms(self, marks: list[tuple[str, float | None]]) -> dict[str, float]:
        stages, last = {}, self.arrived
        for name, t in marks:
            if t is None:  # a stamp missing (e.g. a failed request): the stages after it are not determined
                break
            stages[name] = (t - last) * 1000
            last = t
        if self.responded is not None:
            stages["total"] = (self.responded - self.arrived) * 1000
        return stages

    def header(self) -> str:
        """The `Server-Timing` value: `ingress;dur=0.41, to_talker;dur=1.20, ...` (ms)."""
        return ", ".join(f"{name};dur={ms:.2f}" for name, ms in self.stages_ms().items())


def parse_server_timing(value: str) -> dict[str, float]:
    """A `Server-Timing` header -> {name: dur ms}; entries without a `dur` are skipped."""
    out: dict[str, float] = {}
    for entry in value.split(","):
        name, *params = (part.strip() for part in entry.split(";"))
        for param in params:
            key, _, dur = param.partition("=")
            if name and key.strip() == "dur":
                try:
                    out[name] = float(dur)
                except ValueError:
                    pass
    return out
