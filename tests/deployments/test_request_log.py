"""The structured log line each request ends with (deployments/ingress/request_log.py)."""

from __future__ import annotations

import hashlib
import json
import logging

from deployments.ingress.request_log import EVENT, RequestRecord, key_hash


def test_key_hash_names_a_key_without_revealing_it():
    digest = hashlib.sha256(b"sk-secret").hexdigest()[:8]
    assert key_hash("Bearer sk-secret") == key_hash("bearer  sk-secret ") == key_hash(None, "sk-secret") == digest
    assert key_hash(None, None) is None and key_hash("", "") is None
    assert key_hash("Bearer sk-secret", "other") == digest  # the header wins


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_request_ends_in_one_json_line():
    record = RequestRecord("speech-1", "speech", 21, True, voice="vivian", key_hash="ab", request_id="rid")
    record.model = "cv"
    record.first_audio()
    logger, handler = logging.getLogger("ray.serve"), _Lines()  # Serve's logger does not propagate to the root
    logger.addHandler(handler)
    level, _ = logger.level, logger.setLevel(logging.INFO)
    try:
        fields = record.end("ok", 200, audio_s=2.0)
        record.end("error", 500)  # a request ends once
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [json.loads(m) for m in handler.messages if EVENT in m]
    assert lines == [fields]
    assert fields["event"] == EVENT and fields["request_id"] == "rid" and fields["engine_request_id"] == "speech-1"
    assert (fields["model"], fields["voice"], fields["key_hash"], fields["input_chars"]) == ("cv", "vivian", "ab", 21)
    assert fields["outcome"] == "ok" and fields["status"] == 200 and fields["audio_s"] == 2.0
    assert fields["first_audio_ms"] >= 0 and fields["rtf"] is not None and 0 <= fields["rtf"] < 1


def test_a_failure_has_no_audio_and_no_rtf():
    fields = RequestRecord("speech-2", "speech", 3, False).end("bad_request", 400)
    assert fields["audio_s"] == 0 and fields["rtf"] is None and fields["first_audio_ms"] is None
    assert fields["request_id"] == "speech-2" and fields["model"] == "-"  # outside Serve: the engine's id
