"""The aligner's log-mel front end: the official processor's `WhisperFeatureExtractor` (128 bins, 16 kHz, hop 160,
n_fft 400, no dither), batched exactly as the official `Qwen3ForcedAligner.align` batches it.

The official processor pads every waveform of a batch with zeros to the longest one and computes the spectrogram of
the padded batch, so a waveform's features depend slightly on its batch: its last frames see zeros where, alone,
they would see the reflected signal; the -8 dB floor is taken over the padded row; and its frame count is
ceil(n / 160) in a batch with a longer waveform, n // 160 alone. Reproduced here as is.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160


@functools.lru_cache(maxsize=4)
def mel_filters(num_mel_bins: int) -> np.ndarray:  # [n_fft // 2 + 1, num_mel_bins] float64
    from transformers.audio_utils import mel_filter_bank  # here, not at import: transformers takes seconds to load

    return mel_filter_bank(
        num_frequency_bins=1 + N_FFT // 2, num_mel_filters=num_mel_bins, min_frequency=0.0, max_frequency=8000.0,
        sampling_rate=SAMPLE_RATE, norm="slaney", mel_scale="slaney",
    )


def log_mel_batch(waveforms: list[np.ndarray], num_mel_bins: int = 128, device: torch.device | str = "cpu"
                  ) -> tuple[torch.Tensor, list[int]]:
    """Mono float32 16 kHz waveforms -> (features [B, num_mel_bins, T] float32 on `device`, valid frames per row).

    T = N // 160 for the longest waveform's N samples; row i's valid frames are min(ceil(n_i / 160), T).
    """
    longest = max(w.shape[0] for w in waveforms)
    padded = np.zeros((len(waveforms), longest), dtype=np.float32)
    for i, w in enumerate(waveforms):
        padded[i, : w.shape[0]] = w
    frames = longest // HOP_LENGTH
    valid = [min(-(-w.shape[0] // HOP_LENGTH), frames) for w in waveforms]
    wav = torch.from_numpy(padded).to(device)
    window = torch.hann_window(N_FFT, device=device)
    stft = torch.stft(wav, N_FFT, HOP_LENGTH, window=window, return_complex=True)
    # |z|^2 as re^2 + im^2 on real views, not `abs() ** 2`: CUDA builds of PyTorch compute a complex abs with a
    # kernel compiled at run time (NVRTC, its "jiterator") for each new launch variant, seconds in a request's wait
    parts = torch.view_as_real(stft[..., :-1])
    magnitudes = parts[..., 0] ** 2 + parts[..., 1] ** 2
    filters = torch.from_numpy(mel_filters(num_mel_bins)).to(device, torch.float32)
    log_spec = torch.clamp(filters.T @ magnitudes, min=1e-10).log10()
    floor = log_spec.max(dim=2, keepdim=True)[0].max(dim=1, keepdim=True)[0] - 8.0
    return (torch.maximum(log_spec, floor) + 4.0) / 4.0, valid


def normalize_waveform(audio: np.ndarray) -> np.ndarray:
    """The official `float_range_normalize`: float32, divided by its peak when that exceeds 1, clipped to [-1, 1]."""
    audio = np.asarray(audio, dtype=np.float32)
    if audio.size == 0:
        return audio
    peak = float(np.max(np.abs(audio)))
    if peak == 0.0:
        return audio
    if peak > 1.0:
        audio = audio / peak
    return np.clip(audio, -1.0, 1.0)
