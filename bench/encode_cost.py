"""CPU cost of streaming each response_format (deployments/audio/encoders.py), per second of audio.

espeak-ng speech at 24 kHz, pushed in the serving chunk schedule (2, 4, 8, 16, then 25 frames), timed with
process CPU time over several runs (best of 3).

    python -m bench.encode_cost   # from the repo root
"""

from __future__ import annotations

import time

from bench.time_stretch_compare import SR, TEXT, chunked, espeak
from deployments.audio.encoders import open_stream_encoder
from deployments.audio.formats import FORMATS


def cost_ms_per_s(fmt: str, pcm, speed: float, runs: int = 3) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.process_time()
        encoder = open_stream_encoder(fmt, speed=speed)
        for chunk in chunked(pcm):
            encoder.push(chunk)
        encoder.finish()
        best = min(best, time.process_time() - start)
    return 1000 * best / (pcm.size / SR)


def main():
    pcm = espeak(TEXT, 160)
    print(f"clip: {pcm.size / SR:.2f} s\n\n| format | ms CPU per s of audio | at speed 1.5 |\n|---|---|---|")
    for fmt in FORMATS:
        print(f"| {fmt} | {cost_ms_per_s(fmt, pcm, 1.0):.2f} | {cost_ms_per_s(fmt, pcm, 1.5):.2f} |", flush=True)


if __name__ == "__main__":
    main()
