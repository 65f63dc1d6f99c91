"""Host staging of the talker runner: what crosses to the device in one non-blocking copy per admission.

A batch's prompt ids, sampling parameters and KV block rows are written into a pinned staging row per request
(`write_stage`) and cross in one copy (`Staging`: one byte row per request, typed views per field); pinned
buffers are used in turn (`HostRing`), so one admission per engine iteration never waits for the previous copy.
`SlotParams` are the device rows the staged parameters land in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stages.contract import NUM_CODEBOOKS, SamplingParams
from stages.sampling import TOP_K_OFF, SamplingRows, SamplingTensors
from stages.talker.prefill import PrefillEmbeds
from stages.talker.prompt_plan import NONE, PromptPlan


@dataclass
class SlotParams(SamplingRows):
    """Sampling parameters of every engine row (written in place by admissions), and each row's seed."""

    seeds: torch.Tensor

    @classmethod
    def empty(cls, n: int, device: torch.device) -> SlotParams:
        def sampling() -> SamplingTensors:
            return SamplingTensors(torch.zeros(n, dtype=torch.bool, device=device),
                                   torch.ones(n, device=device), torch.full((n,), TOP_K_OFF, device=device),
                                   torch.ones(n, device=device))

        return cls(sampling(), sampling(), torch.ones(n, device=device),
                   torch.zeros(n, dtype=torch.long, device=device), torch.zeros(n, dtype=torch.bool, device=device),
                   torch.zeros(n, dtype=torch.long, device=device))

    def tensors(self) -> list[torch.Tensor]:
        t, s = self.talker, self.sub
        return [t.do_sample, t.temperature, t.top_k, t.top_p, s.do_sample, s.temperature, s.top_k, s.top_p,
                self.penalty, self.min_frames, self.suppress_eos, self.seeds]

    def rows(self, b: int) -> SlotParams:
        """Rows [0, b) as views (the decode step)."""
        return self.index(slice(0, b))

    def index(self, rows: torch.Tensor | slice) -> SlotParams:
        """The given rows: views for a slice, gathered copies for an index tensor (the prefill's rows)."""
        t, s = self.talker, self.sub
        return SlotParams(
            SamplingTensors(t.do_sample[rows], t.temperature[rows], t.top_k[rows], t.top_p[rows]),
            SamplingTensors(s.do_sample[rows], s.temperature[rows], s.top_k[rows], s.top_p[rows]),
            self.penalty[rows], self.min_frames[rows], self.suppress_eos[rows], self.seeds[rows],
        )


@dataclass
class Admission:
    """One request entering row `row`: what the staging row holds for it."""

    row: int
    plan: PromptPlan
    params: SamplingParams
    seed: int
    blocks: np.ndarray  # its KV blocks, in position order
    exact: PrefillEmbeds | None = None  # reference embeddings (bit-exact path: CPU tests, parity)


# staging row layout: int64 fields, then float32 fields, in one byte row (one copy for a whole batch)
_META = ("row", "length", "trailing_len", "seed", "min_frames", "top_k", "sub_top_k", "do_sample", "sub_do_sample",
         "suppress_eos", "x_vector_row")
_FPARAMS = ("temperature", "top_p", "sub_temperature", "sub_top_p", "penalty", "_pad")


class Staging:
    """A [rows, bytes] buffer with typed views per field (host pinned or device; same layout)."""

    def __init__(self, rows: int, width: int, text_rows: int, blocks: int, hidden: int, device, pin: bool):
        ints = {"meta": len(_META), "blocks": blocks, "text": width, "codec": width, "frames": width * NUM_CODEBOOKS,
                "trailing": text_rows}
        floats = {"fparams": len(_FPARAMS), "x_vector": hidden}
        n_int, n_float = sum(ints.values()), sum(floats.values())
        self.row_bytes = 8 * n_int + 4 * n_float
        self.buf = torch.zeros(rows, self.row_bytes, dtype=torch.uint8, device=device, pin_memory=pin)
        self.views: dict[str, torch.Tensor] = {}
        at = 0
        as_int = self.buf[:, :8 * n_int].view(torch.int64)
        for name, n in ints.items():
            self.views[name] = as_int[:, at:at + n]
            at += n
        at = 0
        as_float = self.buf[:, 8 * n_int:].view(torch.float32)
        for name, n in floats.items():
            self.views[name] = as_float[:, at:at + n]
            at += n
        self.views["frames"] = self.views["frames"].unflatten(1, (width, NUM_CODEBOOKS))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.views[name]


class HostRing:
    """Pinned host buffers used in turn, each handed out again only once the copy recorded after its last use
    is done (an event; on CPU copies are synchronous). With as many buffers as one engine iteration uses, that
    wait is never a real one."""

    def __init__(self, buffers: list, cuda: bool):
        self.buffers, self.cuda = buffers, cuda
        self._events: list[torch.cuda.Event | None] = [None] * len(buffers)
        self._turn = 0

    def take(self) -> int:
        """The next buffer's index, free to rewrite."""
        t = self._turn
        if self._events[t] is not None:
            self._events[t].synchronize()  # its previous copy: long done, in practice
        self._turn = (t + 1) % len(self.buffers)
        return t

    def copied(self, t: int) -> None:
        """Buffer t's copy to the device is enqueued: it is reused only once that copy is done."""
        if self.cuda:
            self._events[t] = self._events[t] or torch.cuda.Event()
            self._events[t].record()


class IntStage:
    """int64 values crossing to the device: pinned host buffers in a ring (`turns`) and one device buffer."""

    def __init__(self, device: torch.device, turns: int = 2):
        self.device = device
        self._ring = HostRing([torch.zeros(0, dtype=torch.long)] * turns, cuda=device.type == "cuda")
        self._dev = torch.zeros(0, dtype=torch.long, device=device)
        self._turn = 0

    def host(self, n: int) -> np.ndarray:
        """The next turn's host buffer, [n] (valid until `copy`)."""
        t = self._turn = self._ring.take()
        if self._ring.buffers[t].numel() < n:
            self._ring.buffers[t] = torch.zeros(round_up(2 * n, 1024), dtype=torch.long, pin_memory=self._ring.cuda)
        return self._ring.buffers[t][:n].numpy()

    def copy(self, n: int) -> torch.Tensor:
        """Copy the first n values of this turn's host buffer to the device (non-blocking); the device view."""
        if self._dev.numel() < n:
            self._dev = torch.zeros(round_up(2 * n, 1024), dtype=torch.long, device=self.device)
        self._dev[:n].copy_(self._ring.buffers[self._turn][:n], non_blocking=True)
        self._ring.copied(self._turn)
        return self._dev[:n]


def write_stage(s: Staging, batch: list[Admission], nb: int, width: int, trailing_width: int, scratch_row: int,
            scratch_block: int) -> None:
    """Host numpy writes into the pinned staging rows [0, nb); rows past the batch are padding."""
    meta, fp = s["meta"].numpy(), s["fparams"].numpy()
    text, codec, frames = s["text"].numpy(), s["codec"].numpy(), s["frames"].numpy()
    trailing, blocks, x_vector = s["trailing"].numpy(), s["blocks"].numpy(), s["x_vector"].numpy()
    for i in range(nb):
        if i >= len(batch):  # padding: the scratch row, a 1-row prompt with no parts
            meta[i] = (scratch_row, 1, 1, 0, 0, TOP_K_OFF, TOP_K_OFF, 0, 0, 1, NONE)
            fp[i] = (1.0, 1.0, 1.0, 1.0, 1.0, 0.0)
            text[i, :width] = NONE
            codec[i, :width] = NONE
            frames[i, :width] = NONE
            trailing[i, :trailing_width] = NONE
            blocks[i] = scratch_block
            continue
        a = batch[i]
        p, plan = a.params, a.plan
        meta[i] = (a.row, plan.length, plan.trailing_length, a.seed, p.min_frames, p.top_k or TOP_K_OFF,
                   p.subtalker_top_k or TOP_K_OFF, p.do_sample, p.subtalker_do_sample, p.suppress_eos,
                   plan.x_vector_row)
        fp[i] = (p.temperature, p.top_p, p.subtalker_temperature, p.subtalker_top_p, p.repetition_penalty, 0.0)
        L, T = plan.length, plan.trailing_length
        text[i, :L], codec[i, :L] = plan.text_ids, plan.codec_ids
        text[i, L:width] = NONE
        codec[i, L:width] = NONE
        frames[i, :width] = NONE
        if plan.ref_codes is not None:
            rows = np.nonzero(plan.ref_frames >= 0)[0]
            frames[i, rows] = plan.ref_codes[plan.ref_frames[rows]]
        trailing[i, :T] = plan.trailing_ids
        trailing[i, T:trailing_width] = NONE
        blocks[i, :len(a.blocks)] = a.blocks
        blocks[i, len(a.blocks):] = scratch_block
        if plan.x_vector is not None:
            x_vector[i] = plan.x_vector


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
