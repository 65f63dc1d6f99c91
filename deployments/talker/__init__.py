"""The `Talker:<model>` deployment: what runs in a Talker replica.

    server.py               `TalkerServer`: the Serve shim over one talker engine (streams codec chunks; requests
                            in batches, one call for many: `generate_many`, live ones `generate_live_many`)
    engine_protocol.py      `TalkerEngineProtocol`: what the server needs of an engine (real or fake)
    first_chunk_decoder.py  `FirstChunkDecoder`: the replica decodes streams' first chunks itself while lightly loaded
    text_pump.py            `LiveTextPump`: live contexts' text (and every batched request's cancellation) from an
                            ingress replica's mailbox, one poll for all
"""
