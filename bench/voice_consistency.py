"""Voice consistency across the pieces of a long input: speaker similarity between pieces, with the model's own
speaker encoder (stages/voice/speaker_encoder.py, the ECAPA-TDNN of a Base checkpoint).

A long input is requested whole (WAV) from a running server; its audio is cut back into pieces at the pauses the
ingress puts between them (runs of exact digital silence, `--min-pause-s`; generated speech is never exactly 0
for that long), each piece is embedded, and the cosine similarity of every pair of pieces is reported (JSON):
`pieces`, `similarity_min`, `similarity_mean`, and per piece its similarity to the mean of the others.

    python -m bench.voice_consistency --url http://127.0.0.1:8000 --encoder Qwen/Qwen3-TTS-12Hz-1.7B-Base \
        --model qwen3-tts --voice ryan --out consistency.json

Every piece is generated with the same voice conditioning (the same speaker id, instruction or clone prompt: the
ingress computes a request's voice prompt once), so with real weights the pairs should score like two clips of
one speaker (ECAPA cosine well above different-speaker pairs; compare a piece against another speaker's clip with
`--voice`). On random weights the numbers only show the mechanism works.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

from bench.long_form import chapter

SAMPLE_RATE = 24000


def split_at_pauses(pcm: np.ndarray, min_pause_s: float, min_piece_s: float = 0.2) -> list[np.ndarray]:
    """`pcm` (int16) cut at runs of exact zeros of at least `min_pause_s`; pieces shorter than `min_piece_s` dropped."""
    silent = np.concatenate([[False], pcm == 0, [False]])
    edges = np.flatnonzero(np.diff(silent.astype(np.int8)))
    starts, ends = edges[::2], edges[1::2]  # runs of zeros: [start, end)
    min_run = round(min_pause_s * SAMPLE_RATE)
    pieces, at = [], 0
    for s, e in zip(starts, ends, strict=False):  # a run still open at the end has no end edge
        if e - s >= min_run:
            pieces.append(pcm[at:s])
            at = e
    pieces.append(pcm[at:])
    return [p for p in pieces if p.size >= min_piece_s * SAMPLE_RATE]


def similarities(pieces: list[np.ndarray], encoder) -> dict:
    """Cosine similarity of the speaker embeddings of every pair of pieces (`encoder.embed`: float32 at 24 kHz)."""
    import torch

    embeddings = torch.stack([encoder.embed(torch.from_numpy(p.astype(np.float32) / 32768.0)).float()
                              for p in pieces])
    unit = torch.nn.functional.normalize(embeddings, dim=1)
    matrix = (unit @ unit.T).numpy()
    n = len(pieces)
    pairs = [float(matrix[i, j]) for i in range(n) for j in range(i + 1, n)]
    to_rest = [float(torch.nn.functional.cosine_similarity(embeddings[i], torch.cat([embeddings[:i], embeddings[i + 1:]])
                                                           .mean(0), dim=0)) for i in range(n)] if n > 1 else []
    return {"pieces": n, "similarity_min": round(min(pairs), 4) if pairs else None,
            "similarity_mean": round(float(np.mean(pairs)), 4) if pairs else None,
            "similarity_to_rest": [round(x, 4) for x in to_rest]}


def speaker_encoder(checkpoint: str):
    """The speaker encoder of a Base checkpoint (a path or a Hugging Face id), on the CPU in float32."""
    from stages.qwen3_tts import Qwen3TTS

    return Qwen3TTS.load(checkpoint, "cpu", "float32", talker=False, decoder=False, voice=True).speaker_encoder


def request_audio(url: str, text: str, fields: dict) -> np.ndarray:
    body = {"input": text, "response_format": "wav", "stream": False, **fields}
    r = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=3600)
    r.raise_for_status()
    audio, _ = sf.read(io.BytesIO(r.content), dtype="int16")
    return audio


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--encoder", required=True, help="a Base checkpoint (path or Hugging Face id): its speaker encoder")
    p.add_argument("--chars", type=int, default=3000)
    p.add_argument("--model")
    p.add_argument("--voice", default="vivian")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, help="frames per piece at most (random weights)")
    p.add_argument("--suppress-eos", action="store_true")
    p.add_argument("--min-pause-s", type=float, default=0.2, help="shortest pause between pieces (ingress.long_form)")
    p.add_argument("--out")
    a = p.parse_args()
    fields = {"voice": a.voice, "seed": a.seed}
    for key, value in (("model", a.model), ("max_new_tokens", a.max_new_tokens)):
        if value is not None:
            fields[key] = value
    if a.suppress_eos:
        fields["suppress_eos"] = True
    audio = request_audio(a.url.rstrip("/"), chapter(a.chars), fields)
    report = similarities(split_at_pauses(audio, a.min_pause_s), speaker_encoder(a.encoder))
    print(json.dumps(report))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
