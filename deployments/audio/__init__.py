"""Audio out of the decoders: what the ingress sends and how.

    formats.py   response formats (media types, encoder settings), float <-> int16 PCM, the streaming WAV header
    encoders.py  whole-body and streaming encoders (PyAV), `AsyncStreamEncoder` off the event loop
    tempo.py     `speed`: FFmpeg's atempo over a stream of chunks
    clip_decoding.py  reference clips in (webm/opus, m4a/aac, ...): decoded by PyAV into a WAV
"""
