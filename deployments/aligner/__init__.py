"""The `Aligner` deployment: word timestamps of audio and its text (Qwen3-ForcedAligner, docs/aligner.md).

    server.py           `AlignerServer`: times the pieces of many calls in few batched forwards
    engine_protocol.py  `AlignerEngineProtocol`: what the server needs of an aligner (`stages.aligner.Aligner`)
"""
