"""AlignerGraphs: the aligner's two transformers replayed as CUDA graphs over bucketed shapes.

An eager forward of the aligner is ~1,700 kernel launches for a few milliseconds of GPU work, so on a host shared
with the Talker, Code2Wav and the ingress the launches set its time. Here the audio tower's layers (over its
attention blocks) and the text decoder (over the prompts; the head runs after it) each replay one CUDA graph per
bucket of shapes, captured the first time the bucket is met: blocks and prompts padded up to a power of two in number, a
block to a multiple of `BLOCK_STEP` tokens, a prompt to a multiple of `PROMPT_STEP`. Shapes past the largest
bucket run eagerly.

Padding changes no real position's result, only what is computed beside it: added prompts and added left positions
are masked keys (as a batch's own left padding is), added blocks attend to their first token only (a block with no
key would be NaN), added tokens of a block are masked keys, and their outputs are dropped. Without CUDA
(`capture=False`) the same padded shapes run eagerly: what the CPU tests compare with the plain forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stages.aligner.model import ForcedAligner
from stages.cuda_graph import capture_graph

MAX_ROWS = 64  # prompts per graph: the server's forwards are at most its max_batch_size (32)
PROMPT_STEP, MAX_PROMPT = 64, 1024  # a 6 s piece's prompt is ~100-250 positions; 400 s ones run eagerly
BLOCK_STEP = 8  # tokens; a block holds at most 104 (n_window_infer's worth)
MAX_BLOCKS = 256  # 8 s of audio per block: 32 pieces of 60 s


def _power_of_two(n: int, limit: int) -> int | None:
    size = 1
    while size < n:
        size *= 2
    return size if size <= limit else None


def _multiple(n: int, step: int, limit: int | None = None) -> int | None:
    size = -(-n // step) * step
    return size if limit is None or size <= limit else None


class BucketGraphs:
    """One function's CUDA graphs, one per shape of its inputs, captured on first use (`capture=False`: the
    function runs eagerly). The returned tensor is the graph's own output: read it before the next `run`."""

    def __init__(self, fn: Callable[..., torch.Tensor], capture: bool, pool=None):
        self.fn, self.capture = fn, capture
        self.pool = pool
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], torch.Tensor]] = {}

    def run(self, *inputs: torch.Tensor) -> torch.Tensor:
        if not self.capture:
            return self.fn(*inputs)
        key = tuple((tuple(t.shape), t.dtype) for t in inputs)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._captured(inputs)
        graph, statics, out = entry
        for static, t in zip(statics, inputs, strict=True):
            static.copy_(t)
        graph.replay()
        return out

    def _captured(self, inputs: tuple[torch.Tensor, ...]):
        statics = [t.clone() for t in inputs]
        graph, out = capture_graph(lambda: self.fn(*statics), self.pool, torch.cuda.Stream(statics[0].device))
        return graph, statics, out


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
