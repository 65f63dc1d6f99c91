"""The forced aligner's entry point: waveforms + their texts -> words with start/end times, batched.

    aligner = Aligner.load(checkpoint_dir, device="cuda", dtype="bfloat16")
    words = aligner.align([wav_a, wav_b], ["Hello world.", "你好，世界"], sample_rate=24000)

`align` is `prepare_piece` per pair (CPU: resampling, normalizing, tokenizing; thread-safe, so a server runs it as
calls arrive, beside the device's forwards) and then `align_prepared` on the batch (log-mel, forward, timestamps).

Same results as the official `Qwen3ForcedAligner.align` on the same batch (tests/stages/test_aligner_parity.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from stages import jit_compiles
from stages.aligner.audio_encoder import conv_output_frames
from stages.aligner.config import (
    AUDIO_END_TOKEN,
    AUDIO_PAD_TOKEN,
    AUDIO_START_TOKEN,
    PAD_TOKEN,
    TIMESTAMP_TOKEN,
)
from stages.aligner.features import SAMPLE_RATE, log_mel_batch, normalize_waveform
from stages.aligner.graphs import AlignerGraphs
from stages.aligner.loader import load_forced_aligner, prompt_token_ids
from stages.aligner.model import ForcedAligner
from stages.aligner.timestamps import Word, words_from_classes
from stages.aligner.words import split_words
from stages.checkpoint import parse_dtype
from stages.voice.audio import resample

MIN_SAMPLES = 400  # one STFT window: the Whisper front end needs at least n_fft samples


@dataclass
class AlignerBatch:
    """One forward's inputs: left-padded prompts and their audio features."""

    words: list[list[str]]
    input_ids: torch.Tensor  # [B, S]
    attention_mask: torch.Tensor  # [B, S]
    features: torch.Tensor  # [B, mel, T]
    frames: list[int]


@dataclass(frozen=True)
class PreparedPiece:
    """One waveform and its text, ready for a batched forward."""

    waveform: np.ndarray  # float32 at 16 kHz, normalized as the official processor does
    words: list[str]
    text_ids: list[int]  # the prompt after the audio: each word's ids and its two timestamp slots

    @property
    def seconds(self) -> float:
        return self.waveform.shape[0] / SAMPLE_RATE


class Aligner:
    def __init__(self, model: ForcedAligner, tokenizer: Tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.device = model.lm_head.weight.device
        self.ids = prompt_token_ids(tokenizer, self.config)
        # the head's classes cover this much audio; a longer waveform could not be timed past it
        self.max_seconds = self.config.classify_num * self.config.timestamp_segment_time / 1000.0
        self.runners: AlignerGraphs | None = None  # eager unless `load` sets graphs
        # (waveforms, frames) of the spectrograms computed so far: on CUDA a new one is a new cuFFT plan
        self.spectrogram_shapes: set[tuple[int, int]] = set()
        jit_compiles.install()  # `one_time_work` counts the kernels compiled from here on

    @classmethod
    def load(cls, checkpoint: str | Path, device: torch.device | str = "cpu", dtype: str | torch.dtype = "float32",
             graphs: bool | None = None) -> Aligner:
        """`graphs`: both transformers replay CUDA graphs of their compiled kernels over padded shapes
        (`ForcedAligner.compile_kernels`, stages/aligner/graphs.py); by default on CUDA, where an eager forward's
        launches cost more than its GPU work. True on a CPU runs the same padded shapes eagerly, uncompiled
        (tests)."""
        aligner = cls(*load_forced_aligner(checkpoint, device, parse_dtype(dtype)))
        if aligner.device.type == "cuda" if graphs is None else graphs:
            capture = aligner.device.type == "cuda"
            if capture:
                aligner.model.compile_kernels()
            aligner.runners = AlignerGraphs(aligner.model, capture=capture)
        return aligner

    def warm_up(self, max_pieces: int, max_audio_s: float) -> int:
        """Pay the one-time costs before serving: a first forward (mel filters, kernels) and, with graphs, the
        compiles and the captures of the buckets that forwards of up to `max_pieces` pieces and `max_audio_s`
        seconds of padded audio meet. -> graphs captured so far.

        The first forwards are one piece and then (bounds allowing) three of unequal lengths: a batch of several
        rows lays its tensors out differently in the eager front end than one row does, and a kernel built or
        chosen for a layout the first time it is met (the spectrogram's power was a run-time compiled complex abs,
        seconds in a request's wait) is then met here."""
        self.align([np.zeros(SAMPLE_RATE, np.float32)], ["warm up"], SAMPLE_RATE)
        lengths = [s for s in (1.0, 2.5, 6.0) if s <= self.max_seconds][:max_pieces]
        if len(lengths) > 1 and len(lengths) * max(lengths) <= max_audio_s:  # a forward the server may make
            rng = np.random.default_rng(0)
            self.align([(rng.standard_normal(int(s * SAMPLE_RATE)) * 0.1).astype(np.float32) for s in lengths],
                       ["warm up"] * len(lengths), SAMPLE_RATE)
        if self.runners is not None:
            self.runners.warm(max_pieces, max_audio_s)
        return self.graphs_captured()

    def graphs_captured(self) -> int:
        """CUDA graphs captured so far (0 without graphs)."""
        return 0 if self.runners is None else self.runners.captured

    def one_time_work(self) -> dict[str, int]:
        """CUDA graphs captured, functions torch.compile traced (Dynamo's count, process-wide), Triton kernels
        JIT-compiled (process-wide, stages/jit_compiles.py), the (windows, frames) shapes the audio tower's
        eager convolutions met and the spectrogram shapes (cuFFT plans on CUDA), so far."""
        from torch._dynamo.utils import counters

        return {"graphs": self.graphs_captured(), "traces": int(counters["stats"]["unique_graphs"]),
                "kernels": jit_compiles.compiled(), "conv_shapes": len(self.model.audio_tower.conv_shapes),
                "spectrogram_shapes": len(self.spectrogram_shapes)}

    def min_samples(self, sample_rate: int = SAMPLE_RATE) -> int:
        """The fewest samples at `sample_rate` that `align` takes: MIN_SAMPLES once resampled to 16 kHz (resampling
        makes ceil(n * 16000 / sample_rate) samples)."""
        return (MIN_SAMPLES - 1) * sample_rate // SAMPLE_RATE + 1

    def align(self, audios: list[np.ndarray], texts: list[str], sample_rate: int = SAMPLE_RATE,
              languages: list[str] | None = None) -> list[list[Word]]:
        """Mono float waveforms at `sample_rate` and their transcripts -> per pair the transcript's words (as
        `stages.aligner.words.split_words` cuts them) with times in seconds from the waveform's start."""
        return self.align_prepared(self._prepare_all(audios, texts, sample_rate, languages))

    def prepare_piece(self, audio: np.ndarray, text: str, sample_rate: int = SAMPLE_RATE, language: str = ""
                      ) -> PreparedPiece:
        """One pair's host-side work (no device, thread-safe). Raises ValueError for a waveform it refuses."""
        words = split_words(text, language)
        ts = self.ids[TIMESTAMP_TOKEN]
        text_ids: list[int] = []
        for encoding in self.tokenizer.encode_batch(words, add_special_tokens=False) if words else []:
            text_ids += [*encoding.ids, ts, ts]  # special tokens split the text: each word is tokenized alone
        if not words:
            text_ids = [ts, ts]
        return PreparedPiece(self._waveform(audio, sample_rate), words, text_ids)

    def align_prepared(self, pieces: list[PreparedPiece]) -> list[list[Word]]:
        """One batched forward of prepared pieces -> per piece its words with times."""
        batch = self.batch(pieces)
        return self.words(batch, self.logits(batch).argmax(dim=-1))

    def prepare(self, audios: list[np.ndarray], texts: list[str], sample_rate: int = SAMPLE_RATE,
                languages: list[str] | None = None) -> AlignerBatch:
        return self.batch(self._prepare_all(audios, texts, sample_rate, languages))

    def batch(self, pieces: list[PreparedPiece]) -> AlignerBatch:
        """Prepared pieces -> one forward's inputs on the device: log-mel of the waveforms padded to the longest,
        left-padded prompts `<|audio_start|><|audio_pad|>*n<|audio_end|>w1<timestamp><timestamp>w2...`."""
        if not pieces:
            raise ValueError("nothing to align: the batch is empty")
        features, frames = log_mel_batch([p.waveform for p in pieces], self.config.audio.num_mel_bins, self.device)
        self.spectrogram_shapes.add((features.shape[0], features.shape[-1]))
        start, pad, end = self.ids[AUDIO_START_TOKEN], self.ids[AUDIO_PAD_TOKEN], self.ids[AUDIO_END_TOKEN]
        rows = [[start, *[pad] * conv_output_frames(n), end, *p.text_ids] for p, n in zip(pieces, frames, strict=True)]
        longest = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), longest), self.ids[PAD_TOKEN], dtype=torch.long)
        attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):  # left padding, as the official processor pads
            input_ids[i, longest - len(row):] = torch.tensor(row)
            attention_mask[i, longest - len(row):] = 1
        return AlignerBatch([p.words for p in pieces], input_ids.to(self.device), attention_mask.to(self.device),
                            features, frames)

    def _prepare_all(self, audios: list[np.ndarray], texts: list[str], sample_rate: int,
                     languages: list[str] | None) -> list[PreparedPiece]:
        if len(audios) != len(texts) or (languages is not None and len(languages) != len(texts)):
            raise ValueError(f"batch size mismatch: {len(audios)} waveforms, {len(texts)} texts"
                             + (f", {len(languages)} languages" if languages is not None else ""))
        if not audios:
            raise ValueError("nothing to align: the batch is empty")
        return [self.prepare_piece(a, t, sample_rate, (languages or [""] * len(texts))[i])
                for i, (a, t) in enumerate(zip(audios, texts, strict=True))]

    def logits(self, batch: AlignerBatch) -> torch.Tensor:
        return self.model(batch.input_ids, batch.attention_mask, batch.features, batch.frames, self.runners)

    def words(self, batch: AlignerBatch, classes: torch.Tensor) -> list[list[Word]]:
        slots = batch.input_ids == self.ids[TIMESTAMP_TOKEN]
        classes, slots = classes.cpu(), slots.cpu()
        return [words_from_classes(w, classes[i][slots[i]].tolist(), self.config.timestamp_segment_time)
                for i, w in enumerate(batch.words)]

    def _waveform(self, audio: np.ndarray, sample_rate: int) -> np.ndarray:
        audio = np.asarray(audio)
        if audio.ndim != 1 or audio.dtype.kind != "f":
            raise ValueError(f"a waveform must be 1-D floats, got shape {audio.shape} of {audio.dtype}")
        if not np.isfinite(audio).all():
            raise ValueError("a waveform contains NaN or infinite samples")
        seconds = audio.shape[0] / sample_rate
        if seconds > self.max_seconds:
            raise ValueError(f"a waveform is {seconds:.1f} s long; the aligner times at most {self.max_seconds:g} s")
        wav = normalize_waveform(resample(audio.astype(np.float32), sample_rate, SAMPLE_RATE))
        if wav.shape[0] < MIN_SAMPLES:
            raise ValueError(f"a waveform is too short to align: {wav.shape[0]} samples at 16 kHz < {MIN_SAMPLES}")
        return wav
