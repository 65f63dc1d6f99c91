"""TalkerEngineConfig: the talker engine's sizes, buckets and switches, torch-free so that the application builder
validates `engine_kwargs` without importing torch (Serve builds the app in a fresh worker on `serve run`'s path)."""

from __future__ import annotations

from dataclasses import dataclass

from stages.chunking import ChunkSchedule

# graphed prefill widths (prompt positions; a batch pads to the first width that holds its longest prompt). The
# loadgen's CustomVoice prompts are 40-76 positions, so a batch of 16 nearly always held one above 64 and padded
# every prompt to 128 before widths 80 and 96 came (docs/benchmarks.md, "Prefill widths")
PREFILL_WIDTHS = (16, 32, 64, 80, 96, 128)
# graphed prefill batch sizes, those <= max_prefill_batch (16 by default: served on the H100, 32 and 64 before they
# had graphs were slower everywhere, docs/benchmarks.md); a prefill of n requests pads to the first size >= n
PREFILL_BATCHES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class TalkerEngineConfig:
    max_num_seqs: int = 64  # requests running at once (batch rows)
    max_seq_len: int = 2048  # prompt + frames of one request at most (KV positions)
    kv_cache_tokens: int | None = None  # KV pool in tokens (all requests); None: from kv_cache_memory_fraction
    kv_cache_memory_fraction: float = 0.5  # of free device memory after weights (CUDA only)
    kv_block_size: int = 16  # KV positions per block (the unit a request reserves)
    max_text_rows: int = 1024  # trailing text rows per request (longest streaming-text input)
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512)
    length_buckets: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096)  # gather-attention path only
    max_prefill_batch: int = 16  # requests in one batched prefill (one admission)
    prefill_widths: tuple[int, ...] = PREFILL_WIDTHS  # a CUDA graph per (batch bucket, width); longer prompts: eager
    prefill_batches: tuple[int, ...] = PREFILL_BATCHES  # the batch buckets of those graphs (<= max_prefill_batch)
    max_prefills_per_step: int = 8  # admissions one loop iteration may launch before its step: more than one only
    # while every running stream's handed-out audio is ahead of its playback by admission_lead_s (a burst of
    # arrivals is prefilled at once instead of one batch per step; docs/talker_engine.md, "Admission"). H100,
    # both engines in one process, 1 -> 8: c=256 957.8 -> 1,036.2 audio-s/s, first audio p95 375 -> 246 ms
    admission_lead_s: float = 0.3
    prefill_hold_s: float = 0.0  # under load, an admission of fewer than max_prefill_batch requests waits up to
    # this long for more, while at least one more arrival is expected within the hold (stages/arrival_rate.py)
    # and something runs (until 2026-11-28 also only while every playing stream had admission_lead_s of audio
    # ahead, which at 256-512 streams per GPU never held; not measured since): a served closed loop's staggered streams
    # came back to be prefilled a few at a time (H100, c=64: the engine thread's prefill launches ~0.65 ms per
    # request against 0.17 in process), each prefill a turn on the GPU between two steps. Measured served at 15 ms
    # (H100): c=64 482 -> 465 audio-s/s, the held rows cost more than the shared prefills save (docs/talker_engine.md
    # "Arrivals that trickle in"). 0: never
    max_waiting: int = 4096  # queued requests at most; more are refused (overload)
    cuda_graphs: bool = True
    compile: bool = True  # torch.compile the per-layer math and sampling (CUDA only)
    exact_prefill: bool | None = None  # reference prompt embeddings (bit-exact, slow); None: on CPU only
    attention_kernel: bool | None = None  # paged Triton decode attention; None: where available (CUDA)
    gemv_rows: int = 4  # compiled CUDA path: forwards of <= this many rows (<= 8) run each layer as 4 Triton GEMVs
    # with their norms, SwiGLU and residuals fused (stages/gemv_kernels.py); 0: cuBLAS throughout. H100: batch 1
    # 6.18 -> 4.99 ms per step (docs/benchmarks.md, "Few-row GEMVs on by default")
    pdl: bool = False  # compiled CUDA path, H100+: in steps of <= gemv_rows rows the Triton kernels (GEMVs, decode
    # attention and its merge, token selection) launch with programmatic dependent launch (stages/pdl.py): each
    # starts while the kernel before it ends. For a Talker with its GPU alone (configs/split.yaml): H100 batch 1
    # 4.89 -> 4.09 ms per step with this session's other cuts. Off by default: its kernels then hold the SMs
    # without a gap, and a Code2Wav on the same GPU decoded first chunks in ~8.5 ms instead of ~5.5 (in process,
    # c=1 first audio p95 15.3 -> 23.7 ms). Steps of more rows always launch plainly (TalkerRunner.pdl_at)
    heads_in_attention: bool = True  # compiled CUDA path: the decode attention kernel applies q/k's head norm and
    # RoPE while loading them (two kernels fewer per layer and pass; H100: with sampling_kernel, batch 1 7.22 ->
    # 6.10 ms per frame, batch 256 10.45 -> 9.74 ms per step, docs/benchmarks.md)
    attention_splits: bool = True  # decode kernel: batches with fewer rows x KV heads than an H100 has SMs split
    # each row's keys over several programs, merged by a second kernel (paged_attention.decode_splits). H100:
    # the step's attention at batch 1 0.94 -> 0.62 ms, the step 5.51 -> 5.01 ms (batch 8: 7.58 -> 6.96)
    sampling_kernel: bool = True  # CUDA: token selection as one Triton program per row (stages/sampling_kernel.py:
    # no sort of the vocabulary, 16 times a frame)
    stall_timeout_s: float = 60.0  # check_health fails when work is pending and no step ran for this long
    text_idle_timeout_s: float = 30.0  # live text: a request waiting this long for its next text ends (error)
    compile_cache_dir: str | None = None  # keep torch.compile's work here (stages/compile_cache.py); None: don't
    compile_cache_dynamo: bool = True  # the file keeps Dynamo's traced variants too (torch's experimental caching
    # precompile: a start from the file traces nothing); False: Inductor's artifacts only
    schedule: ChunkSchedule = ChunkSchedule()  # default chunking of a stream (a request may bring its own)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_seq_len < 16:
            raise ValueError("max_num_seqs must be >= 1 and max_seq_len >= 16")
        if self.max_prefills_per_step < 1:
            raise ValueError("max_prefills_per_step must be >= 1")
        if any(w < 1 for w in self.prefill_widths) or any(b < 1 for b in self.prefill_batches):
            raise ValueError("prefill_widths and prefill_batches must be >= 1")
        object.__setattr__(self, "prefill_widths", tuple(sorted(set(self.prefill_widths))))  # YAML gives a list
        object.__setattr__(self, "prefill_batches", tuple(sorted(set(self.prefill_batches))))
        if self.prefill_hold_s < 0:
            raise ValueError("prefill_hold_s must be >= 0")
        if not 0 <= self.gemv_rows <= 8:  # stages/gemv_kernels.MAX_ROWS (this module stays torch-free)
            raise ValueError("gemv_rows must be in 0..8")
        if isinstance(self.schedule, dict):  # from YAML / JSON kwargs
            object.__setattr__(self, "schedule", ChunkSchedule(**self.schedule))
