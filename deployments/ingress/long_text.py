"""A long input planned as several Talker requests: its pieces (deployments/ingress/text_split.py), each piece's
engine request with the request's voice, instructions and sampling, its seed, and the pause after it.

A piece is sized from the model's limits (`ModelInfo`), with margin: its text must fit the Talker's text positions,
and its prompt plus the speech its text is estimated to need, times `1 / piece_fill`, must fit `max_seq_len`. The
estimate is deliberately slow speech (a character of a space-separated script or a digit 1 frame, i.e. 12.5 chars/s;
a CJK character 3 frames, ~4 per second), so a piece ends by EOS well before its frame cap. Pure (no Ray, no I/O).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass

from deployments.config import LongFormSettings, TTSServingArgs
from deployments.ingress.request_builder import VoiceChoice, build_request
from deployments.ingress.schemas import SpeechRequest
from deployments.ingress.text_split import Boundary, Cost, TextPiece, split_text
from deployments.messages import GenerateOptions, ModelInfo
from stages.contract import Priority, SynthesisRequest, VoiceClonePrompt
from stages.talker.layout import EXTRA_POSITIONS, prefill_length, trailing_length

# speech a character is assumed to take, in 80 ms frames (slow speech: the margin against a cut piece)
FRAMES_PER_CHAR = 1.0
FRAMES_PER_SLOW_CHAR = 3.0  # CJK characters (a syllable each) and digits (a number is read as several words)
_SLOW = re.compile(r"[0-9\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class PlannedPiece:
    """One Talker request of a long input, and the silence the client hears after its audio."""

    index: int
    request: SynthesisRequest
    options: GenerateOptions
    pause_s: float  # 0 after the last piece
    client_capped: bool  # its frame cap is the client's (see `client_capped`): stopping there is no cut
    text: str = ""  # what it speaks (word timestamps align it with its audio)


def estimated_frames(text: str) -> float:
    slow = len(_SLOW.findall(text))
    return FRAMES_PER_SLOW_CHAR * slow + FRAMES_PER_CHAR * (len(text) - slow)


def client_capped(body: SpeechRequest, request: SynthesisRequest, info: ModelInfo) -> bool:
    """Whether a request's frame cap is the client's: its `max_new_tokens` (or that field's default,
    `default_max_new_tokens`) or `suppress_eos`; not when the cap is what fits `max_seq_len` (or the server's
    `max_new_tokens_limit`). A request stopped at a cap that is not the client's was cut."""
    return body.suppress_eos or body.max_new_tokens is not None or request.max_frames >= info.default_max_new_tokens


def piece_seed(seed: int | None, index: int) -> int | None:
    """Piece `index`'s seed, derived from the request's: the first piece has the request's own, so a text that
    fits one piece sounds as it did; None (no seed) lets the engine draw each piece's."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & MAX_SEED


def piece_cost(info: ModelInfo, sample: SynthesisRequest, fill: float, tokens_per_byte: float,
               frame_cap: int | None = None) -> Callable[[str], Cost]:
    """A piece's share of one Talker request, from the request built for a one-token text (`sample`): (positions
    of `max_seq_len` its text and its speech / `fill` take, its speech / `fill` over the server's `frame_cap`
    (`max_new_tokens_limit`), text positions of `max_text_rows` it takes)."""
    prompt = sample.prompt
    one_token = dataclasses.replace(prompt, text_ids=prompt.text_ids[:1])
    base = prefill_length(one_token)
    text_in_prefill = prefill_length(dataclasses.replace(prompt, text_ids=prompt.text_ids[:1] * 2)) > base
    text_in_trailing = trailing_length(dataclasses.replace(prompt, text_ids=prompt.text_ids[:1] * 2)) > \
        trailing_length(one_token)
    positions = max(info.max_seq_len - base - EXTRA_POSITIONS, 1)
    text_rows = max(info.max_text_rows - trailing_length(one_token), 1)

    def cost(text: str) -> Cost:
        tokens = len(text.encode("utf-8", "surrogatepass")) * tokens_per_byte
        frames = estimated_frames(text)
        speech = frames / fill + (tokens if text_in_prefill else 0.0)
        capped = frames / fill / frame_cap if frame_cap else 0.0
        return speech / positions, capped, (tokens / text_rows if text_in_trailing else 0.0)

    return cost


class PiecePlanner:
    """Whether a request's input needs several pieces (`fits_one`: cheap, no tokenizing of the whole input), and
    its pieces (`pieces`: tokenizes and splits it, for a thread: a 100,000-character input takes a fraction of a
    second). Every piece is a built engine request, so every 4xx is raised before the first piece runs."""

    def __init__(self, body: SpeechRequest, info: ModelInfo, choice: VoiceChoice, voice: VoiceClonePrompt | None,
                 args: TTSServingArgs, request_id: str, priority: Priority = Priority.REALTIME,
                 max_piece_frames: int | None = None):
        """`max_piece_frames`: a bound of a piece's speech besides the server's `max_new_tokens_limit` (the longest
        audio the aligner times, for a request with timestamps)."""
        self.body, self.info, self.choice, self.voice, self.args = body, info, choice, voice, args
        self.request_id, self.priority = request_id, priority
        caps = [f for f in (args.ingress.max_new_tokens_limit, max_piece_frames) if f]
        self._frame_cap = min(caps) if caps else None
        self.settings = args.ingress.long_form
        # the request built for a one-token text: its prompt's layout sizes the pieces
        self._sample, _ = build_request(body.model_copy(update={"input": "x", "max_new_tokens": None}), info, choice,
                                        voice, args, request_id, priority=priority)

    def fits_one(self) -> bool:
        """True when the input fits one piece even counting a token per byte (the most a byte-level BPE makes)."""
        cost = piece_cost(self.info, self._sample, self.settings.piece_fill, 1.0, self._frame_cap)
        return all(c <= 1.0 for c in cost(self.body.input))

    def pieces(self) -> list[PlannedPiece] | None:
        """The input's pieces; None when it fits one piece after all (it runs as one request)."""
        body = self.body
        text_bytes = max(len(body.input.encode("utf-8", "surrogatepass")), 1)
        tokens_per_byte = min(len(self.info.tokenizer.encode(body.input)) / text_bytes, 1.0)
        cost = piece_cost(self.info, self._sample, self.settings.piece_fill, tokens_per_byte, self._frame_cap)
        texts = split_text(body.input, cost) if not all(c <= 1.0 for c in cost(body.input)) else []
        if len(texts) < 2:
            return None
        pieces = []
        for k, text in enumerate(texts):
            piece_body = body.model_copy(update={"input": text.text, "seed": piece_seed(body.seed, k)})
            request, options = build_request(piece_body, self.info, self.choice, self.voice, self.args,
                                             f"{self.request_id}.{k}", priority=self.priority)
            last = k == len(texts) - 1
            pieces.append(PlannedPiece(k, request, options, 0.0 if last else pause_after(text, self.settings),
                                       client_capped(piece_body, request, self.info), text.text))
        return pieces


def pause_after(piece: TextPiece, settings: LongFormSettings) -> float:
    """The silence a boundary implies: a paragraph's, a sentence's, none within a sentence (the model ends each
    piece with its own breath)."""
    if piece.boundary is Boundary.PARAGRAPH:
        return settings.paragraph_pause_s
    if piece.boundary is Boundary.SENTENCE:
        return settings.sentence_pause_s
    return 0.0
