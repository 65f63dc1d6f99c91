"""The talker engine's device side: per-row GPU state, paged KV, staged admission, the decode step, graphs.

All per-request state lives in preallocated tensors indexed by row (== slot): positions, frame counters,
sampling parameters, seeds, repetition-penalty masks, trailing text rows, last hidden state and
codebook-0 token. Running requests occupy rows [0, n); a decode step of batch bucket b computes rows
[0, b) (padding rows are free rows, whose KV table points at the scratch block) and writes one output
buffer [rows, 17] (16 codes of the frame + the next codebook-0 token) in two halves: the code predictor's
passes give the frame's codes, which cross to the host at once (the engine hands the frame out while the
talker half runs), then the talker step gives the next codebook-0 token. Each crossing is one non-blocking
copy into one of two pinned buffers, so the engine can launch step N+1 before it reads step N.

Admission never waits for the device: a batch's prompt ids, sampling parameters and KV block rows are
written into a pinned staging row per request and cross in ONE non-blocking copy; the prefill (embedding
of the prompt from ids, the prompt forward into the paged KV, the first codebook-0 token) runs from the
staged copy, as a CUDA graph per (batch, width) bucket where one fits. The first token reaches the host
with the request's first decode step. Releasing a request copies nothing of anyone's KV: the last row's
small state moves into the hole (`move_rows`) and its KV stays where it is (stages/talker/paged_kv.py).

Live text (docs/talker_engine.md): a request waiting for text leaves the rows; its small state is kept in a
park slot (`park_rows`/`unpark_row`, stages/talker/row_copies.py), and text arriving later is projected into its
trailing rows in one staged copy for all requests per loop iteration (`write_text`).
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from stages import gemv_kernels
from stages import pdl as pdl_module
from stages import sampling_kernel as sampling_kernel_module
from stages.contract import NUM_CODEBOOKS
from stages.dynamic_compile import compile_dynamic
from stages.layers import LayerKernels
from stages.qwen3_tts import Qwen3TTS
from stages.sampling import mask_talker_logits, select_tokens, suppressed_ids_mask
from stages.talker.compiled import EAGER_STEP_FUNCTIONS
from stages.talker.engine_config import TalkerEngineConfig
from stages.talker.frame import new_code_predictor_cache, predict_frame_codes
from stages.talker.paged_attention import contiguous_tiling, decode_tiling, kernel_available
from stages.talker.paged_kv import DecodeContext, PagedKVCache, PrefillContext
from stages.talker.prompt_plan import NONE, embed_rows, embed_text_rows
from stages.talker.row_copies import RowCopies
from stages.talker.staging import Admission, HostRing, IntStage, SlotParams, Staging, round_up, write_stage
from stages.talker.step_clock import StepClock
from stages.talker.step_copies import StepCopies

PREFILL_TRAILING_WIDTH = 256  # trailing text rows a graphed prefill projects (one fixed width: cheap, no transformer)
_WIDTH_MULTIPLE = 16  # eager prefill pads widths to this: fewer distinct shapes


class TalkerRunner:
    """Sole owner of the talker's device state. Not thread-safe: one engine thread calls it."""

    # prefill attention backends (None: torch's choice); not cuDNN, which plans each new shape (docs: "Prefill")
    prefill_sdpa_backends: tuple[SDPBackend, ...] | None = (
        SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)

    def __init__(self, model: Qwen3TTS, config: TalkerEngineConfig, num_blocks: int):
        """Rows for `config.max_num_seqs` requests, a paged KV pool of `num_blocks` blocks."""
        assert model.talker is not None
        self.model, self.talker = model, model.talker
        self.device, self.dtype = model.device, model.dtype
        cfg = self.talker.config
        tcfg = cfg.transformer
        dev = self.device
        k = config.kernels
        num_slots, max_seq_len, max_text_rows = config.max_num_seqs, config.max_seq_len, config.max_text_rows
        self.num_slots, self.max_seq_len, self.max_text_rows = num_slots, max_seq_len, max_text_rows
        self.cuda = dev.type == "cuda"
        compile = config.compile and self.cuda
        attention_kernel, length_buckets, block_size = k.attention_kernel, k.length_buckets, k.kv_block_size
        max_prefill_batch, prefill_batches = config.max_prefill_batch, config.prefill_batches
        self.use_kernel = kernel_available(dev) if attention_kernel is None else attention_kernel
        # the paged kernel reads each row's own length: one attention "bucket" suffices
        self.length_buckets = ((max_seq_len,) if self.use_kernel
                               else tuple(sorted({min(b, max_seq_len) for b in length_buckets} | {max_seq_len})))
        # one more row than requests can use: the scratch row, where padding rows of a graphed prefill write
        rows = num_slots + 1
        self.scratch_row = num_slots
        self._kv_shape = (tcfg.num_hidden_layers, block_size, tcfg.num_key_value_heads, tcfg.head_dim, rows)
        self.kv = self._new_kv(num_blocks)
        self.params = SlotParams.empty(rows, dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)  # next talker position
        self.frame_index = torch.zeros(rows, dtype=torch.long, device=dev)  # frames produced so far
        self.hidden = torch.zeros(rows, cfg.hidden_size, dtype=self.dtype, device=dev)
        self.c0 = torch.zeros(rows, dtype=torch.long, device=dev)
        self.seen = torch.zeros(rows, cfg.vocab_size, dtype=torch.bool, device=dev)
        self.trailing = torch.zeros(rows, max_text_rows, cfg.hidden_size, dtype=self.dtype, device=dev)
        self.trailing_len = torch.zeros(rows, dtype=torch.long, device=dev)
        self.tts_pad = torch.zeros(cfg.hidden_size, dtype=self.dtype, device=dev)
        self.copies = StepCopies(num_slots, dev, self.cuda)  # the step's output buffer and its copies to the host
        self.out = self.copies.out
        # the device's own clock around each step (CUDA): a slow step told from a late one (stages/talker/step_clock.py)
        self.step_clock = StepClock((lambda: torch.cuda.Event(enable_timing=True)) if self.cuda else None)
        self.cp_caches = {}  # batch bucket -> ContiguousKV (fixed addresses for graphs)
        self.suppress = suppressed_ids_mask(cfg.vocab_size, cfg.codebook_size, cfg.codec.eos, dev)
        self.eos = cfg.codec.eos
        # the decode step's two halves per (batch, length) bucket: the frame's codes, then the talker step
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]] = {}
        # admission staging: two pinned host buffers (alternating: one may still be in flight) and the device copy
        self.prefill_batch_buckets = tuple(b for b in sorted(prefill_batches) if b <= max_prefill_batch) or (1,)
        self.max_prefill_batch = max(max_prefill_batch, 1)
        self.max_prefill_tokens = config.max_prefill_tokens
        self.prefill_width_buckets = tuple(w for w in config.prefill_widths if w <= max_seq_len)  # sorted (the config's)
        self.trailing_width = min(PREFILL_TRAILING_WIDTH, max_text_rows)
        self.prefill_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        width = max(max_seq_len, max_text_rows)
        stage = (self.max_prefill_batch, width, max_text_rows, self.kv.blocks_per_seq, cfg.hidden_size)
        # two in turn: one admission per iteration never waits for a copy (a burst of 3+ may)
        self._host_stage = HostRing([Staging(*stage, device="cpu", pin=self.cuda) for _ in range(2)], self.cuda)
        self._stage = Staging(*stage, device=dev, pin=False)
        self._copies = RowCopies(num_slots, dev, self._row_tensors)  # row moves; parked requests' state by slot
        self._text_stage = IntStage(dev)
        self._init_tts_pad()
        for name, fn in EAGER_STEP_FUNCTIONS.items():
            setattr(self, name, fn)
        # compiled path only: forwards of <= gemv_rows rows run the layers as Triton GEMVs (stages/gemv_kernels.py)
        self.gemv_rows = k.gemv_rows if compile and gemv_kernels.available(dev) else 0
        # compiled path with the decode kernel: q/k head norm + RoPE inside it (HeadNorm), not kernels of their own
        self.heads_in_attention = k.heads_in_attention and compile and self.use_kernel
        # decode kernel: a few rows' keys split over more programs (paged_attention.decode_splits)
        self.attention_splits = k.attention_splits and self.use_kernel
        # deterministic: text rows projected in products of trailing_width rows (embed_text_rows), and one tiling
        # per decode attention kernel, the batched one (key blocks and warps set the softmax's summation order)
        self.text_width = self.trailing_width if config.deterministic else 0
        self.decode_tiling = decode_tiling(128) if config.deterministic else None
        self.contiguous_tiling = contiguous_tiling(128) if config.deterministic else None
        # compiled CUDA path, sm_90+: few-row steps' Triton kernels launch with programmatic dependent launch
        self.pdl = config.pdl and compile and pdl_module.supported(dev)
        if compile:
            self._enable_compile()
        self.sampling_kernel = k.sampling_kernel and sampling_kernel_module.available(dev)
        if self.sampling_kernel:  # one Triton program per row, no sort
            self._select = sampling_kernel_module.select_tokens
        self._select_pdl = (functools.partial(sampling_kernel_module.select_tokens, pdl=True)
                            if self.sampling_kernel and self.pdl else self._select)

    def _init_tts_pad(self) -> None:
        ids = self.model.config.text_ids
        with torch.no_grad():
            specials = self.talker.embed_text(torch.tensor([[ids.tts_bos, ids.tts_eos, ids.tts_pad]], device=self.device))
        self.tts_pad.copy_(specials[0, 2])  # as build_prefill groups it: exact

    def _enable_compile(self) -> None:
        """Fuse the elementwise work of every layer and of sampling with torch.compile.

        A decode step is ~16 sequential transformer passes of small kernels; at small batch the
        GPU waits on kernel boundaries, so fewer, fused kernels (replayed inside the CUDA graph)
        are what makes batch-1 latency approach the weight-bandwidth floor.
        """
        import torch._dynamo

        # shapes seen: talker/code predictor x prefill/decode x batch 1/many; each a compiled variant
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        kernels = LayerKernels.compiled(gemv_rows=self.gemv_rows, heads_in_attention=self.heads_in_attention,
                                        pdl=self.pdl)
        # also q/k/v and gate/up as one GEMM each (2 of 5 per layer: ~300 fewer kernels per frame) and RoPE from a
        # table; positions stay below max_seq_len (the talker) and 16 (the code predictor's frame)
        self.talker.model.use_kernels(kernels, self.max_seq_len)
        self.talker.code_predictor.model.use_kernels(kernels, NUM_CODEBOOKS)
        self.talker.stack_codec_embeddings()  # a frame's 16 codebook embeddings in one gather
        if self.gemv_rows:  # few-row passes look their projected input up instead of a lookup and a GEMV
            self.talker.code_predictor.project_codec_embeddings()
        for name, fn in EAGER_STEP_FUNCTIONS.items():
            setattr(self, name, compile_dynamic(fn))

    # ---------------------------------------------------------------- rows
    def _row_tensors(self) -> list[torch.Tensor]:
        return [self.positions, self.frame_index, self.hidden, self.c0, self.seen, self.trailing_len,
                self.kv.block_table, *self.params.tensors()]

    def move_rows(self, moves: list[tuple[int, int, int]]) -> None:
        """Requests continue in other rows, each (src, dst, trailing_len): their small state and first
        trailing_len text rows move, their KV stays in its blocks (stages/talker/row_copies.py). No host sync."""
        self._copies.move(self.trailing, moves)

    def _new_kv(self, num_blocks: int) -> PagedKVCache:
        layers, block_size, heads, head_dim, rows = self._kv_shape
        return PagedKVCache(layers, num_blocks, block_size, heads, head_dim, rows, self.max_seq_len, self.dtype,
                            self.device)

    def resize_kv(self, num_blocks: int) -> None:
        """A new KV pool of `num_blocks` blocks, before any request runs and before graph capture (the graphs
        read the pool in place); every row's table points at the new scratch block."""
        assert not self.graphs and not self.prefill_graphs, "graphs read the old pool"
        self.kv = None  # the old pool is freed before the new one is allocated
        self.kv = self._new_kv(num_blocks)

    def free_rows(self, start: int, stop: int) -> None:
        """Rows [start, stop) nobody runs in any more point at the scratch block: padding rows write nowhere."""
        self._copies.flush()
        if stop > start:
            self.kv.block_table[start:stop] = self.kv.scratch_block

    # ---------------------------------------------------------------- live text
    def park_rows(self, rows: list[int], slots: list[int]) -> None:
        """The requests in `rows` leave them: their small state goes to park slots `slots` (< num_slots; the engine
        passes the requests' tickets), all in one copy per row tensor. Their trailing text is not kept: a request
        parks when it has read all of it, and text arriving later is written to the row it resumes in
        (`write_text`)."""
        self._copies.park(rows, slots)

    def unpark_row(self, slot: int, row: int) -> None:
        """The request parked in `slot` continues in the free row `row`, where it stopped (copied with this
        iteration's other unparks before the next row operation or step)."""
        self._copies.unpark(slot, row)

    @torch.no_grad()
    def write_text(self, writes: list[tuple[int, int, np.ndarray]]) -> None:
        """Text rows that arrived while requests run: for each (row, start, ids), trailing rows start.. of `row`
        become P(ids), and its trailing length start + len(ids). One staged copy for all; no host sync."""
        self._copies.flush()
        k = sum(len(ids) for _, _, ids in writes)
        n = len(writes)
        # >= 2 rows: a one-row product takes another kernel (GEMV) whose rounding differs from the prefill's
        width = round_up(max(k, 2), _WIDTH_MULTIPLE)
        host = self._text_stage.host(3 * width + 2 * n)
        ids, rows, pos = host[:width], host[width:2 * width], host[2 * width:3 * width]
        ids[:], rows[:], pos[:] = NONE, self.scratch_row, 0  # padding entries write zeros into the scratch row
        at = 0
        for j, (row, start, text) in enumerate(writes):
            m = len(text)
            ids[at:at + m], rows[at:at + m], pos[at:at + m] = text, row, np.arange(start, start + m)
            host[3 * width + j], host[3 * width + n + j] = row, start + m
            at += m
        dev = self._text_stage.copy(3 * width + 2 * n)
        projected = embed_text_rows(self.talker, dev[None, :width], self.text_width)[0]
        self.trailing[dev[width:2 * width], dev[2 * width:3 * width]] = projected
        self.trailing_len[dev[3 * width:3 * width + n]] = dev[3 * width + n:]

    def attn_bucket(self, max_position: int) -> int:
        for b in self.length_buckets:
            if max_position < b:
                return b
        raise ValueError(f"position {max_position} exceeds max_seq_len {self.max_seq_len}")

    # ---------------------------------------------------------------- admission
    @torch.no_grad()
    def admit(self, batch: list[Admission]) -> None:
        """Prefill `batch` into their rows: stage on the host, one copy, graph (or eager) from the copy.

        Never waits for the device. The first codebook-0 token stays on the device for the next step.
        """
        n = len(batch)
        assert 0 < n <= self.max_prefill_batch
        self._copies.flush()
        exact = batch[0].exact is not None
        width = max(a.plan.length for a in batch)  # the transformer's width: prompt rows only
        trailing = max(a.plan.trailing_length for a in batch)
        key = None if exact or trailing > self.trailing_width else self._prefill_graph_key(n, width)
        if key is not None:
            (nb, w), tw = key, self.trailing_width
        else:
            # at least the smallest graphed batch (deterministic mode's is 2: no size-1 compiled variant)
            nb, w, tw = (max(n, self.prefill_batch_buckets[0]), round_up(width, _WIDTH_MULTIPLE),
                         min(round_up(trailing, _WIDTH_MULTIPLE), self.max_text_rows))
        turn = self._host_stage.take()
        host = self._host_stage.buffers[turn]
        write_stage(host, batch, nb, w, tw, self.scratch_row, self.kv.scratch_block)
        self.step_clock.prefill_begin()  # after the host's staging: a device idle while it stages counts as a wait
        self._stage.buf[:nb].copy_(host.buf[:nb], non_blocking=True)
        self._host_stage.copied(turn)
        if key is not None:
            self.prefill_graphs[key].replay()
        elif exact:
            x = torch.zeros(nb, w, self.hidden.shape[1], dtype=self.dtype, device=self.device)
            for i, a in enumerate(batch):
                x[i, :a.plan.length] = a.exact.prefill
                if not self.text_width:  # deterministic: from the staged ids, as live text's later rows
                    self.trailing[a.row, :a.plan.trailing_length] = a.exact.trailing[:a.plan.trailing_length]
            self._prefill_compute(nb, w, tw, x)
        else:
            self._prefill_compute(nb, w, tw)
        self.step_clock.prefill_end()

    def prefill_bucket(self, n: int, width: int) -> tuple[int, int] | None:
        """The (batch, width) a prefill of n prompts, the longest `width` positions, pads to; None: beyond them."""
        nb = next((b for b in self.prefill_batch_buckets if b >= n), None)
        w = next((b for b in self.prefill_width_buckets if b >= width), None)
        return None if nb is None or w is None else (nb, w)

    def prefill_fits(self, n: int, width: int) -> bool:
        """Whether one prefill may hold n prompts, the longest `width` positions: its padded positions (batch bucket x
        width bucket, or the eager path's padding beyond the widths) within `max_prefill_tokens`. One always fits."""
        if n <= 1:
            return True
        if n > self.max_prefill_batch:
            return False
        key = self.prefill_bucket(n, width)
        nb, w = key if key is not None else (max(n, self.prefill_batch_buckets[0]), round_up(width, _WIDTH_MULTIPLE))
        return nb * w <= self.max_prefill_tokens

    def prefill_keys(self) -> list[tuple[int, int]]:
        """The (batch, width) buckets a prefill graph is captured for: those within `max_prefill_tokens`, and the
        smallest batch at every width (a prompt alone always fits)."""
        least = self.prefill_batch_buckets[0]
        return [(b, w) for b in self.prefill_batch_buckets for w in self.prefill_width_buckets
                if b == least or b * w <= self.max_prefill_tokens]

    def _prefill_graph_key(self, n: int, width: int) -> tuple[int, int] | None:
        key = self.prefill_bucket(n, width)
        return key if key in self.prefill_graphs else None

    def _prefill_compute(self, nb: int, width: int, trailing_width: int, x: torch.Tensor | None = None) -> None:
        """Admit staged rows [0, nb): prompts of up to `width` rows, trailing text of up to `trailing_width`
        (x: exact embeddings, trailing already written; else both from the staged ids).

        Shape-static and sync-free (graph-capturable). With `compile`, the layers' compiled kernels: they are
        compiled for dynamic shapes, so every prompt width and batch (more than one row) shares one variant.
        Attention without cuDNN, which builds a plan per new shape.
        """
        s, dev, p = self._stage, self.device, self.params
        meta, fp = s["meta"][:nb], s["fparams"][:nb]
        rows, lengths, trailing_len = meta[:, 0], meta[:, 1], meta[:, 2]
        # per-row state and parameters
        p.seeds[rows] = meta[:, 3]
        p.min_frames[rows] = meta[:, 4]
        p.talker.top_k[rows] = meta[:, 5]
        p.sub.top_k[rows] = meta[:, 6]
        p.talker.do_sample[rows] = meta[:, 7] != 0
        p.sub.do_sample[rows] = meta[:, 8] != 0
        p.suppress_eos[rows] = meta[:, 9] != 0
        p.talker.temperature[rows] = fp[:, 0]
        p.talker.top_p[rows] = fp[:, 1]
        p.sub.temperature[rows] = fp[:, 2]
        p.sub.top_p[rows] = fp[:, 3]
        p.penalty[rows] = fp[:, 4]
        self.kv.block_table[rows] = s["blocks"][:nb]
        self.trailing_len[rows] = trailing_len
        tw, project_trailing = trailing_width, x is None or self.text_width  # deterministic: exact path too
        if x is None:
            x = embed_rows(self.talker, s["text"][:nb, :width], s["codec"][:nb, :width],
                           s["frames"][:nb, :width].clamp(min=0), s["frames"][:nb, :width, 0] >= 0,
                           s["x_vector"][:nb], meta[:, 10])
        if project_trailing:
            ids = s["trailing"][:nb, :tw]
            self.trailing[:, :tw].index_copy_(0, rows, embed_text_rows(self.talker, ids, self.text_width))
        positions = torch.arange(width, device=dev).expand(nb, width)
        scratch = self.kv.scratch_block * self.kv.block_size
        write_index = torch.where(positions < lengths[:, None], self.kv.token_index(rows, positions), scratch)
        backends = self.prefill_sdpa_backends
        with sdpa_kernel(list(backends)) if backends else contextlib.nullcontext():
            hidden = self.talker.forward_hidden(x, positions, PrefillContext(self.kv, write_index))
        last = lengths - 1
        h = hidden[torch.arange(nb, device=dev), last]
        self.hidden[rows] = h
        self.positions[rows] = last + 1
        self.frame_index.index_fill_(0, rows, 0)  # not `[rows] = 0`: that copies a host scalar (no graphs)
        self.seen.index_fill_(0, rows, False)
        q = p.index(rows)
        frames = self.frame_index[rows]
        logits = mask_talker_logits(
            self.talker.codec_logits(h).float(), self.seen[rows], q.penalty, frames, q.min_frames, self.suppress,
            self.eos, q.suppress_eos,
        )
        self.c0[rows] = select_tokens(logits, q.talker, q.seeds, frames * NUM_CODEBOOKS)

    # ---------------------------------------------------------------- decode
    def _decode_step(self, b: int, attn_len: int) -> None:
        """One frame for rows [0, b): its codes, then the talker step that gives the next c0 (eagerly, both halves)."""
        self._frame_codes_step(b)
        self._talker_step(b, attn_len)

    def _frame_codes_step(self, b: int) -> None:
        """The step's first half: the code predictor's 15 passes, this frame's 16 codes into `out[:b, :16]`."""
        p = self.params.rows(b)
        frame_index = self.frame_index[:b]
        select = self._select_pdl if self.pdl_at(b) else self._select
        codes = predict_frame_codes(self.talker, self.hidden[:b], self.c0[:b], self.cp_cache(b), p.sub, p.seeds,
                                    frame_index, select, counters=frame_index * NUM_CODEBOOKS)
        self.out[:b, :NUM_CODEBOOKS] = codes

    def _talker_step(self, b: int, attn_len: int) -> None:
        """The step's second half, from the codes in `out[:b, :16]`: next talker input, talker step, next c0."""
        p = self.params.rows(b)
        frame_index = self.frame_index[:b]
        c0 = self.c0[:b]
        select = self._select_pdl if self.pdl_at(b) else self._select
        counters = frame_index * NUM_CODEBOOKS  # this frame's draws; the next c0's are counters + 16
        x = self._step_talker_input(self.talker, self.out[:b, :NUM_CODEBOOKS], frame_index, self.trailing[:b],
                                    self.trailing_len[:b], self.tts_pad)
        positions = self.positions[:b]
        ctx = DecodeContext(self.kv, positions, attn_len, self.use_kernel, split_keys=self.attention_splits,
                            pdl=self.pdl_at(b), tiling=self.decode_tiling)
        hidden = self.talker.forward_hidden(x, positions[:, None], ctx)[:, -1]
        self.hidden[:b] = hidden
        self._advance_rows(positions, frame_index, self.seen[:b], c0, self.max_seq_len - 1)
        logits = self._mask(self.talker.codec_logits_fp32(hidden), self.seen[:b], p.penalty,
                            frame_index, p.min_frames, self.suppress, self.eos, p.suppress_eos)
        next_c0 = select(logits, p.talker, p.seeds, counters, NUM_CODEBOOKS)  # (frame_index + 1) * 16
        self._record_step(self.out[:b], c0, next_c0)

    def cp_cache(self, b: int):
        cache = self.cp_caches.get(b) or new_code_predictor_cache(self.talker, b, self.pdl_at(b), self.contiguous_tiling)
        return self.cp_caches.setdefault(b, cache)

    def pdl_at(self, b: int) -> bool:
        """Whether a decode step of b rows launches its Triton kernels with PDL (`pdl` on): only the launch-bound
        GEMV steps (b <= gemv_rows); larger ones measured slower with it (docs/benchmarks.md, "Programmatic...")."""
        return self.pdl and b <= self.gemv_rows

    @torch.no_grad()
    def launch_step(self, b: int, attn_len: int) -> int:
        """Enqueue one step for rows [0, b) (b a batch bucket) and the copies of its two halves to the host (the
        frame's codes, then the whole output: stages/talker/step_copies.py); returns a ticket for `step_codes` and
        `step_output`. Does not wait: the host can prepare the next step meanwhile."""
        self._copies.flush()
        turn = self.copies.next_turn()
        self.step_clock.begin()
        halves = self.graphs.get((b, attn_len))
        if halves is not None:
            halves[0].replay()
        else:
            self._frame_codes_step(b)
        self.copies.copy("codes", turn, b)
        self.copies.record("codes", turn)
        if halves is not None:
            halves[1].replay()
        else:
            self._talker_step(b, attn_len)
        self.copies.copy("step", turn, b)
        self.step_clock.end()
        self.copies.record("step", turn)
        return turn

    def step_codes(self, turn: int, n: int) -> np.ndarray:
        """Rows [0, n) of a launched step's frame codes [n, 16], once its first half (the code predictor) is done."""
        return self.copies.read("codes", turn, n)

    def step_output(self, turn: int, n: int) -> np.ndarray:
        """Rows [0, n) of a launched step's output [n, 17] (the frame's 16 codes and the next frame's c0), once the
        device has produced it."""
        out = self.copies.read("step", turn, n)
        self.step_clock.read()  # steps are read in launch order
        return out
