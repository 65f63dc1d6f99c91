"""The shared `Code2Wav` deployment: what runs in a Code2Wav replica.

    server.py           `Code2WavServer`: decodes the chunks of many streams in few batches
    engine_protocol.py  `Code2WavEngineProtocol`: what the server needs of a Code2Wav engine
    router.py           `StreamAffinityRouter`: a call naming the replica that holds its streams' state goes there
"""
