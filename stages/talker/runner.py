"""The talker engine's device side: slot-indexed GPU state, batched prefill, the decode step, graphs.

All per-request state lives in preallocated tensors indexed by slot (positions, frame counters,
sampling parameters, seeds, repetition-penalty masks, trailing text rows, last hidden state and
codebook-0 token), so nothing per request can be evicted mid-stream and a decode step allocates
nothing. A decode step for batch bucket b runs slots [0, b) and writes its results into one
output buffer [slots, 17] (16 codes of the frame + the next codebook-0 token); the host reads that
with a single copy.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from stages.contract import SamplingParams
from stages.layers import LayerKernels
from stages.model import Qwen3TTS
from stages.reference import suppressed_ids_mask
from stages.sampling import SamplingTensors, mask_talker_logits, select_tokens
from stages.talker.frame import CODEBOOKS, new_code_predictor_cache, next_talker_input, predict_frame_codes
from stages.talker.kv_slots import DecodeContext, PrefillContext, SlotKVCache
from stages.talker.prefill import PrefillEmbeds

_TOP_K_OFF = 1 << 30
_PREFILL_WIDTH_MULTIPLE = 16  # eager prefill pads prompt widths to this: fewer distinct shapes
_PREFILL_WIDTH_BUCKETS = (16, 32, 64, 128)  # graphed prefill widths (CustomVoice/VoiceDesign prompts fit)
_PREFILL_BATCH_BUCKETS = (1, 2, 4, 8, 16)  # up to the engine's default max_prefill_batch; larger run eagerly


@dataclass
class SlotParams:
    """Sampling parameters of every slot, [slots]-shaped device tensors."""

    talker: SamplingTensors
    sub: SamplingTensors
    penalty: torch.Tensor
    min_frames: torch.Tensor
    suppress_eos: torch.Tensor
    seeds: torch.Tensor

    @classmethod
    def empty(cls, n: int, device: torch.device) -> SlotParams:
        def sampling() -> SamplingTensors:
            return SamplingTensors(torch.zeros(n, dtype=torch.bool, device=device),
                                   torch.ones(n, device=device), torch.full((n,), _TOP_K_OFF, device=device),
                                   torch.ones(n, device=device))

        return cls(sampling(), sampling(), torch.ones(n, device=device),
                   torch.zeros(n, dtype=torch.long, device=device), torch.zeros(n, dtype=torch.bool, device=device),
                   torch.zeros(n, dtype=torch.long, device=device))

    def tensors(self) -> list[torch.Tensor]:
        t, s = self.talker, self.sub
        return [t.do_sample, t.temperature, t.top_k, t.top_p, s.do_sample, s.temperature, s.top_k, s.top_p,
                self.penalty, self.min_frames, self.suppress_eos, self.seeds]

    def rows(self, b: int) -> SlotParams:
        t, s = self.talker, self.sub
        return SlotParams(
            SamplingTensors(t.do_sample[:b], t.temperature[:b], t.top_k[:b], t.top_p[:b]),
            SamplingTensors(s.do_sample[:b], s.temperature[:b], s.top_k[:b], s.top_p[:b]),
            self.penalty[:b], self.min_frames[:b], self.suppress_eos[:b], self.seeds[:b],
        )

    def set_range(self, start: int, params: list[SamplingParams], seeds: list[int]) -> None:
        """Slots [start, start+n) take these requests' parameters: one host->device copy per tensor."""
        columns = zip(*([p.do_sample, p.temperature, p.top_k or _TOP_K_OFF, p.top_p, p.subtalker_do_sample,
                         p.subtalker_temperature, p.subtalker_top_k or _TOP_K_OFF, p.subtalker_top_p,
                         p.repetition_penalty, p.min_frames, p.suppress_eos, seed]
                        for p, seed in zip(params, seeds, strict=True)), strict=True)
        for tensor, column in zip(self.tensors(), columns, strict=True):
            tensor[start:start + len(params)] = torch.tensor(column, dtype=tensor.dtype)


class TalkerRunner:
    """Sole owner of the talker's device state. Not thread-safe: one engine thread calls it."""

    # Attention backends for prefill (None: torch's choice). Not cuDNN: it builds a plan per new shape,
    # and prompts bring new (batch, width) shapes all the time (bench/prefill.py measures both).
    prefill_sdpa_backends: tuple[SDPBackend, ...] | None = (
        SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)

    def __init__(self, model: Qwen3TTS, num_slots: int, max_seq_len: int, max_text_rows: int,
                 length_buckets: tuple[int, ...], compile: bool = False):
        assert model.talker is not None
        self.model, self.talker = model, model.talker
        self.device, self.dtype = model.device, model.dtype
        cfg = self.talker.config
        tcfg = cfg.transformer
        self.num_slots, self.max_seq_len, self.max_text_rows = num_slots, max_seq_len, max_text_rows
        self.length_buckets = tuple(sorted({min(b, max_seq_len) for b in length_buckets} | {max_seq_len}))
        dev = self.device
        # one more slot than requests can use: the scratch slot, where padding rows of a graphed prefill write
        rows = num_slots + 1
        self.scratch_slot = num_slots
        self.kv = SlotKVCache(tcfg.num_hidden_layers, rows, tcfg.num_key_value_heads, max_seq_len,
                              tcfg.head_dim, self.dtype, dev)
        self.params = SlotParams.empty(rows, dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)  # next talker position
        self.frame_index = torch.zeros(rows, dtype=torch.long, device=dev)  # frames produced so far
        self.hidden = torch.zeros(rows, cfg.hidden_size, dtype=self.dtype, device=dev)
        self.c0 = torch.zeros(rows, dtype=torch.long, device=dev)
        self.seen = torch.zeros(rows, cfg.vocab_size, dtype=torch.bool, device=dev)
        self.trailing = torch.zeros(rows, max_text_rows, cfg.hidden_size, dtype=self.dtype, device=dev)
        self.trailing_len = torch.zeros(rows, dtype=torch.long, device=dev)
        self.tts_pad = torch.zeros(cfg.hidden_size, dtype=self.dtype, device=dev)
        self.out = torch.zeros(num_slots, CODEBOOKS + 1, dtype=torch.long, device=dev)
        self.out_host = torch.zeros(num_slots, CODEBOOKS + 1, dtype=torch.long,
                                    pin_memory=dev.type == "cuda")
        self.cp_caches = {}  # batch bucket -> ContiguousKV (fixed addresses for graphs)
        self.suppress = suppressed_ids_mask(cfg.vocab_size, cfg.codebook_size, cfg.codec.eos, dev)
        self.eos = cfg.codec.eos
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # prefill inputs at fixed addresses (graphs per (batch bucket, width bucket)); wider prompts run eagerly
        self.prefill_width_buckets = tuple(w for w in _PREFILL_WIDTH_BUCKETS if w <= max_seq_len)
        self.prefill_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        most = _PREFILL_BATCH_BUCKETS[-1]
        self._pf_x = torch.zeros(most, max(self.prefill_width_buckets, default=0), cfg.hidden_size,
                                 dtype=self.dtype, device=dev)
        self._pf_len = torch.ones(most, dtype=torch.long, device=dev)
        self._pf_slots = torch.full((most,), self.scratch_slot, dtype=torch.long, device=dev)
        self._select, self._mask = select_tokens, mask_talker_logits
        if compile:
            self._enable_compile()

    def _enable_compile(self) -> None:
        """Fuse the elementwise work of every layer and of sampling with torch.compile.

        A decode step is ~16 sequential transformer passes of small kernels; at small batch the
        GPU waits on kernel boundaries, so fewer, fused kernels (replayed inside the CUDA graph)
        are what makes batch-1 latency approach the weight-bandwidth floor.
        """
        import torch._dynamo

        # shapes seen: talker/code predictor x prefill/decode x batch 1/many; each a compiled variant
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        kernels = LayerKernels.compiled()
        self.talker.model.kernels = kernels
        self.talker.code_predictor.model.kernels = kernels
        self._select = torch.compile(select_tokens, dynamic=True, fullgraph=True)
        self._mask = torch.compile(mask_talker_logits, dynamic=True, fullgraph=True)

    # ---------------------------------------------------------------- per-slot bookkeeping
    def _slot_tensors(self) -> list[torch.Tensor]:
        return [self.positions, self.frame_index, self.hidden, self.c0, self.seen, self.trailing,
                self.trailing_len, *self.params.tensors()]

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Compaction: the request in `src` continues in `dst` (a freed slot below it)."""
        for t in self._slot_tensors():
            t[dst] = t[src]
        self.kv.move(src, dst, length)

    def attn_bucket(self, max_position: int) -> int:
        for b in self.length_buckets:
            if max_position < b:
                return b
        raise ValueError(f"position {max_position} exceeds max_seq_len {self.max_seq_len}")

    # ---------------------------------------------------------------- prefill
    @torch.no_grad()
    def prefill(self, start: int, embeds: list[PrefillEmbeds], params: list[SamplingParams],
                seeds: list[int]) -> None:
        """Admit len(embeds) requests into slots [start, start+n): batched prompt forward, first c0.

        A CUDA graph runs it when one fits (batch and width buckets); padding rows write the scratch slot.
        """
        n = len(embeds)
        dev = self.device
        lengths = [e.prefill.shape[0] for e in embeds]
        for i, e in enumerate(embeds):  # per-request state the prefill's sampling reads
            self.trailing[start + i, :e.trailing.shape[0]] = e.trailing
        self.params.set_range(start, params, seeds)
        self.tts_pad.copy_(embeds[0].tts_pad)
        key = self._prefill_graph_key(n, max(lengths))
        if key is None:  # eager, at the batch's own size
            nb = n
            width = min(-(-max(lengths) // _PREFILL_WIDTH_MULTIPLE) * _PREFILL_WIDTH_MULTIPLE, self.max_seq_len)
            x = torch.zeros(n, width, self.hidden.shape[1], dtype=self.dtype, device=dev)
        else:
            nb, width = key
            x = self._pf_x[:nb, :width]
        for i, e in enumerate(embeds):
            x[i, :lengths[i]] = e.prefill
        meta = torch.tensor([lengths + [1] * (nb - n), list(range(start, start + n)) + [self.scratch_slot] * (nb - n)],
                            dtype=torch.long)
        self.trailing_len[start:start + n] = torch.tensor([e.trailing.shape[0] for e in embeds])
        if key is None:
            lens, slots = meta.to(dev)
            self._prefill_compute(x, lens, slots)
        else:
            self._pf_len[:nb].copy_(meta[0], non_blocking=True)
            self._pf_slots[:nb].copy_(meta[1], non_blocking=True)
            self.prefill_graphs[key].replay()

    def _prefill_graph_key(self, n: int, width: int) -> tuple[int, int] | None:
        nb = next((b for b in _PREFILL_BATCH_BUCKETS if b >= n), None)
        w = next((b for b in self.prefill_width_buckets if b >= width), None)
        return (nb, w) if (nb, w) in self.prefill_graphs else None

    def _prefill_compute(self, x: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor) -> None:
        """Prompts x [nb, W, H] (right-padded; lengths [nb]) into `slots` [nb]: KV, state, first c0.

        Shape-static and sync-free (graph-capturable). Eager kernels: prompt shapes vary per admission and
        compiled ones recompiled there. Attention without cuDNN, which builds a plan per new shape.
        """
        nb, width = x.shape[:2]
        dev = self.device
        positions = torch.arange(width, device=dev).expand(nb, width)
        backends = self.prefill_sdpa_backends
        with sdpa_kernel(list(backends)) if backends else contextlib.nullcontext():
            hidden = self.talker.forward_hidden(x, positions, PrefillContext(self.kv, slots), eager=True)
        last = lengths - 1
        h = hidden[torch.arange(nb, device=dev), last]
        self.hidden[slots] = h
        self.positions[slots] = last + 1
        self.frame_index.index_fill_(0, slots, 0)  # not `[slots] = 0`: that copies a host scalar (no graphs)
        self.seen.index_fill_(0, slots, False)
        p = self.params
        frames = self.frame_index[slots]
        logits = mask_talker_logits(
            self.talker.codec_logits(h).float(), self.seen[slots], p.penalty[slots], frames,
            p.min_frames[slots], self.suppress, self.eos, p.suppress_eos[slots],
        )
        talker_params = SamplingTensors(p.talker.do_sample[slots], p.talker.temperature[slots],
                                        p.talker.top_k[slots], p.talker.top_p[slots])
        self.c0[slots] = select_tokens(logits, talker_params, p.seeds[slots], frames * CODEBOOKS)

    def first_tokens(self, start: int, n: int) -> list[int]:
        """Codebook-0 tokens sampled at prefill (host sync; once per admission, not per step)."""
        return self.c0[start:start + n].tolist()

    # ---------------------------------------------------------------- decode
    def _decode_step(self, b: int, attn_len: int) -> None:
        """One frame for slots [0, b): code predictor, next talker input, talker step, next c0."""
        p = self.params.rows(b)
        frame_index = self.frame_index[:b]
        c0 = self.c0[:b]
        codes = predict_frame_codes(self.talker, self.hidden[:b], c0, self.cp_cache(b), p.sub, p.seeds, frame_index,
                                    self._select)
        self.seen[:b].scatter_(1, c0[:, None], True)
        has_text = frame_index < self.trailing_len[:b]
        text_idx = torch.minimum(frame_index, (self.trailing_len[:b] - 1).clamp(min=0))
        text_rows = self.trailing[torch.arange(b, device=self.device), text_idx]
        text_rows = torch.where(has_text[:, None], text_rows, self.tts_pad[None, :])
        x = next_talker_input(self.talker, codes, text_rows)
        positions = self.positions[:b]
        hidden = self.talker.forward_hidden(x, positions[:, None], DecodeContext(self.kv, positions, attn_len))[:, -1]
        self.hidden[:b] = hidden
        # padding rows (free slots) also advance; saturating keeps their writes inside the slot
        self.positions[:b] = (self.positions[:b] + 1).clamp_(max=self.max_seq_len - 1)
        self.frame_index[:b] += 1
        logits = self._mask(self.talker.codec_logits(hidden).float(), self.seen[:b], p.penalty,
                            self.frame_index[:b], p.min_frames, self.suppress, self.eos, p.suppress_eos)
        next_c0 = self._select(logits, p.talker, p.seeds, self.frame_index[:b] * CODEBOOKS)
        self.c0[:b] = next_c0
        self.out[:b, :CODEBOOKS] = codes
        self.out[:b, CODEBOOKS] = next_c0

    def cp_cache(self, b: int):
        if b not in self.cp_caches:
            self.cp_caches[b] = new_code_predictor_cache(self.talker, b)
        return self.cp_caches[b]

    @torch.no_grad()
    def decode(self, b: int, attn_len: int) -> torch.Tensor:
        """Run one step for slots [0, b) (b a batch bucket) and return the host copy of `out[:b]`.

        Rows past the real batch are padding: they compute garbage in free slots, never read.
        """
        graph = self.graphs.get((b, attn_len))
        if graph is not None:
            graph.replay()
        else:
            self._decode_step(b, attn_len)
        host = self.out_host[:b]
        host.copy_(self.out[:b], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return host

    # ---------------------------------------------------------------- CUDA graphs
    @torch.no_grad()
    def capture_graphs(self, batch_buckets: tuple[int, ...], log: Callable[[str], None] = print) -> float:
        """Capture the decode step for every (batch bucket, length bucket). Returns seconds taken.

        Capture runs on scratch state: slot contents are saved and restored around it.
        """
        if self.device.type != "cuda":
            return 0.0
        t0 = time.perf_counter()
        saved = [t.clone() for t in self._slot_tensors()]
        pool = torch.cuda.graph_pool_handle()
        keys = [(b, L) for b in sorted(batch_buckets, reverse=True) for L in self.length_buckets]
        stream = torch.cuda.Stream(self.device)
        for i, (b, attn_len) in enumerate(keys):
            self.positions[:b] = 0
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up kernels/allocator outside the capture
                    self._decode_step(b, attn_len)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._decode_step(b, attn_len)
            self.graphs[(b, attn_len)] = graph
            if (i + 1) % max(1, len(keys) // 10) == 0 or i + 1 == len(keys):
                log(f"[talker] captured {i + 1}/{len(keys)} decode graphs ({time.perf_counter() - t0:.1f} s)")
        self._pf_slots.fill_(self.scratch_slot)  # capture runs touch the scratch slot only
        prefill_keys = [(b, w) for b in _PREFILL_BATCH_BUCKETS for w in self.prefill_width_buckets]
        for b, w in prefill_keys:
            args = (self._pf_x[:b, :w], self._pf_len[:b], self._pf_slots[:b])
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._prefill_compute(*args)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._prefill_compute(*args)
            self.prefill_graphs[(b, w)] = graph
        log(f"[talker] captured {len(prefill_keys)} prefill graphs ({time.perf_counter() - t0:.1f} s)")
        for t, s in zip(self._slot_tensors(), saved, strict=True):
            t.copy_(s)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0
