"""The HTTP edge under abuse: half-sent bodies (408, and probes still answered), bodies over the size
limit counted as they stream in (413, chunked ones included, with the ingress's memory bounded)."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.serve.conftest import BODY_READ_TIMEOUT_S, replica_pids, speech

pytestmark = pytest.mark.serve
GUARD_S = 300.0  # bounds a wait that would otherwise hang; every wait ends on its answer long before


def _connect(base_url: str) -> socket.socket:
    url = urlparse(base_url)
    return socket.create_connection((url.hostname, url.port), timeout=30)


def _status_line(sock: socket.socket, timeout: float) -> str:
    """The first line the server sends, waiting for it (not for the clock) up to `timeout`."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n" not in data:
        piece = sock.recv(4096)
        if not piece:
            break
        data += piece
    return data.split(b"\r\n", 1)[0].decode(errors="replace")


def _rss_peak(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _ingress_pid() -> int:
    (pid,) = replica_pids("TTSIngress")
    return pid


def test_half_sent_bodies_time_out_and_never_block_probes_or_speech(base_url):
    sockets = []
    try:
        for _ in range(100):  # headers and the start of a body, then nothing
            s = _connect(base_url)
            s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"input\": \"hel")
            sockets.append(s)
        opened = time.monotonic()
        with httpx.Client(base_url=base_url, timeout=GUARD_S) as client:
            for path in ("/ready", "/health"):
                r = client.get(path)
                assert r.status_code == 200, (path, r.status_code, r.text[:200])
            r = client.post("/v1/audio/speech", json=speech(response_format="pcm"))
            assert r.status_code == 200, r.text[:300]
        # every idle request is answered 408 once its body deadline passes (JSON, and the connection closed)
        statuses = [_status_line(s, GUARD_S) for s in sockets]
        assert statuses == ["HTTP/1.1 408 Request Timeout"] * len(sockets), set(statuses)
        assert time.monotonic() - opened >= BODY_READ_TIMEOUT_S * 0.9  # not before the deadline
    finally:
        for s in sockets:
            s.close()
    assert httpx.get(f"{base_url}/ready", timeout=GUARD_S).status_code == 200


def test_a_large_chunked_body_is_refused_while_it_streams_in(base_url):
    pid = _ingress_pid()
    peak_before = _rss_peak(pid)
    s = _connect(base_url)
    s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))  # 1 MiB of JSON whitespace per chunk
    # The client sends until the answer is there (an event, not a time): Serve's proxy takes body chunks as fast as
    # it can forward them, so how many MiB pass before the ingress's 413 comes back depends on the machine's load
    # (up to 163 MiB seen on a loaded 2-core CI machine for the 1 MB limit). What must hold: the refusal comes
    # while the body streams in (long before its end), and the ingress's memory stays bounded.
    total = 1 << 30
    sent, answered = 0, False
    try:
        s.settimeout(0.0)
        while sent < total:
            try:
                if s.recv(1, socket.MSG_PEEK):  # the server answered: stop sending
                    answered = True
                    break
            except BlockingIOError:
                pass
            s.settimeout(30)
            try:
                s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server closed the connection after answering
            s.settimeout(0.0)
            sent += 1 << 20
        assert _status_line(s, 30) == "HTTP/1.1 413 Request Entity Too Large", (sent, answered)
    finally:
        s.close()
    assert sent < total // 2, f"{sent >> 20} MiB of {total >> 20} were accepted before the 413"
    growth = _rss_peak(pid) - peak_before
    assert growth < 100 << 20, f"the ingress's peak RSS grew by {growth >> 20} MiB"


def test_content_length_over_the_limit_is_refused_before_reading(base_url):
    s = _connect(base_url)
    try:
        s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 300000000\r\n\r\n{")
        assert _status_line(s, 30) == "HTTP/1.1 413 Request Entity Too Large"
    finally:
        s.close()
