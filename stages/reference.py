"""The reference generator: one request, eager, simple. Ground truth for the fast engines.

prompt -> prefill -> [sample c0 -> code predictor (c1..c15) -> next input] per frame -> codes
-> full decode -> waveform. Uses the same modules and per-frame functions as the engine.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from stages.contract import NUM_CODEBOOKS, SamplingParams, TalkerPrompt
from stages.qwen3_tts import Qwen3TTS
from stages.sampling import SamplingRows, mask_talker_logits, select_tokens, suppressed_ids_mask
from stages.talker.contiguous_kv import ContiguousKV
from stages.talker.frame import new_code_predictor_cache, next_talker_input, predict_frame_codes
from stages.talker.prefill import build_prefill


class ReferenceGenerator:
    def __init__(self, model: Qwen3TTS):
        if model.talker is None:
            raise ValueError("the reference generator needs a model loaded with its talker")
        self.model = model
        self.talker = model.talker
        cfg = model.config.talker
        self.eos = cfg.codec.eos
        self.suppress = suppressed_ids_mask(cfg.vocab_size, cfg.codebook_size, self.eos, model.device)

    @torch.no_grad()
    def stream_codes(
        self, prompt: TalkerPrompt, sampling: SamplingParams, max_frames: int, seed: int = 0
    ) -> Iterator[np.ndarray]:
        """Yield frames (codes [16] int64) until EOS or `max_frames`."""
        talker, device = self.talker, self.model.device
        params = SamplingRows.from_params([sampling], device)
        emb = build_prefill(talker, self.model.config, prompt)
        length = emb.prefill.shape[0]
        tcfg = talker.config.transformer
        kv = ContiguousKV(tcfg.num_hidden_layers, 1, tcfg.num_key_value_heads, tcfg.head_dim,
                          length + max_frames + 1, dtype=emb.prefill.dtype, device=device)
        cp_kv = new_code_predictor_cache(talker, 1)
        seeds = torch.tensor([seed], dtype=torch.long, device=device)
        seen = torch.zeros(1, talker.config.vocab_size, dtype=torch.bool, device=device)

        kv.begin(length)
        hidden = talker.forward_hidden(emb.prefill[None], torch.arange(length, device=device)[None], kv)[:, -1]
        kv.advance()
        for frame in range(max_frames + 1):
            index = torch.tensor([frame], dtype=torch.long, device=device)
            logits = mask_talker_logits(
                talker.codec_logits(hidden).float(), seen, params.penalty, index, params.min_frames,
                self.suppress, self.eos, params.suppress_eos,
            )
            c0 = select_tokens(logits, params.talker, seeds, index * NUM_CODEBOOKS)
            if int(c0) == self.eos or frame == max_frames:
                return
            seen[0, c0] = True
            codes = predict_frame_codes(talker, hidden, c0, cp_kv, params.sub, seeds, index)
            yield codes[0].cpu().numpy()
            text_row = emb.trailing[frame] if frame < emb.trailing.shape[0] else emb.tts_pad
            x = next_talker_input(talker, codes, text_row[None])
            kv.begin(1)
            hidden = talker.forward_hidden(x, torch.tensor([[length + frame]], device=device), kv)[:, -1]
            kv.advance()

    def generate_codes(
        self, prompt: TalkerPrompt, sampling: SamplingParams, max_frames: int, seed: int = 0
    ) -> np.ndarray:
        """-> codes [T, 16] int64."""
        frames = list(self.stream_codes(prompt, sampling, max_frames, seed))
        return np.stack(frames) if frames else np.zeros((0, NUM_CODEBOOKS), dtype=np.int64)

    @torch.no_grad()
    def decode(self, codes: np.ndarray, ref_codes: np.ndarray | None = None) -> np.ndarray:
        """Full decode of codes [T, 16] -> float32 waveform [T * 1920] at 24 kHz.

        Base ICL: the reference codes are decoded as left context and their samples cut, as the
        official decode does.
        """
        decoder = self.model.decoder
        if decoder is None:
            raise ValueError("the model was loaded without its codec decoder")
        context = 0 if ref_codes is None else int(ref_codes.shape[0])
        full = codes if ref_codes is None else np.concatenate([ref_codes, codes], axis=0)
        if full.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        x = torch.as_tensor(full, dtype=torch.long, device=self.model.device).T[None]  # [1, 16, T]
        wav = decoder(x)[0, 0].float().cpu().numpy()
        return wav[context * decoder.samples_per_frame:]
