"""The Ray Serve application: thin deployments around the torch-free and torch stages of `stages/`.

One package per Serve process, and at the top only what several processes share:

    talker/      the `Talker:<model>` deployment (runs in each Talker replica)
    code2wav/    the shared `Code2Wav` deployment and its request router (runs in each Code2Wav replica)
    ingress/     the OpenAI-compatible HTTP API and everything the ingress replicas run
    audio/       PCM formats, streaming encoders and tempo (the ingress's, and Code2Wav's PCM conversion)

    builder.py             `deployments.builder:build_app`: validated args -> the Serve application (import_path)
    config.py              the validated configuration (`TTSServingArgs`) and its defaults
    constants.py           Serve-layer defaults, each overridable by an environment variable of the same name
    autoscaling.py         `deployments.autoscaling:talker_policy` / `code2wav_policy` (queue-depth policies)
    loading.py             a checkpoint onto a replica: device/dtype, the embedded checkpoint, engine classes
    messages.py            types that travel between the deployments (ModelInfo, GenerateOptions, DecodedChunk)
    transport.py           how chunks travel Talker -> ingress -> Code2Wav: gRPC by value or object refs
    coalescing.py          `Coalescer`: calls that arrive while a batch runs share the next batch; `ignore_failure`
    first_audio_timing.py  a stream's first chunk stamped hop by hop (Server-Timing, metrics)
    errors.py              the API's errors and their JSON
    metrics.py             the replicas' Ray metrics
    loop_lag.py            each replica's event-loop lag and collections (what holds its calls and streams)
    text_mailbox.py        `TextMailbox`: live text from an ingress replica to the Talkers speaking it (an actor the
                           Talker deserializes with the first live call: kept out of the ingress package, whose
                           import on that call cost it ~150 ms)
"""
