"""Log-mel front end of the speaker encoder (the official `mel_spectrogram` as called by `extract_speaker_embedding`)."""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

# Hard-coded in the official `extract_speaker_embedding`, not read from any config.
SAMPLE_RATE = 24000
N_FFT = 1024
HOP_LENGTH = 256
WIN_LENGTH = 1024
N_MELS = 128
F_MIN = 0.0
F_MAX = 12000.0
PAD = (N_FFT - HOP_LENGTH) // 2  # 384 reflect-padded samples each side, with center=False
MIN_SAMPLES = PAD + 1  # reflect padding needs more input samples than it pads


def mel_basis() -> np.ndarray:  # [N_MELS, N_FFT // 2 + 1] float32
    """librosa.filters.mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000): slaney scale and norm."""
    from transformers.audio_utils import mel_filter_bank  # here, not at import: transformers takes seconds to load

    fb = mel_filter_bank(
        num_frequency_bins=N_FFT // 2 + 1, num_mel_filters=N_MELS, min_frequency=F_MIN, max_frequency=F_MAX,
        sampling_rate=SAMPLE_RATE, norm="slaney", mel_scale="slaney",
    )  # [513, 128] float64
    return np.ascontiguousarray(fb.T, dtype=np.float32)  # librosa builds float32 weights


@functools.lru_cache(maxsize=8)
def _basis_and_window(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    basis = torch.from_numpy(mel_basis()).to(device=device, dtype=dtype)  # [128, 513]
    # Built in float32 on the CPU and then moved, as the official code does (same values on every device).
    window = torch.hann_window(WIN_LENGTH).to(device=device, dtype=dtype)  # [1024], periodic
    return basis, window


def log_mel_spectrogram(wav: torch.Tensor) -> torch.Tensor:
    """wav [B, n] or [n] at 24 kHz (float32 or float64) -> log mel [B, T, 128], T = n // 256 + 1 (n > 384).

    Same op sequence as the official code, so CPU results match it bit for bit.
    """
    if wav.dim() == 1:
        wav = wav.unsqueeze(0)
    if not wav.is_floating_point() or wav.dtype in (torch.float16, torch.bfloat16):
        wav = wav.float()  # STFT needs float32/64; the official path feeds float32 numpy audio
    if wav.shape[-1] < MIN_SAMPLES:
        raise ValueError(f"audio too short for the speaker encoder: {wav.shape[-1]} samples < {MIN_SAMPLES}")
    basis, window = _basis_and_window(wav.device, wav.dtype)
    y = F.pad(wav.unsqueeze(1), (PAD, PAD), mode="reflect").squeeze(1)  # [B, n + 768]
    spec = torch.stft(
        y, N_FFT, hop_length=HOP_LENGTH, win_length=WIN_LENGTH, window=window, center=False,
        normalized=False, onesided=True, return_complex=True,
    )  # [B, 513, T]
    mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)  # [B, 513, T]
    mel = torch.matmul(basis, mag)  # [B, 128, T]
    return torch.log(torch.clamp(mel, min=1e-5)).transpose(1, 2)  # [B, T, 128]
