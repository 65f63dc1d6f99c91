"""TalkerEngineConfig: the talker engine's sizes, buckets and switches, torch-free so that the application builder
validates `engine_kwargs` without importing torch (Serve builds the app in a fresh worker on `serve run`'s path)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from stages.chunking import ChunkSchedule

# graphed prefill widths (prompt positions; a batch pads to the first width that holds its longest prompt). 80 and
# 96 were chosen on the benchmark's random checkpoints, whose byte-level tokenizer makes prompts ~3x longer than
# the real vocabulary does (docs/talker_engine.md, "Admission without host syncs"): re-derive them with real weights
PREFILL_WIDTHS = (16, 32, 64, 80, 96, 128)
# graphed prefill batch sizes, those <= max_prefill_batch; a prefill of n requests pads to the first size >= n
PREFILL_BATCHES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class KernelOptions:
    """Developer switches: reference paths for tests and benches, and the buckets the graphs are captured for.
    The defaults are the fast path; no shipped config sets these (docs/talker_engine.md, "Kernels per frame")."""

    exact_prefill: bool | None = None  # reference prompt embeddings (bit-exact, slow); None: on CPU only
    attention_kernel: bool | None = None  # paged Triton decode attention; None: where available (CUDA)
    gemv_rows: int = 4  # compiled CUDA path: forwards of <= this many rows (<= 8) run each layer as 4 Triton GEMVs
    # with their norms, SwiGLU and residuals fused (stages/gemv_kernels.py); 0: cuBLAS throughout
    heads_in_attention: bool = True  # compiled CUDA path: the decode attention kernel applies q/k's head norm and
    # RoPE while loading them (two kernels fewer per layer and pass)
    attention_splits: bool = True  # decode kernel: batches with fewer rows x KV heads than the GPU has SMs split
    # each row's keys over several programs, merged by a second kernel (paged_attention.decode_splits)
    sampling_kernel: bool = True  # CUDA: token selection as one Triton program per row (no sort of the vocabulary)
    compile_cache_dynamo: bool = True  # the compile cache keeps Dynamo's traced variants too (torch's experimental
    # caching precompile: a start from the file traces nothing); False: Inductor's artifacts only
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512)
    length_buckets: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096)  # gather-attention path only
    kv_block_size: int = 16  # KV positions per block (the unit a request reserves)

    def __post_init__(self) -> None:
        if not 0 <= self.gemv_rows <= 8:  # stages/gemv_kernels.MAX_ROWS (this module stays torch-free)
            raise ValueError("kernels.gemv_rows must be in 0..8")
        if self.kv_block_size < 1:
            raise ValueError("kernels.kv_block_size must be >= 1")
        for name in ("batch_buckets", "length_buckets"):  # YAML gives a list
            value = tuple(getattr(self, name))
            if not value or min(value) < 1:
                raise ValueError(f"kernels.{name} must be non-empty and >= 1")
            object.__setattr__(self, name, value)


@dataclass(frozen=True)
class TalkerEngineConfig:
    max_num_seqs: int = 64  # requests running at once (batch rows)
    max_seq_len: int = 2048  # prompt + frames of one request at most (KV positions)
    kv_cache_tokens: int | None = None  # KV pool in tokens (all requests); None: from kv_cache_memory_fraction
    kv_cache_memory_fraction: float = 0.5  # CUDA: of the device memory free once weights, warm-up and graphs are in
    max_text_rows: int = 1024  # trailing text rows per request (longest streaming-text input)
    max_prefill_batch: int = 64  # requests in one batched prefill
    # prompt positions of one batched prefill, padded (batch bucket x width bucket): a prefill costs about its padded
    # positions, so short prompts (live text's) go many to a prefill and long ones few; graphs only within it
    max_prefill_tokens: int = 2048
    prefill_widths: tuple[int, ...] = PREFILL_WIDTHS  # a CUDA graph per (batch bucket, width); longer prompts: eager
    prefill_batches: tuple[int, ...] = PREFILL_BATCHES  # the batch buckets of those graphs (<= max_prefill_batch)
    max_prefills_per_step: int = 8  # admissions one loop iteration may launch before its step: more than one only
    # while every running stream's handed-out audio is ahead of its playback by admission_lead_s (a burst of
    # arrivals is prefilled at once instead of one batch per step; docs/talker_engine.md, "A burst of arrivals")
    admission_lead_s: float = 0.3
    max_waiting: int = 4096  # queued requests at most; more are refused (overload)
    batch_share: float = 0.5  # batch-job requests (Priority.BATCH) hold at most this share of the rows and of the KV
    # blocks, and start only while no real-time request waits: real-time arrivals find the rest free at once
    # (stages/talker/scheduler.py; docs/serving.md, "Batch jobs")
    cuda_graphs: bool = True
    compile: bool = True  # torch.compile the per-layer math and sampling (CUDA only)
    pdl: bool = False  # compiled CUDA path, H100+: in steps of <= gemv_rows rows the Triton kernels launch with
    # programmatic dependent launch (stages/pdl.py): each starts while the kernel before it ends. For a Talker
    # with its GPU alone (configs/split.yaml); off by default because its kernels then hold the SMs without a gap
    # and a co-located Code2Wav's first chunks wait (docs/talker_engine.md, "Kernels per frame, and the compile cache")
    stall_timeout_s: float = 60.0  # check_health fails when work is pending and no step ran for this long
    text_idle_timeout_s: float = 30.0  # live text: a request waiting this long for its next text ends (error)
    # live text cannot hold rows hostage: a request parked for text at least this long gives its slot and KV to
    # a waiting non-live request that cannot get them otherwise (the longest-parked first; LiveTextEvictedError)
    live_evict_parked_s: float = 1.0
    live_max_lifetime_s: float = 600.0  # a live request waiting for text after this long from its opening ends
    compile_cache_dir: str | None = None  # keep torch.compile's work here (stages/compile_cache.py); None: don't
    schedule: ChunkSchedule = ChunkSchedule()  # default chunking of a stream (a request may bring its own)
    kernels: KernelOptions = KernelOptions()  # developer switches (a dict from YAML: `engine_kwargs.kernels`)
    deterministic: bool = False  # batch-invariant mode: a seeded request's codes do not depend on what runs beside
    # it: batch-invariant products on CUDA, fixed shapes elsewhere (`for_determinism`; docs/talker_engine.md,
    # "Deterministic mode")

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_seq_len < 16:
            raise ValueError("max_num_seqs must be >= 1 and max_seq_len >= 16")
        if self.live_evict_parked_s < 0 or self.live_max_lifetime_s <= 0:
            raise ValueError("live_evict_parked_s must be >= 0 and live_max_lifetime_s > 0")
        if self.max_prefills_per_step < 1 or self.max_prefill_batch < 1 or self.max_prefill_tokens < 1:
            raise ValueError("max_prefills_per_step, max_prefill_batch and max_prefill_tokens must be >= 1")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError("kv_cache_tokens must be >= 1 (or unset: sized from free memory)")
        if not 0 < self.batch_share <= 1:
            raise ValueError("batch_share must be in (0, 1]")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
        if any(w < 1 for w in self.prefill_widths) or any(b < 1 for b in self.prefill_batches):
            raise ValueError("prefill_widths and prefill_batches must be >= 1")
        object.__setattr__(self, "prefill_widths", tuple(sorted(set(self.prefill_widths))))  # YAML gives a list
        object.__setattr__(self, "prefill_batches", tuple(sorted(set(self.prefill_batches))))
        if isinstance(self.schedule, dict):  # from YAML / JSON kwargs
            object.__setattr__(self, "schedule", ChunkSchedule(**self.schedule))
        if isinstance(self.kernels, dict):
            unknown = set(self.kernels) - set(KernelOptions.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown kernels option(s): {', '.join(sorted(unknown))}")
            object.__setattr__(self, "kernels", KernelOptions(**self.kernels))

    def for_determinism(self, invariant_products: bool) -> TalkerEngineConfig:
        """The config a deterministic engine runs with (this one unchanged when not deterministic): every kernel a
        seeded request's numbers come from computes its rows the same way whatever else runs beside them.

        `invariant_products` (CUDA: cuBLAS without a workspace, each product's rows checked invariant to the row
        count at start: stages/row_invariant_products.py): batches stay free; pinned are the few paths that pick a
        kernel or a split by the row count: no few-row GEMV path (another kernel up to `gemv_rows` rows), no
        attention key splits, one tiling per decode attention cache (the runner's), and no batch of one (torch.compile
        compiles a size of 1 as its own variant).
        Otherwise (CPU: BLAS kernels follow the shape) the shapes are fixed: every decode step at max_num_seqs
        rows, one attention length bucket (the gather path's keys: max_seq_len), prefills of one prompt each
        (padded to the prompt's own width)."""
        if not self.deterministic:
            return self
        k = self.kernels
        if invariant_products:
            least = min(2, self.max_num_seqs)
            return replace(self, prefill_batches=tuple(b for b in self.prefill_batches if b >= least) or (least,),
                           kernels=replace(k, gemv_rows=0, attention_splits=False,
                                           batch_buckets=tuple(b for b in k.batch_buckets if b >= least) or (least,)))
        return replace(self, max_prefill_batch=1, prefill_batches=(1,),
                       kernels=replace(k, batch_buckets=(self.max_num_seqs,), length_buckets=(self.max_seq_len,)))
