"""The per-request pipeline: Talker stream -> chunks -> Code2Wav decodes, pipelined, audio in order.

Each chunk of the Talker's stream (a value, from the batched call the request shares: deployments/ingress/
talker_calls.py) goes to the replica's `DecodeBatcher`, which sends the chunks of many streams in one
`Code2Wav.decode_many` call (by gRPC, or through the object store with the "object_ref" transport:
deployments/transport.py says where the bytes go). Up to `depth` decodes are in flight per stream (overlapping
generation); results are awaited in submission order.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from deployments import constants as C
from deployments import first_audio_timing
from deployments.first_audio_timing import FirstAudioTiming
from deployments.ingress.decode_batcher import DecodeBatcher
from deployments.ingress.talker_calls import TalkerCalls
from deployments.messages import Admitted, DecodedChunk, GenerateOptions
from stages.contract import SynthesisRequest

_END = object()


async def stream_audio(
    calls: TalkerCalls, decoder: DecodeBatcher, request: SynthesisRequest, options: GenerateOptions, depth: int,
    timing: FirstAudioTiming | None = None,
) -> AsyncIterator[DecodedChunk | Admitted]:
    """Decoded chunks of one request, in stream order. Closing the iterator cancels the whole pipeline.

    The request goes to the Talker in one of `calls`' batched calls (deployments/ingress/talker_calls.py); a live one
    (`calls.live`) takes its text through their mailbox. With `timing`, the first chunk's hops are stamped on it
    (deployments/first_audio_timing.py). Stream affinity never holds back the first `WAITED_FOR_CHUNKS` chunks
    (deployments/constants.py).

    Errors of either stage (e.g. the Talker rejecting the request) surface when the affected chunk is
    awaited; the first chunk therefore tells whether the request was accepted. A live request's first item is the
    Talker's `Admitted` (its text comes later, so its first audio cannot say it); a speech request's is not yielded.
    """
    items = calls.open(request, options, timing)  # the batch's call stamps `talker_called`
    pending: asyncio.Queue = asyncio.Queue(maxsize=depth)

    async def submit() -> None:
        try:
            index, admitting = 0, True
            async for chunk in items:
                if admitting:  # `Admitted`: a live request's first item
                    admitting = False
                    if calls.live:
                        await pending.put(chunk)
                    continue
                if timing is not None and timing.chunk_received is None:
                    timing.chunk_received = first_audio_timing.now()
                    timing.talker = chunk.stamps
                await pending.put(decoder.submit(chunk, stream=request.request_id, early=index < C.WAITED_FOR_CHUNKS))
                index += 1
        except Exception as e:  # refusal (backpressure) or a failed stream: the consumer raises it in order
            await pending.put(e)
        await pending.put(_END)

    producer = asyncio.get_running_loop().create_task(submit())
    try:
        while (item := await pending.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, Admitted):
                yield item
                continue
            decoded = await item
            if timing is not None and timing.decoded_received is None:
                timing.decoded_received, timing.code2wav = first_audio_timing.now(), decoded.stamps
            yield decoded
    finally:
        producer.cancel()
        items.cancel()  # stops the Talker's request (deployments/ingress/talker_calls.py)
        decoder.forget(request.request_id)
        while not pending.empty():  # decodes nobody will read
            item = pending.get_nowait()
            if isinstance(item, asyncio.Future):
                item.cancel()
