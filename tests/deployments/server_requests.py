"""What the deployment-server tests share (tests/deployments/conftest.py's servers, test_servers.py,
test_first_chunk_decoder_server.py): the streaming schedule, requests for a server's own model, and a stream read
whole."""

from __future__ import annotations

import dataclasses

from deployments.config import StreamingConfig
from stages.contract import SamplingParams, SynthesisRequest
from stages.prompts import build_prompt

STREAMING = StreamingConfig(first_chunk_frames=2, steady_chunk_frames=5, left_context_frames=3)


def longest_request(talker, rid: str) -> SynthesisRequest:
    """A request of the most frames that fit the engine's max_seq_len (the KV-fit rule: stages/talker/layout.py)."""
    from stages.talker.layout import max_frames_that_fit, prefill_length

    request = request_for(talker, 1, rid=rid)
    fit = max_frames_that_fit(prefill_length(request.prompt), talker._info.max_seq_len)
    return dataclasses.replace(request, max_frames=fit)


def request_for(talker, frames: int, rid: str = "r1", seed: int = 3) -> SynthesisRequest:
    info = talker._info
    prompt = build_prompt(info.config, info.tokenizer, "Hello there.", speaker="vivian")
    return SynthesisRequest(rid, prompt, SamplingParams(suppress_eos=True), max_frames=frames, seed=seed)


async def collect(agen):
    return [c async for c in agen]
