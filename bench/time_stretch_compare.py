"""`speed`: FFmpeg's atempo (deployments/audio/tempo.py) vs the hand-written phase vocoder, on real speech.

The clip is espeak-ng speech (apt-get install espeak-ng) resampled to 24 kHz. For each speed and method:
  len err     output length - round(n / speed), samples
  end err     when the last word ends (envelope above -35 dB of the peak) vs the input's end / speed, ms
  f0 cents    median |f0 shift| over frames voiced in both (autocorrelation f0; output frame at t vs
              input frame at t * speed): pitch preserved = near 0
  rt LSD      round trip (speed, then 1 / speed) vs the input: log-spectral distance, dB (phasiness,
              smearing, repeated or skipped fragments all raise it)
  espeak LSD  vs espeak-ng itself speaking at speed x the rate, DTW-aligned log-mel distance, dB (how
              far from natively faster/slower speech)
  flux p99    99th percentile / median of the spectral flux, output over input (clicks and
              discontinuities are flux spikes)
  boundary    largest sample step where input chunks meet (mapped to output time) / the output's
              99.9th percentile step: above 1 = a click at a chunk boundary
  ms/s        CPU time per second of input audio
"Streamed" rows feed the method chunk by chunk (2, 4, 8, 16 then 25 frames of 1920 samples) as the
ingress does: atempo keeps its state across chunks; the phase vocoder has none, so each chunk is stretched
on its own (what streaming it would take).

    python -m bench.time_stretch_compare [--text "..."] [--json out.json]   # from the repo root
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time

import numpy as np
import soundfile as sf
import soxr

from deployments.audio.formats import float_to_pcm16, pcm16_to_float
from deployments.audio.tempo import Tempo

SR = 24000
SPEEDS = (0.5, 0.75, 1.25, 1.5, 2.0, 4.0)
CHUNKS = (2, 4, 8, 16)  # frames; then 25 until the end (the serving schedule)
TEXT = ("The quick brown fox jumps over the lazy dog. Streaming speech should keep its pitch when the tempo "
        "changes, and every word should stay clear at half speed or twice as fast.")
ESPEAK_WPM = 160


def espeak(text: str, wpm: int) -> np.ndarray:
    """int16 speech at 24 kHz from espeak-ng."""
    if shutil.which("espeak-ng") is None:
        raise SystemExit("espeak-ng is not installed (apt-get install -y espeak-ng)")
    with tempfile.NamedTemporaryFile(suffix=".wav") as f:
        subprocess.run(["espeak-ng", "-v", "en-us", "-s", str(wpm), "-w", f.name, text], check=True)
        audio, rate = sf.read(f.name, dtype="float32")
    return float_to_pcm16(soxr.resample(audio, rate, SR) * 0.9 / max(np.abs(audio).max(), 1e-6))


def chunked(pcm: np.ndarray) -> list[np.ndarray]:
    sizes, start, out = list(CHUNKS), 0, []
    while start < pcm.size:
        n = (sizes.pop(0) if sizes else 25) * 1920
        out.append(pcm[start:start + n])
        start += n
    return out


# ---------------------------------------------------------------- the methods
def time_stretch(  # deployments/audio/formats.py until atempo replaced it
pcm: np.ndarray, speed: float, n_fft: int = 768, hop: int = 192) -> np.ndarray:
    """Pitch-preserving tempo change by `speed` (2.0 = twice as fast): a phase vocoder, int16 in and out.

    The same post-processing vllm-omni applies (STFT n_fft 768); the output has round(len / speed) samples.
    """
    if speed == 1.0 or pcm.size == 0:
        return pcm
    x = pcm16_to_float(pcm)
    window = np.hanning(n_fft + 1)[:-1].astype(np.float32)
    padded = np.pad(x, (n_fft // 2, n_fft // 2 + n_fft))
    frames = np.lib.stride_tricks.sliding_window_view(padded, n_fft)[::hop] * window
    spec = np.fft.rfft(frames, axis=1)  # [T, F]
    steps = np.arange(0, spec.shape[0] - 1, speed)
    expected = 2 * np.pi * hop * np.arange(spec.shape[1]) / n_fft
    phase = np.angle(spec[0])
    out = np.empty((len(steps), spec.shape[1]), dtype=np.complex64)
    for i, t in enumerate(steps):
        lo, frac = int(t), t - int(t)
        mag = (1 - frac) * np.abs(spec[lo]) + frac * np.abs(spec[lo + 1])
        out[i] = mag * np.exp(1j * phase)
        delta = np.angle(spec[lo + 1]) - np.angle(spec[lo]) - expected
        phase += expected + (delta - 2 * np.pi * np.round(delta / (2 * np.pi)))
    y = np.zeros(len(steps) * hop + n_fft, dtype=np.float32)
    norm = np.zeros_like(y)
    for i, frame in enumerate(np.fft.irfft(out, n=n_fft, axis=1).astype(np.float32)):
        y[i * hop:i * hop + n_fft] += frame * window
        norm[i * hop:i * hop + n_fft] += window**2
    y = y[n_fft // 2:] / np.maximum(norm[n_fft // 2:], 1e-3)
    n_out = int(round(pcm.size / speed))
    y = np.pad(y, (0, max(0, n_out - y.size)))[:n_out]
    return float_to_pcm16(y)


def atempo_whole(pcm, speed):
    tempo = Tempo(speed, SR)
    return np.concatenate([tempo.push(pcm), tempo.finish()])


def atempo_streamed(pcm, speed):
    tempo = Tempo(speed, SR)
    return np.concatenate([*(tempo.push(c) for c in chunked(pcm)), tempo.finish()])


def vocoder_whole(pcm, speed):
    return time_stretch(pcm, speed)


def vocoder_streamed(pcm, speed):
    return np.concatenate([time_stretch(c, speed) for c in chunked(pcm)])


METHODS = {"atempo": atempo_whole, "atempo streamed": atempo_streamed,
           "phase vocoder": vocoder_whole, "phase vocoder streamed": vocoder_streamed}


# ---------------------------------------------------------------- measures
def stft_mag(x: np.ndarray, n_fft: int = 1024, hop: int = 240) -> np.ndarray:
    x = pcm16_to_float(x) if x.dtype == np.int16 else x
    x = np.pad(x, (n_fft // 2, n_fft // 2))
    frames = np.lib.stride_tricks.sliding_window_view(x, n_fft)[::hop] * np.hanning(n_fft)
    return np.abs(np.fft.rfft(frames, axis=1))


def log_spec_distance(a: np.ndarray, b: np.ndarray) -> float:
    """RMS difference of log power spectra (dB) over frames where either is above -60 dB of its peak."""
    n = min(a.size, b.size)
    sa, sb = stft_mag(a[:n]), stft_mag(b[:n])
    la, lb = (20 * np.log10(np.maximum(s, 1e-5)) for s in (sa, sb))
    frame_db = 10 * np.log10(np.maximum((sa**2).sum(1), 1e-12))
    active = frame_db > frame_db.max() - 60
    return float(np.sqrt(((la - lb) ** 2)[active].mean()))


def mel_matrix(n_fft: int = 1024, n_mels: int = 64) -> np.ndarray:
    mel = lambda f: 2595 * np.log10(1 + f / 700)  # noqa: E731
    edges = 700 * (10 ** (np.linspace(mel(50), mel(SR / 2), n_mels + 2) / 2595) - 1)
    freqs = np.fft.rfftfreq(n_fft, 1 / SR)
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    return np.maximum(0, np.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)))


def dtw_mel_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Mean log-mel distance (dB, RMS over bands) along the DTW path between two utterances."""
    fb = mel_matrix()
    ma, mb = (10 * np.log10(np.maximum((stft_mag(x) ** 2) @ fb.T, 1e-10)) for x in (a, b))
    ma, mb = ma[::2], mb[::2]  # 20 ms frames
    cost = np.sqrt(((ma[:, None, :] - mb[None, :, :]) ** 2).mean(-1))  # [A, B]
    acc = np.full((cost.shape[0] + 1, cost.shape[1] + 1), np.inf)
    steps = np.zeros_like(acc)
    acc[0, 0] = 0
    for i in range(1, acc.shape[0]):
        for j in range(1, acc.shape[1]):
            k = int(np.argmin((acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1])))
            prev = ((i - 1, j - 1), (i - 1, j), (i, j - 1))[k]
            acc[i, j] = cost[i - 1, j - 1] + acc[prev]
            steps[i, j] = steps[prev] + 1
    return float(acc[-1, -1] / steps[-1, -1])


def f0_track(x: np.ndarray, frame: int = 1024, hop: int = 240) -> np.ndarray:
    """Autocorrelation f0 per 10 ms frame, 60-400 Hz; NaN where unvoiced (normalized peak < 0.6)."""
    x = pcm16_to_float(x)
    frames = np.lib.stride_tricks.sliding_window_view(x, frame)[::hop]
    frames = (frames - frames.mean(1, keepdims=True)) * np.hanning(frame)
    spec = np.fft.rfft(frames, n=2 * frame, axis=1)
    ac = np.fft.irfft(np.abs(spec) ** 2, axis=1)[:, :frame]
    lo, hi = SR // 400, SR // 60
    lags = lo + np.argmax(ac[:, lo:hi], axis=1)
    rows = np.arange(len(lags))
    energy = frames.std(1)
    strength = ac[rows, lags] / np.maximum(ac[:, 0], 1e-12)
    y0, y1, y2 = ac[rows, lags - 1], ac[rows, lags], ac[rows, lags + 1]
    shift = 0.5 * (y0 - y2) / np.where(np.abs(y0 - 2 * y1 + y2) > 1e-12, y0 - 2 * y1 + y2, 1e-12)
    f0 = SR / (lags + np.clip(shift, -1, 1))
    voiced = (strength > 0.6) & (energy > 0.02 * energy.max())
    return np.where(voiced, f0, np.nan)


def f0_cents_error(inp: np.ndarray, out: np.ndarray, speed: float) -> tuple[float, float]:
    """(median |cents| frame by frame, share of output frames voiced where the input is)."""
    fi, fo = f0_track(inp), f0_track(out)
    src = np.minimum(np.round(np.arange(len(fo)) * speed).astype(int), len(fi) - 1)
    ref = fi[src]
    both = ~np.isnan(ref) & ~np.isnan(fo)
    cents = 1200 * np.abs(np.log2(fo[both] / ref[both]))
    return float(np.median(cents)), float(both.sum() / max((~np.isnan(ref)).sum(), 1))


def speech_end_s(x: np.ndarray) -> float:
    db = 10 * np.log10(np.maximum((stft_mag(x) ** 2).sum(1), 1e-12))
    return float(np.nonzero(db > db.max() - 35)[0][-1] * 240 / SR)


def flux_spikiness(x: np.ndarray) -> float:
    mag = np.log1p(stft_mag(x, 512, 120))
    flux = np.maximum(np.diff(mag, axis=0), 0).sum(1)
    return float(np.percentile(flux, 99) / max(np.median(flux), 1e-9))


def boundary_jump(out: np.ndarray, pcm: np.ndarray, speed: float) -> float:
    """Largest sample step where the input's chunks meet (mapped to output time), over the signal's own
    99.9th percentile step: above 1 = a click no ordinary sample step reaches."""
    edges = np.cumsum([c.size for c in chunked(pcm)])[:-1]
    at = np.clip(np.round(edges / speed).astype(int), 1, out.size - 1)
    steps = np.abs(np.diff(out.astype(np.int32)))
    return float(steps[at - 1].max() / np.percentile(steps, 99.9))


def measure(name, fn, pcm, speed, natives):
    start = time.process_time()
    out = fn(pcm, speed)
    cpu = time.process_time() - start
    back = fn(out, 1.0 / speed)
    cents, voiced = f0_cents_error(pcm, out, speed)
    return {
        "method": name, "speed": speed,
        "len_err": int(out.size - round(pcm.size / speed)),
        "end_err_ms": round(1000 * (speech_end_s(out) - speech_end_s(pcm) / speed), 1),
        "f0_cents": round(cents, 1), "voiced_kept": round(voiced, 2),
        "roundtrip_lsd_db": round(log_spec_distance(pcm, back), 2),
        "espeak_lsd_db": round(dtw_mel_distance(out, natives[speed]), 2),
        "flux_p99_ratio": round(flux_spikiness(out) / flux_spikiness(pcm), 2),
        "boundary_jump": round(boundary_jump(out, pcm, speed), 2),
        "cpu_ms_per_s": round(1000 * cpu / (pcm.size / SR), 1),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--json")
    args = parser.parse_args()
    pcm = espeak(args.text, ESPEAK_WPM)
    natives = {s: espeak(args.text, int(round(ESPEAK_WPM * s))) for s in SPEEDS}
    print(f"clip: {pcm.size / SR:.2f} s espeak-ng at {ESPEAK_WPM} wpm; f0 median "
          f"{np.nanmedian(f0_track(pcm)):.0f} Hz\n")
    cols = ["method", "speed", "len_err", "end_err_ms", "f0_cents", "voiced_kept", "roundtrip_lsd_db",
            "espeak_lsd_db", "flux_p99_ratio", "boundary_jump", "cpu_ms_per_s"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    rows = []
    for speed in SPEEDS:
        for name, fn in METHODS.items():
            row = measure(name, fn, pcm, speed, natives)
            rows.append(row)
            print("| " + " | ".join(str(row[c]) for c in cols) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
