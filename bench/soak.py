"""A soak of a running server: mixed traffic for a while, then what failed and how each Serve process's memory moved.

Traffic (`--concurrency` workers, each picking its next request at random): HTTP speech in every response format,
whole and streamed, SSE, WebSocket contexts (text in pieces, some cancelled), voice uploads, use and deletes, and
random disconnects (a stream or a socket dropped mid-way). Random weights stop at random, so every request bounds
its length (`max_new_tokens`).

Memory: the RSS of every Serve replica process (Ray titles them `ray::ServeReplica:<app>:<deployment>`) and of the
proxy, read with psutil at the end of the warm-up and at the end. `--root-pid` keeps only the processes under one
process (a machine may run other Ray clusters).

    serve run configs/local.yaml &                               # then, once /ready answers 200:
    python -m bench.soak --minutes 30 --out soak.json

The JSON: requests by kind, answers by status, `server_errors` (5xx answers and streams that failed mid-way),
`transport_errors` (the server closed a connection it should not have), and per process the RSS after warm-up
and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import io
import json
import random
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

FORMATS = ("pcm", "wav", "flac", "mp3", "opus", "aac", "mulaw", "alaw")
TEXTS = ("Hello from the soak.", "The quick brown fox jumps over the lazy dog.", "One, two, three, four.",
         "Streaming speech, piece by piece, for a long while.")


@dataclass
class Tally:
    requests: collections.Counter = field(default_factory=collections.Counter)  # by kind
    statuses: collections.Counter = field(default_factory=collections.Counter)  # by HTTP status (WS: "ws:<type>")
    server_errors: list[str] = field(default_factory=list)
    transport_errors: list[str] = field(default_factory=list)

    def answer(self, kind: str, status: int | str, detail: str = "") -> None:
        self.requests[kind] += 1
        self.statuses[str(status)] += 1
        if isinstance(status, int) and status >= 500:
            self.server_errors.append(f"{kind} {status} {detail[:200]}")


@dataclass(frozen=True)
class Target:
    url: str
    model: str  # a CustomVoice (or VoiceDesign) model
    speaker: str | None
    base: str | None  # a Base model for uploaded voices, when one is served


def _clip(seconds: float = 1.5, seed: int = 0) -> bytes:
    """A WAV reference clip (tones and a little noise) for voice uploads."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(24000 * seconds)) / 24000
    f = 120 + 60 * rng.random()
    pcm = (0.4 * np.sin(2 * np.pi * f * t) + 0.02 * rng.standard_normal(t.size)) * 32767
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(24000)
        w.writeframes(pcm.astype("<i2").tobytes())
    return buf.getvalue()


def _body(target: Target, rng: random.Random, **fields) -> dict:
    voice = {"voice": target.speaker} if target.speaker else {"instructions": "A calm voice."}
    return {"model": target.model, "input": rng.choice(TEXTS), "max_new_tokens": rng.randint(8, 40), **voice,
            "seed": rng.randint(0, 1 << 30), **fields}


async def _speech(client: httpx.AsyncClient, target: Target, rng: random.Random, tally: Tally) -> None:
    fmt = rng.choice(FORMATS)
    mode = rng.choice(("whole", "stream", "sse", "drop"))
    body = _body(target, rng, response_format=fmt, stream=mode != "whole")
    if mode == "sse":
        body.update(response_format="pcm", stream_format="sse")
    kind = f"speech_{mode}"
    async with client.stream("POST", "/v1/audio/speech", json=body) as r:
        if r.status_code != 200:
            tally.answer(kind, r.status_code, (await r.aread()).decode(errors="replace"))
            return
        if mode == "drop":  # a client that leaves after its first audio
            async for _ in r.aiter_bytes():
                break
            tally.answer(kind, r.status_code)
            return
        if mode == "sse":
            last = None
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    last = json.loads(line[6:])
            if last is None or last.get("type") != "speech.audio.done":
                tally.answer(kind, 500, f"SSE ended with {last!r}")
                return
        else:
            await r.aread()
        tally.answer(kind, r.status_code)


async def _voice(client: httpx.AsyncClient, target: Target, rng: random.Random, tally: Tally) -> None:
    """Upload a voice, speak with it once (when a Base model is served), delete it."""
    name = f"soak{rng.randint(0, 1 << 30)}"
    r = await client.post("/v1/audio/voices", data={"name": name}, files={
        "audio_sample": ("ref.wav", _clip(seed=rng.randint(0, 1000)), "audio/wav")})
    tally.answer("voice_upload", r.status_code, r.text)
    if r.status_code == 200 and target.base:
        s = await client.post("/v1/audio/speech", json={"model": target.base, "voice": name, "input": rng.choice(TEXTS),
                                                        "max_new_tokens": rng.randint(8, 30), "response_format": "pcm"})
        tally.answer("speech_uploaded_voice", s.status_code, s.text if s.status_code != 200 else "")
    d = await client.delete(f"/v1/audio/voices/{name}")
    tally.answer("voice_delete", d.status_code, d.text)


async def _websocket(target: Target, rng: random.Random, tally: Tally) -> None:
    """One connection, 1-3 contexts fed in pieces; a context may be cancelled, the socket dropped mid-way."""
    from websockets.asyncio.client import connect

    ws_url = target.url.replace("http://", "ws://").replace("https://", "wss://") + "/v1/audio/speech/stream"
    ids = [f"c{i}" for i in range(rng.randint(1, 3))]
    plan = {cid: rng.choice(("end", "end", "cancel", "drop")) for cid in ids}
    open_ids = set(ids)
    async with connect(ws_url, max_size=None, open_timeout=60) as ws:
        for cid in ids:
            body = _body(target, rng, response_format=rng.choice(FORMATS))
            text = body.pop("input")
            await ws.send(json.dumps({"type": "open", "context_id": cid, **body}))
            for piece in (text[i:i + 4] for i in range(0, len(text), 4)):
                await ws.send(json.dumps({"type": "append", "context_id": cid, "text": piece}))
            if plan[cid] == "cancel":
                await ws.send(json.dumps({"type": "cancel", "context_id": cid}))
            elif plan[cid] == "end":
                await ws.send(json.dumps({"type": "end", "context_id": cid}))
        if "drop" in plan.values():  # leave with contexts open: the server cancels them
            await asyncio.sleep(rng.random())
            tally.answer("ws_drop", "ws:dropped")
            return
        while open_ids:
            message = await ws.recv()
            if isinstance(message, bytes):
                continue
            m = json.loads(message)
            final = m["type"] == "done" or (m["type"] == "error" and m.get("final"))
            if m.get("context_id") in open_ids and final:
                open_ids.discard(m["context_id"])
                status = m.get("status", 200) if m["type"] == "error" else 200
                tally.answer("ws_context", status, json.dumps(m.get("error", "")))
            elif m["type"] == "error" and m.get("status", 0) >= 500:
                tally.answer("ws_message", m["status"], json.dumps(m.get("error", "")))


async def _worker(target: Target, seed: int, deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=target.url, timeout=300) as client:
        while time.monotonic() < deadline:
            action = rng.choices(("speech", "websocket", "voice"), weights=(6, 3, 1))[0]
            try:
                if action == "speech":
                    await _speech(client, target, rng, tally)
                elif action == "websocket":
                    await _websocket(target, rng, tally)
                else:
                    await _voice(client, target, rng, tally)
            except Exception as e:  # a connection the server closed or reset, a WebSocket closed mid-context
                tally.transport_errors.append(f"{action}: {type(e).__name__}: {e}"[:300])


def serve_processes(app: str | None = None, root_pid: int | None = None) -> dict[int, str]:
    """pid -> what it is ("<deployment>" of a replica, "proxy") for Serve's replica and proxy processes."""
    import psutil

    found: dict[int, str] = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        title = (p.info["cmdline"] or [""])[0].split(" ")[0]
        if title.startswith("ray::ServeReplica:"):
            _, app_name, deployment = title.split(":", 2)
            if app is not None and app_name != app:
                continue
            what = deployment.split(".")[0]  # `ray::ServeReplica:<app>:<deployment>.<method>` while busy
        elif title.startswith("ray::ProxyActor"):
            what = "proxy"
        else:
            continue
        if root_pid is None or _under(p, root_pid):
            found[p.info["pid"]] = what
    return found


def _under(process, root_pid: int) -> bool:
    import psutil

    try:
        return any(parent.pid == root_pid for parent in process.parents())
    except psutil.Error:
        return False


def rss_mb(pids: dict[int, str]) -> dict[int, float]:
    import psutil

    out = {}
    for pid in pids:
        try:
            out[pid] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        except psutil.Error:
            continue  # it ended (a replaced replica)
    return out


async def _target(url: str, model: str | None, base: str | None) -> Target:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        models = (await client.get("/v1/models")).json()["data"]
    by_name = {m["id"]: m for m in models}
    if model is None:
        model = next(m["id"] for m in models if m.get("task_type") in ("CustomVoice", "VoiceDesign"))
    if base is None:
        base = next((m["id"] for m in models if m.get("task_type") == "Base"), None)
    speakers = by_name[model].get("speakers") or []
    return Target(url.rstrip("/"), model, speakers[0] if speakers else None, base)


async def soak(url: str, seconds: float, warmup_s: float, concurrency: int, app: str | None, root_pid: int | None,
               model: str | None = None, base: str | None = None, seed: int = 0) -> dict:
    target = await _target(url, model, base)
    tally = Tally()
    started = time.monotonic()
    deadline = started + warmup_s + seconds
    workers = [asyncio.create_task(_worker(target, seed + i, deadline, tally)) for i in range(concurrency)]
    await asyncio.sleep(warmup_s)
    processes = serve_processes(app, root_pid)
    warm = rss_mb(processes)
    warm_requests = sum(tally.requests.values())
    await asyncio.gather(*workers)
    end = rss_mb(serve_processes(app, root_pid))
    rss = [{"pid": pid, "process": what, "rss_after_warmup_mb": warm.get(pid), "rss_end_mb": end.get(pid),
            "growth_mb": round(end[pid] - warm[pid], 1) if pid in warm and pid in end else None}
           for pid, what in sorted({**processes, **serve_processes(app, root_pid)}.items(), key=lambda kv: kv[1])]
    return {"url": url, "model": target.model, "base_model": target.base, "concurrency": concurrency,
            "warmup_s": warmup_s, "seconds": round(time.monotonic() - started - warmup_s, 1),
            "requests": sum(tally.requests.values()), "requests_after_warmup": sum(tally.requests.values()) - warm_requests,
            "by_kind": dict(tally.requests), "by_status": dict(tally.statuses),
            "server_errors": len(tally.server_errors), "server_error_samples": tally.server_errors[:20],
            "transport_errors": len(tally.transport_errors), "transport_error_samples": tally.transport_errors[:20],
            "rss": rss}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (configs/local.yaml's address)")
    parser.add_argument("--minutes", type=float, default=30.0, help="traffic after the warm-up")
    parser.add_argument("--seconds", type=float, default=None, help="instead of --minutes (short checks)")
    parser.add_argument("--warmup-s", type=float, default=60.0, help="traffic before the first memory reading")
    parser.add_argument("--concurrency", type=int, default=8, help="workers, each with one request at a time")
    parser.add_argument("--app", default="tts", help="the Serve application whose replicas are measured")
    parser.add_argument("--root-pid", type=int, default=None, help="only processes under this one (default: all)")
    parser.add_argument("--model", default=None, help="default: the first CustomVoice/VoiceDesign model served")
    parser.add_argument("--base-model", default=None, help="for uploaded voices; default: the first Base model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="soak.json")
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    report = asyncio.run(soak(args.url, seconds, args.warmup_s, args.concurrency, args.app, args.root_pid,
                              args.model, args.base_model, args.seed))
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"[soak] {report['requests']} requests ({report['requests_after_warmup']} after warm-up), "
          f"{report['server_errors']} server errors, {report['transport_errors']} transport errors; {args.out}")
    for row in report["rss"]:
        print(f"[soak] {row['process']:<24} pid {row['pid']:>7}: RSS {row['rss_after_warmup_mb']} -> "
              f"{row['rss_end_mb']} MiB")
    return report


if __name__ == "__main__":
    main()
