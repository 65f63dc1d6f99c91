"""AlignerGraphs: the aligner's two transformers replayed as CUDA graphs over bucketed shapes.

An eager forward of the aligner is ~1,700 kernel launches for a few milliseconds of GPU work, so on a host shared
with the Talker, Code2Wav and the ingress the launches set its time. Here the audio tower's layers (over its
attention blocks) and the text decoder (over the prompts; the head runs after it) each replay one CUDA graph of
their compiled kernels (`ForcedAligner.compile_kernels`) per bucket of shapes: blocks and prompts padded up to a
power of two in number, a block to a multiple of `BLOCK_STEP` tokens, a prompt to a multiple of `PROMPT_STEP`.
The server captures the buckets its forwards meet before it is ready (`warm`, `warm_shapes`); any other is
captured when first met. Shapes past the largest bucket run eagerly.

Padding changes no real position's result, only what is computed beside it: added prompts and added left positions
are masked keys (as a batch's own left padding is), added blocks attend to their first token only (a block with no
key would be NaN), added tokens of a block are masked keys, and their outputs are dropped. Without CUDA
(`capture=False`) the same padded shapes run eagerly: what the CPU tests compare with the plain forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from stages.aligner.audio_encoder import conv_output_frames
from stages.aligner.config import AlignerConfig
from stages.aligner.model import ForcedAligner
from stages.cuda_graph import capture_graph

MAX_ROWS = 64  # prompts per graph: the server's forwards are at most its max_batch_size (32)
PROMPT_STEP, MAX_PROMPT = 64, 1024  # a 6 s piece's prompt is ~100-250 positions; 400 s ones run eagerly
BLOCK_STEP = 8  # tokens; a block holds at most 104 (n_window_infer's worth)
MAX_BLOCKS = 256  # 8 s of audio per block: 32 pieces of 60 s
# `warm` captures the prompt buckets of up to this many positions per second of a forward's audio (13 audio tokens
# and a word's tokens and two timestamps per word), at least one piece of MAX_PROMPT; larger ones capture when met
WARM_POSITIONS_PER_AUDIO_S = 32


def _power_of_two(n: int, limit: int) -> int | None:
    size = 1
    while size < n:
        size *= 2
    return size if size <= limit else None


def _powers_of_two_down(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length() - 1, -1, -1)]


def _multiple(n: int, step: int, limit: int | None = None) -> int | None:
    size = -(-n // step) * step
    return size if limit is None or size <= limit else None


def warm_shapes(cfg: AlignerConfig, max_pieces: int, max_audio_s: float
                ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The buckets that forwards of up to `max_pieces` pieces and `max_audio_s` seconds of padded audio meet,
    largest first: the tower's (blocks, tokens) for every block count such audio makes and every block length
    (only full ones past `max_pieces` blocks: a piece of two blocks has a full one, and the longest sets the length),
    the text decoder's (prompts, positions) for every prompt count up to `max_pieces` and every length up to
    WARM_POSITIONS_PER_AUDIO_S per second of audio (at least one prompt of MAX_PROMPT)."""
    audio = cfg.audio
    block_tokens = (audio.n_window_infer // audio.chunk_frames) * conv_output_frames(audio.chunk_frames)
    block_s = audio.n_window_infer / 100  # mel frames are 10 ms
    blocks = _power_of_two(min(math.ceil(max_audio_s / block_s) + max_pieces, MAX_BLOCKS), MAX_BLOCKS)
    full = _multiple(block_tokens, BLOCK_STEP)
    one_block_each = _power_of_two(max_pieces, MAX_BLOCKS) or MAX_BLOCKS  # more blocks: some piece has a full one
    tower = [(n, length) for n in _powers_of_two_down(blocks)
             for length in (range(full, 0, -BLOCK_STEP) if n <= one_block_each else (full,))]
    positions = max(WARM_POSITIONS_PER_AUDIO_S * max_audio_s, MAX_PROMPT)
    text = [(rows, s) for rows in _powers_of_two_down(_power_of_two(min(max_pieces, MAX_ROWS), MAX_ROWS))
            for s in range(MAX_PROMPT, 0, -PROMPT_STEP) if rows * s <= positions]
    return tower, text


class BucketGraphs:
    """One function's CUDA graphs, one per shape of its inputs, captured on first use or by `capture` ahead
    (`capture=False`: the function runs eagerly). All graphs read their inputs from, and write their output to, the
    start of the same flat buffers (one per input, one for the output), so that a bucket costs a graph, not its own
    copies of the largest tensors; the returned tensor is that shared output: read it before the next `run`."""

    def __init__(self, fn: Callable[..., torch.Tensor], capture: bool, pool=None):
        self.fn, self.capture_on = fn, capture
        self.pool = pool
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], torch.Tensor]] = {}
        self._buffers: dict[int, torch.Tensor] = {}  # slot -> flat buffer (slot -1: the output)

    def run(self, *inputs: torch.Tensor) -> torch.Tensor:
        if not self.capture_on:
            return self.fn(*inputs)
        graph, statics, out = self.capture(*inputs)
        for static, t in zip(statics, inputs, strict=True):
            static.copy_(t)
        graph.replay()
        return out

    def capture(self, *inputs: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor], torch.Tensor]:
        """The graph of these inputs' shapes, captured now if it is new (the inputs' values only warm it up)."""
        key = tuple((tuple(t.shape), t.dtype) for t in inputs)
        entry = self.graphs.get(key)
        if entry is None:
            statics = [self._view(i, t.shape, t.dtype, t.device).copy_(t) for i, t in enumerate(inputs)]
            probe = self.fn(*statics)  # the output's shape and dtype (and the first warm-up run)
            out = self._view(-1, probe.shape, probe.dtype, probe.device)
            del probe
            graph, _ = capture_graph(lambda: out.copy_(self.fn(*statics)), self.pool,
                                     torch.cuda.Stream(statics[0].device), warmups=1)  # the probe was one
            entry = self.graphs[key] = (graph, statics, out)
        return entry

    def _view(self, slot: int, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The start of slot's flat buffer as a tensor of `shape` (a larger buffer replaces a smaller one; graphs
        captured over the old one keep it alive)."""
        numel = math.prod(shape)
        flat = self._buffers.get(slot)
        if flat is None or flat.dtype != dtype or flat.numel() < numel:
            flat = self._buffers[slot] = torch.zeros(numel, dtype=dtype, device=device)
        return flat[:numel].view(shape)


class AlignerGraphs:
    """`LayerRunners` (stages/aligner/model.py) replaying CUDA graphs over padded shapes."""

    def __init__(self, model: ForcedAligner, capture: bool):
        pool = torch.cuda.graph_pool_handle() if capture else None  # one pool: graphs never run at once
        self._model = model
        self._tower = BucketGraphs(model.audio_tower.run_layers, capture, pool)
        self._text = BucketGraphs(model.hidden_states, capture, pool)  # the head after: its output is 5x larger

    @property
    def captured(self) -> int:
        """Graphs captured so far (the buckets met)."""
        return len(self._tower.graphs) + len(self._text.graphs)

    def warm(self, max_pieces: int, max_audio_s: float) -> None:
        """Capture ahead the buckets of `warm_shapes` (a capture met in a request's path costs that request its
        warm-up runs and, for the first shapes, the compiles), largest first so that the shared buffers are
        allocated once."""
        if not self._tower.capture_on:
            return
        cfg = self._model.config
        device, dtype = self._model.lm_head.weight.device, self._model.lm_head.weight.dtype
        tower, text = warm_shapes(cfg, max_pieces, max_audio_s)
        for n, length in tower:
            mask = torch.zeros(n, 1, 1, length, dtype=torch.bool, device=device)
            mask[..., 0] = True
            self._tower.capture(torch.zeros(n, length, cfg.audio.d_model, dtype=dtype, device=device), mask)
        for rows, s in text:
            self._text.capture(torch.zeros(rows, s, cfg.text.hidden_size, dtype=dtype, device=device),
                               torch.ones(rows, s, dtype=torch.long, device=device))

    def tower_layers(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        n, length, d = x.shape
        n_pad, l_pad = _power_of_two(n, MAX_BLOCKS), _multiple(length, BLOCK_STEP)
        if n_pad is None:
            return self._model.audio_tower.run_layers(x, key_mask)
        padded = x.new_zeros(n_pad, l_pad, d)
        padded[:n, :length] = x
        mask = torch.zeros(n_pad, 1, 1, l_pad, dtype=torch.bool, device=x.device)
        mask[:n, ..., :length] = key_mask
        mask[n:, ..., 0] = True
        return self._tower.run(padded, mask)[:n, :length].clone()

    def decode(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        rows, s, hidden = x.shape
        rows_pad, s_pad = _power_of_two(rows, MAX_ROWS), _multiple(s, PROMPT_STEP, MAX_PROMPT)
        if rows_pad is None or s_pad is None:
            return self._model.decode(x, attention_mask)
        padded = x.new_zeros(rows_pad, s_pad, hidden)
        padded[:rows, s_pad - s:] = x
        mask = attention_mask.new_zeros(rows_pad, s_pad)
        mask[:rows, s_pad - s:] = attention_mask
        return self._model.lm_head(self._text.run(padded, mask)[:rows, s_pad - s:])
