"""Soak: mixed traffic against a running server for N minutes; 5xx and every Serve process's memory over time.

Each of `--concurrency` workers loops, picking one kind of work at random: a whole response in a random format,
a raw stream, an SSE stream, a WebSocket context fed in pieces, a voice upload then a request in it then its
delete (when a Base model is served: `configs/local_all.yaml`), a batch job of `--batch-items` items while fewer
than `--batch-jobs` are unfinished (submitted; one task follows every job and downloads each item once it is done,
or cancels a `--disconnect` share of them 1-10 s after submitting them; jobs still unfinished at the end are
cancelled and counted, not failed: they run only in the capacity the real-time traffic leaves), and a share of the
streams (`--disconnect`) are dropped mid-way by the client. The RSS of every Serve process on this host (replicas,
proxy, controller) is sampled every `--sample-s`; the report compares each process's RSS at the end of warm-up with
its last sample.

    serve run configs/local_all.yaml &
    python -m bench.soak --minutes 30 --out soak.json

Fixed-length outputs (`suppress_eos`, `--frames`): random weights never stop by themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import time
import wave
from collections import Counter

import aiohttp
import numpy as np

FORMATS = ("wav", "pcm", "mp3", "flac", "opus", "aac", "mulaw", "alaw")
KINDS = ("whole", "stream", "sse", "websocket", "voice", "batch")


def serve_processes() -> dict[int, str]:
    """pid -> title of this host's Serve processes (Ray titles them `ray::ServeReplica:<app>:<deployment>`)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].split(b" ")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith(("ray::ServeReplica", "ray::ProxyActor", "ray::ServeController")):
            found[int(entry)] = title.split(".")[0]  # `ray::<actor>.<method>` while busy
    return found


def rss_mib() -> dict[str, float]:
    """Resident memory of each Serve process (VmRSS), by title#pid."""
    out = {}
    for pid, title in serve_processes().items():
        try:
            with open(f"/proc/{pid}/status") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
        out[f"{title}#{pid}"] = round(kib / 1024, 1)
    return out


def gpu_mem_mib() -> list[float]:
    """Memory used on each GPU the server may use (nvidia-smi; CUDA_VISIBLE_DEVICES's, when set, as the server was
    started with: other GPUs of the host may run other work), none without one."""
    import shutil
    import subprocess
    if not shutil.which("nvidia-smi"):
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                          *(["-i", visible] if visible else [])], capture_output=True, text=True, timeout=30).stdout
    return [float(x) for x in out.split()]


def _clip() -> bytes:
    """A 3 s voice sample: a chirp with some noise, as a WAV file."""
    t = np.arange(72000) / 24000
    x = 0.3 * np.sin(2 * np.pi * (120 + 40 * t) * t) + 0.02 * np.random.default_rng(0).standard_normal(t.size)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(24000)
        w.writeframes((x * 32767).astype(np.int16).tobytes())
    return buf.getvalue()


class Soak:
    def __init__(self, args, models: dict[str, str]):
        self.args, self.models = args, models  # served model name -> task type
        self.custom = next(n for n, t in models.items() if t == "CustomVoice")
        self.base = next((n for n, t in models.items() if t == "Base"), None)
        self.status: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.disconnects = 0
        self.failures: list[str] = []
        self.failure_kinds: Counter[tuple[str, int]] = Counter()
        self.clip = _clip()
        self.jobs: dict[str, float | None] = {}  # batch job id -> when to cancel it (monotonic), None: never
        self.jobs_submitting = 0  # job POSTs in flight: they count against `--batch-jobs` before their answer
        self.batch_items: Counter[str] = Counter()  # items downloaded / failed / cancelled / unfinished at the end

    def body(self, **fields) -> dict:
        return {"model": self.custom, "input": f"Soak test sentence number {random.randrange(10**6)}.",
                "voice": "vivian", "max_new_tokens": self.args.frames, "suppress_eos": True,
                "seed": random.randrange(2**31), **fields}

    def note(self, kind: str, status: int, detail: str = "") -> None:
        self.kinds[kind] += 1
        self.status[str(status)] += 1
        if status >= 500 and self.failure_kinds[(kind, status)] < 5:  # a few of each kind: the causes differ
            self.failure_kinds[(kind, status)] += 1
            self.failures.append(f"{kind} {status} {detail[:300]}")

    async def whole(self, s: aiohttp.ClientSession) -> None:
        async with s.post(f"{self.args.url}/v1/audio/speech",
                          json=self.body(response_format=random.choice(FORMATS), stream=False)) as r:
            text = await r.read()
            self.note("whole", r.status, text[:200].decode(errors="replace") if r.status >= 400 else "")

    async def stream(self, s: aiohttp.ClientSession, sse: bool) -> None:
        fields = {"stream": True, "response_format": random.choice(FORMATS if not sse else ("pcm", "wav"))}
        if sse:
            fields["stream_format"] = "sse"
        drop = random.random() < self.args.disconnect
        async with s.post(f"{self.args.url}/v1/audio/speech", json=self.body(**fields)) as r:
            if r.status >= 400:
                self.note("sse" if sse else "stream", r.status, (await r.read())[:300].decode(errors="replace"))
                return
            got = 0
            async for data in r.content.iter_any():
                got += len(data)
                if drop and got > 2000:
                    self.disconnects += 1
                    r.close()  # the client leaves mid-stream
                    break
            self.note("sse" if sse else "stream", r.status)

    async def websocket(self, s: aiohttp.ClientSession) -> None:
        cid = f"c{random.randrange(10**6)}"
        async with s.ws_connect(f"{self.args.url.replace('http', 'ws', 1)}/v1/audio/speech/stream",
                                receive_timeout=self.args.timeout) as ws:
            await ws.send_json({"type": "open", "context_id": cid, "model": self.custom, "voice": "vivian",
                                "response_format": random.choice(FORMATS), "max_new_tokens": self.args.frames,
                                "suppress_eos": True})
            for word in "Soak test over the WebSocket, word by word.".split():
                await ws.send_json({"type": "append", "context_id": cid, "text": word + " "})
            await ws.send_json({"type": "end", "context_id": cid})
            drop = random.random() < self.args.disconnect
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.BINARY:
                    if drop:
                        self.disconnects += 1
                        self.note("websocket", 200)
                        return  # leaves with the context open
                    continue
                event = json.loads(msg.data)
                if event.get("type") == "done":
                    self.note("websocket", 200)
                    return
                if event.get("type") == "error" and event.get("final"):
                    self.note("websocket", int(event.get("status", 500)), json.dumps(event))
                    return
            self.note("websocket", 599, "socket closed before done")

    async def voice(self, s: aiohttp.ClientSession) -> None:
        name = f"soak{random.randrange(10**9)}"
        form = aiohttp.FormData()
        form.add_field("name", name)
        form.add_field("x_vector_only_mode", "true")
        form.add_field("audio_sample", self.clip, filename="v.wav", content_type="audio/wav")
        async with s.post(f"{self.args.url}/v1/audio/voices", data=form) as r:
            self.note("voice", r.status, (await r.text())[:200])
            if r.status != 200:
                return
        async with s.post(f"{self.args.url}/v1/audio/speech",
                          json=self.body(model=self.base, voice=name, response_format="wav")) as r:
            await r.read()
            self.note("voice", r.status)
        async with s.delete(f"{self.args.url}/v1/audio/voices/{name}") as r:
            self.note("voice", r.status)

    async def batch(self, s: aiohttp.ClientSession) -> None:
        """Submit a job (its items in random formats); `follow_jobs` takes it from there."""
        items = [self.body(response_format=random.choice(FORMATS)) for _ in range(self.args.batch_items)]
        self.jobs_submitting += 1
        try:
            async with s.post(f"{self.args.url}/v1/audio/speech/batches", json={"requests": items}) as r:
                answer = await r.text()
                self.note("batch", r.status, answer[:200] if r.status >= 400 else "")
                if r.status == 202:  # a job picked for it is cancelled some seconds in, while its items run or wait
                    cancel = random.random() < self.args.disconnect
                    self.jobs[json.loads(answer)["id"]] = time.monotonic() + random.uniform(1, 10) if cancel else None
        finally:
            self.jobs_submitting -= 1

    async def follow_jobs(self, s: aiohttp.ClientSession, until: float) -> None:
        """Every `--sample-s` / 10: each job's status; a finished job's items downloaded (a failed one's error
        read), a job picked for it cancelled; at the end the unfinished ones cancelled and counted."""
        while time.monotonic() < until or self.jobs or self.jobs_submitting:
            ending = time.monotonic() >= until
            for job, cancel_at in list(self.jobs.items()):
                try:
                    await self._follow(s, job, cancel_at, ending)
                except (aiohttp.ClientError, TimeoutError) as e:  # the next poll tries again
                    self.note("batch", 599, repr(e))
            await asyncio.sleep(max(0.5, self.args.sample_s / 10))

    async def _follow(self, s: aiohttp.ClientSession, job: str, cancel_at: float | None, ending: bool) -> None:
        url = f"{self.args.url}/v1/audio/speech/batches/{job}"
        cancel = cancel_at is not None and time.monotonic() >= cancel_at
        if cancel or ending:
            async with s.delete(url) as r:
                self.note("batch", r.status, (await r.text())[:200])
            status = await self._job_status(s, url)
            self.batch_items["cancelled" if cancel else "unfinished_at_end"] += status.get("cancelled", 0)
            await self._download(s, url, status)
            del self.jobs[job]
            return
        status = await self._job_status(s, url)
        if status.get("status") in ("completed", "failed"):
            await self._download(s, url, status)
            del self.jobs[job]

    async def _job_status(self, s: aiohttp.ClientSession, url: str) -> dict:
        async with s.get(url) as r:
            text = await r.text()
            try:
                body = json.loads(text)
            except ValueError:  # a proxy's error page
                body = {"body": text[:200]}
            if r.status >= 400:  # a poll is not a request of its own unless it fails
                self.note("batch", r.status, json.dumps(body)[:200])
            return body if r.status == 200 else {}

    async def _download(self, s: aiohttp.ClientSession, url: str, status: dict) -> None:
        """Each item of a job: its audio (200) or its error (the status speech would have answered; a 5xx item
        counts as a server failure), cancelled ones (409) left alone."""
        for i in range(status.get("total", 0)):
            async with s.get(f"{url}/items/{i}") as r:
                data = await r.read()
                if r.status == 200:
                    self.batch_items["downloaded"] += 1
                    self.note("batch", 200)
                elif r.status != 409:  # 409: cancelled (or, for an ended job, never)
                    self.batch_items["failed"] += 1
                    self.note("batch", r.status, data[:200].decode(errors="replace"))

    async def worker(self, s: aiohttp.ClientSession, until: float) -> None:
        kinds = [k for k in KINDS if k != "voice" or self.base]
        while time.monotonic() < until:
            kind = random.choice(kinds)
            if kind == "batch" and len(self.jobs) + self.jobs_submitting >= self.args.batch_jobs:
                kind = "whole"  # enough jobs wait for idle capacity: a backlog that only grows measures nothing
            try:
                if kind == "whole":
                    await self.whole(s)
                elif kind in ("stream", "sse"):
                    await self.stream(s, kind == "sse")
                elif kind == "websocket":
                    await self.websocket(s)
                elif kind == "batch":
                    await self.batch(s)
                else:
                    await self.voice(s)
            except (TimeoutError, aiohttp.ClientError) as e:
                self.note(kind, 599, repr(e))  # the connection failed: counted as a server failure


def summarize(args, soak: Soak, samples: list[dict], warm: dict | None) -> dict:
    last = samples[-1]
    warm = warm or samples[0]
    growth = {k: round((last["rss_mib"][k] / v - 1) * 100, 2) for k, v in warm["rss_mib"].items()
              if k in last["rss_mib"]}
    gpu_growth = [round((b / a - 1) * 100, 2) for a, b in zip(warm["gpu_mem_mib"], last["gpu_mem_mib"], strict=False)
                  if a]  # a sample nvidia-smi missed is shorter: its GPUs are not compared
    return {"url": args.url, "minutes": round(last["t_s"] / 60, 2), "concurrency": args.concurrency,
            "frames": args.frames, "requests": sum(soak.kinds.values()), "by_kind": dict(soak.kinds),
            "by_status": dict(soak.status), "errors_5xx": sum(n for st, n in soak.status.items() if int(st) >= 500),
            "client_disconnects": soak.disconnects, "batch_items": dict(soak.batch_items), "failures": soak.failures,
            "rss_growth_pct": growth, "rss_growth_pct_max": max(growth.values(), default=0.0),
            "gpu_mem_growth_pct": gpu_growth, "gpu_mem_growth_pct_max": max(gpu_growth, default=0.0),
            "replaced_processes": sorted(set(warm["rss_mib"]) ^ set(last["rss_mib"])),
            "samples": samples}


async def run(args) -> dict:
    """The soak; with `--out`, the report so far is rewritten at every sample (a run cut short keeps it)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.timeout),
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        async with s.get(f"{args.url}/v1/audio/voices") as r:
            models = {m: v["task_type"] for m, v in (await r.json())["models"].items()}
        soak = Soak(args, models)
        start = time.monotonic()
        until = start + args.minutes * 60
        workers = [asyncio.create_task(soak.worker(s, until)) for _ in range(args.concurrency)]
        workers.append(asyncio.create_task(soak.follow_jobs(s, until)))
        samples, warm, pending = [], None, set(workers)
        while pending:
            left = until - time.monotonic()
            _, pending = await asyncio.wait(pending, timeout=min(args.sample_s, left) if left > 1 else args.sample_s)
            elapsed = time.monotonic() - start
            samples.append({"t_s": round(elapsed), "requests": sum(soak.kinds.values()), "rss_mib": rss_mib(),
                            "gpu_mem_mib": await asyncio.to_thread(gpu_mem_mib)})
            if warm is None and elapsed >= args.warmup_s:
                warm = samples[-1]
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(summarize(args, soak, samples, warm), f, indent=1)
            if args.progress:
                print(f"[soak {elapsed / 60:.1f} min] {sum(soak.kinds.values())} requests, status {dict(soak.status)}",
                      flush=True)
        await asyncio.gather(*workers)
    return summarize(args, soak, samples, warm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--frames", type=int, default=24, help="frames per request (80 ms each)")
    ap.add_argument("--disconnect", type=float, default=0.1, help="share of streams the client drops mid-way")
    ap.add_argument("--batch-items", type=int, default=3, help="items per batch job")
    ap.add_argument("--batch-jobs", type=int, default=4, help="unfinished batch jobs at most (then other work)")
    ap.add_argument("--warmup-s", type=float, default=120, help="RSS growth counts from the first sample after this")
    ap.add_argument("--sample-s", type=float, default=30)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    report = asyncio.run(run(args))
    summary = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
