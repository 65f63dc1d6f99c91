"""One log line per refused request: Serve's access line says 429 already, so the ingress adds none for an
overload; a client error is one INFO line without a traceback; our own failure is an ERROR."""

from __future__ import annotations

import logging

from deployments.config import BackpressureSettings
from deployments.errors import APIError
from deployments.ingress.outcomes import Outcomes
from stages.contract import EngineOverloadedError, InvalidRequestError


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def _records(exc) -> list[logging.LogRecord]:
    """What `Outcomes.error` logs at INFO and above on the ingress's logger ("ray.serve" does not propagate)."""
    logger, keep = logging.getLogger("ray.serve"), _Keep()
    level, logger.level = logger.level, logging.DEBUG
    logger.addHandler(keep)
    try:
        Outcomes(BackpressureSettings(), ["m"]).error(exc)
    finally:
        logger.removeHandler(keep)
        logger.setLevel(level)
    return [r for r in keep.records if r.levelno >= logging.INFO]


def test_overload_adds_no_line_of_its_own():
    assert _records(EngineOverloadedError("queue full")) == []
    assert _records(APIError(429, "at capacity", code="overloaded", limit="ingress_open_requests")) == []


def test_client_error_is_one_info_line_and_ours_an_error():
    (line,) = _records(InvalidRequestError("unknown speaker 'x'"))
    assert line.levelno == logging.INFO and line.exc_info is None and "400" in line.getMessage()
    assert any(r.levelno == logging.ERROR for r in _records(RuntimeError("boom")))
