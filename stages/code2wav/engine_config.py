"""Code2WavEngineConfig: the codec decoder engine's shapes and limits, torch-free so that the application builder
validates `engine_kwargs` without importing torch (Serve builds the app in a fresh worker on `serve run`'s path)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from stages.chunking import ChunkSchedule

DEFAULT_LENGTH_BUCKETS = tuple(ChunkSchedule().decode_lengths())  # (2, 6, 14, 30, 50)


@dataclass(frozen=True)
class Code2WavEngineConfig:
    """Shapes and limits of the engine. Sizes are in frames (80 ms, 1920 samples each).

    `length_buckets` are the decode lengths (context + new) with CUDA graphs, normally those of the chunk
    schedule (`for_schedule`); longer chunks run eagerly at their own length. Graphs exist for every
    batch bucket (capped at `max_batch_size`) x length bucket whose `batch * length` fits in
    `max_frames_per_forward`, which also bounds the activation memory of one forward (about 0.8 MB per
    frame in bf16 with the fused kernels, 2.3 MB without; docs/code2wav.md).
    """

    max_batch_size: int = 64  # chunks in one forward at most
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    length_buckets: tuple[int, ...] = DEFAULT_LENGTH_BUCKETS
    cuda_graphs: bool = True
    fast_kernels: bool = True  # fused Triton SnakeBeta etc. on CUDA (stages/code2wav/fast.py); False: eager modules
    max_frames_per_forward: int = 4096  # padded batch x padded length of one forward
    forward_overhead_frames: int = 64  # cost of one forward in frames of work (batching plan; ~2 ms on H100)
    stateful: bool = True  # carry each stream's decoder state between its chunks: decode new frames only
    compile: bool = True  # CUDA: torch.compile the dequantizer and pre-transformer (stages/code2wav/compiled.py)
    compile_cache_dir: str | None = None  # keep torch.compile's work here (stages/compile_cache.py); None: don't
    state_slots: int = 512  # streams whose state is kept (least recently used beyond); ~2.6 MB each (bf16)
    deterministic: bool = False  # batch-invariant mode: a chunk's PCM does not depend on the chunks decoded with it.
    # Every forward holds chunks of one length bucket (their own length's), padded to that bucket's one batch size
    # (`fixed_batch`); on CUDA the convolutions as products (stages/invariant_conv.py), cuDNN without benchmark
    # (docs/code2wav.md, "Deterministic mode")

    def __post_init__(self) -> None:
        for f in fields(self):  # lists from YAML/JSON
            if isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))
        if self.max_batch_size < 1 or self.max_frames_per_forward < 1 or self.forward_overhead_frames < 0:
            raise ValueError("max_batch_size and max_frames_per_forward must be >= 1, forward_overhead_frames >= 0")
        if self.state_slots < 1:
            raise ValueError("state_slots must be >= 1")
        if not self.batch_buckets or min(self.batch_buckets) < 1:
            raise ValueError("batch_buckets must be non-empty and >= 1")
        if self.length_buckets and min(self.length_buckets) < 1:
            raise ValueError("length_buckets must be >= 1")

    def fixed_batch(self, length: int, min_size: int = 1) -> int:
        """Deterministic mode: the one batch size of a forward of chunks `length` frames long (padded): as many as
        `max_frames_per_forward` holds, at most `max_batch_size`."""
        return max(min_size, min(self.max_batch_size, self.max_frames_per_forward // length))

    @classmethod
    def for_schedule(cls, schedule: ChunkSchedule, ref_frames: tuple[int, ...] = (), **kwargs) -> Code2WavEngineConfig:
        """Length buckets = the lengths the schedule's chunks decode at (`ChunkSchedule.graph_lengths`)."""
        stateful = kwargs.get("stateful", cls.stateful)
        return cls(length_buckets=tuple(schedule.graph_lengths(stateful, ref_frames)), **kwargs)
