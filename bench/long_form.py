"""Long form: one chapter (~10,000 characters by default) streamed from a running server in one request, and how
continuous its audio arrived.

The chapter is built from the load generator's English sentences (bench/loadgen/sentences.txt), five to a
paragraph, or read from `--text-file`. It is sent as one streaming `/v1/audio/speech` request of raw PCM; a player
is assumed to start at the first byte and play in real time. Reported (JSON, stdout and `--out`):

- `chars`, `audio_s` (received), `ttfa_ms` (request to first audio byte), `wall_s` (request to the last byte);
- `max_boundary_gap_ms`: the longest stall the player would hear: audio that arrived later than its playback time
  (0 when the audio always arrived ahead of the player; the server's pieces meet at boundaries, so a stall there
  is a gap between pieces);
- `complete`: the stream ended with its terminating chunk (a speech cut at a frame cap, or a failure, does not).

    serve run configs/local.yaml &
    python -m bench.long_form --url http://127.0.0.1:8000 --out long_form.json

Random weights never stop by themselves: pass `--max-new-tokens N --suppress-eos` (N frames per piece).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

from bench.loadgen.sentences import load_sentences

SAMPLE_RATE = 24000
BYTES_PER_SECOND = SAMPLE_RATE * 2  # s16le mono


def chapter(chars: int, per_paragraph: int = 5) -> str:
    """English sentences, `per_paragraph` to a paragraph, until `chars` characters (never beyond)."""
    sentences = [s.text for s in load_sentences(language="en")]
    out, paragraph, i = "", [], 0
    while True:
        sentence = sentences[i % len(sentences)]
        i += 1
        candidate = out + ("\n\n" if out and not paragraph else " " if paragraph else "") + sentence
        if len(candidate) > chars:
            return out
        out = candidate
        paragraph.append(sentence)
        if len(paragraph) == per_paragraph:
            paragraph = []


class PlayerClock:
    """A real-time player started at the first byte: the longest time it waited for audio that was late."""

    def __init__(self):
        self.started: float | None = None
        self.audio_s = 0.0
        self.max_stall_s = 0.0

    def arrived(self, seconds: float, now: float) -> None:
        if self.started is None:
            self.started = now
        else:
            stall = (now - self.started) - self.audio_s  # how long the player has been waiting for this audio
            if stall > 0:
                self.max_stall_s = max(self.max_stall_s, stall)
                self.started += stall  # it resumes with this audio
        self.audio_s += seconds


def run(url: str, text: str, model: str | None, voice: str, seed: int | None, max_new_tokens: int | None,
        suppress_eos: bool, timeout_s: float) -> dict:
    body = {"input": text, "voice": voice, "response_format": "pcm", "stream": True}
    for key, value in (("model", model), ("seed", seed), ("max_new_tokens", max_new_tokens)):
        if value is not None:
            body[key] = value
    if suppress_eos:
        body["suppress_eos"] = True
    clock, received, complete, status = PlayerClock(), 0, False, None
    ttfa = None
    t0 = time.monotonic()
    try:
        with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=timeout_s) as r:
            status = r.status_code
            if status != 200:
                return {"status": status, "error": r.read().decode(errors="replace")[:500]}
            for data in r.iter_bytes():
                now = time.monotonic()
                if ttfa is None:
                    ttfa = now - t0
                received += len(data)
                clock.arrived(len(data) / BYTES_PER_SECOND, now)
        complete = True
    except httpx.RemoteProtocolError:  # the server ended the stream without its terminating chunk
        complete = False
    wall = time.monotonic() - t0
    return {"status": status, "chars": len(text), "audio_s": round(received / BYTES_PER_SECOND, 3),
            "ttfa_ms": round(ttfa * 1000, 1) if ttfa is not None else None, "wall_s": round(wall, 3),
            "max_boundary_gap_ms": round(clock.max_stall_s * 1000, 1), "complete": complete}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--chars", type=int, default=10_000, help="length of the generated chapter")
    p.add_argument("--text-file", help="read the chapter from this file instead")
    p.add_argument("--model")
    p.add_argument("--voice", default="vivian")
    p.add_argument("--seed", type=int)
    p.add_argument("--max-new-tokens", type=int, help="frames per piece at most (random weights)")
    p.add_argument("--suppress-eos", action="store_true")
    p.add_argument("--timeout-s", type=float, default=3600)
    p.add_argument("--out")
    a = p.parse_args()
    text = Path(a.text_file).read_text() if a.text_file else chapter(a.chars)
    report = run(a.url.rstrip("/"), text, a.model, a.voice, a.seed, a.max_new_tokens, a.suppress_eos, a.timeout_s)
    print(json.dumps(report))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
