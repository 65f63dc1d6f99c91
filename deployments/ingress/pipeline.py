"""The per-request pipeline: Talker stream -> chunks -> Code2Wav decodes, pipelined, audio in order.

Each chunk of the Talker's stream goes to the replica's `DecodeBatcher`, which sends the chunks of many
streams in one `Code2Wav.decode_many` call; with the "grpc" transport the chunk is a value, with
"object_ref" a ref the ingress forwards unread (deployments/transport.py says where the bytes go). Up to
`depth` decodes are in flight per stream (overlapping generation); results are awaited in submission order.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ray.serve.handle import DeploymentHandle

from deployments import constants as C
from deployments import first_audio_timing
from deployments.first_audio_timing import FirstAudioTiming
from deployments.ingress.decode_batcher import DecodeBatcher
from deployments.ingress.live_calls import LiveCalls
from deployments.messages import DecodedChunk, GenerateOptions, LiveAdmitted
from deployments.transport import StageTransport, stage_handle, stream_items
from stages.contract import SynthesisRequest

_END = object()


async def stream_audio(
    talker: DeploymentHandle, decoder: DecodeBatcher, request: SynthesisRequest, options: GenerateOptions,
    depth: int, transport: StageTransport, live: LiveCalls | None = None, timing: FirstAudioTiming | None = None,
) -> AsyncIterator[DecodedChunk | LiveAdmitted]:
    """Decoded chunks of one request, in stream order. Closing the iterator cancels the whole pipeline.

    With `live` the request is live: it goes to the Talker in one of `live`'s batched calls
    (deployments/ingress/live_calls.py), its text through their mailbox, and its chunks arrive as values whatever
    the transport. With `timing`, the first chunk's hops are stamped on it (deployments/first_audio_timing.py). Stream
    affinity never holds back the first `WAITED_FOR_CHUNKS` chunks (deployments/constants.py).

    Errors of either stage (e.g. the Talker rejecting the request) surface when the affected chunk is
    awaited; the first chunk therefore tells whether the request was accepted. A live request's first item is the
    Talker's `LiveAdmitted` (its text comes later, so its first audio cannot say it).
    """
    if live is None:
        if timing is not None:
            timing.talker_called = first_audio_timing.now()
        generator = stage_handle(talker, transport).options(stream=True).generate.remote(request, options)
        items, cancel = stream_items(generator, transport), generator.cancel
    else:  # the batch's call stamps `talker_called`
        stream = live.open(request, options, timing)
        items, cancel = stream, stream.cancel
    pending: asyncio.Queue = asyncio.Queue(maxsize=depth)

    async def submit() -> None:
        try:
            index, admitting = 0, live is not None
            async for chunk in items:
                if admitting:  # `LiveAdmitted`
                    admitting = False
                    await pending.put(chunk)
                    continue
                if timing is not None and timing.chunk_received is None:
                    timing.chunk_received = first_audio_timing.now()
                    timing.talker = getattr(chunk, "stamps", ())  # an ObjectRef (object_ref transport) has none
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
            if isinstance(item, LiveAdmitted):
                yield item
                continue
            decoded = await item
            if timing is not None and timing.decoded_received is None:
                timing.decoded_received, timing.code2wav = first_audio_timing.now(), decoded.stamps
            yield decoded
    finally:
        producer.cancel()
        cancel()  # stops the Talker's request (a live one: its batch call, deployments/ingress/live_calls.py)
        decoder.forget(request.request_id)
        while not pending.empty():  # decodes nobody will read
            item = pending.get_nowait()
            if isinstance(item, asyncio.Future):
                item.cancel()
