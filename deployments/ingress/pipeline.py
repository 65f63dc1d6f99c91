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
from deployments.messages import DecodedChunk, GenerateOptions, LiveAdmitted
from deployments.transport import StageTransport, stage_handle, stream_items
from stages.contract import SynthesisRequest

_END = object()


async def stream_audio(
    talker: DeploymentHandle, decoder: DecodeBatcher, request: SynthesisRequest, options: GenerateOptions,
    depth: int, transport: StageTransport, mailbox=None, timing: FirstAudioTiming | None = None,
) -> AsyncIterator[DecodedChunk | LiveAdmitted]:
    """Decoded chunks of one request, in stream order. Closing the iterator cancels the whole pipeline.

    With `mailbox` (a `TextMailbox`) the request is live: `Talker.generate_live` takes its text from there.
    With `timing`, the first chunk's hops are stamped on it (deployments/first_audio_timing.py). Stream
    affinity never holds back the first `WAITED_FOR_CHUNKS` chunks (deployments/constants.py).

    Errors of either stage (e.g. the Talker rejecting the request) surface when the affected chunk is
    awaited; the first chunk therefore tells whether the request was accepted. A live request's first item is the
    Talker's `LiveAdmitted` (its text comes later, so its first audio cannot say it).
    """
    talker = stage_handle(talker, transport).options(stream=True)
    if timing is not None:
        timing.talker_called = first_audio_timing.now()
    if mailbox is None:
        generator = talker.generate.remote(request, options)
    else:
        generator = talker.generate_live.remote(request, options, mailbox)
    pending: asyncio.Queue = asyncio.Queue(maxsize=depth)

    async def submit() -> None:
        try:
            index, admitting = 0, mailbox is not None
            async for chunk in stream_items(generator, transport):
                if admitting:  # `LiveAdmitted` (an ObjectRef to it with object_ref: not read, it says nothing more)
                    admitting = False
                    await pending.put(LiveAdmitted(request.request_id))
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
        generator.cancel()  # stops the Talker (Serve also cascades the ingress request's cancellation)
        decoder.forget(request.request_id)
        while not pending.empty():  # decodes nobody will read
            item = pending.get_nowait()
            if isinstance(item, asyncio.Future):
                item.cancel()
