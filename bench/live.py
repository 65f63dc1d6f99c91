"""Live text over the WebSocket (`/v1/audio/speech/stream`): text fed a word at a time, as an LLM writes it.

Each connection speaks utterances one after another: `open`, then one word every `--word-interval-s`
(0.1 s, an LLM writing ~13 tokens/s), then `end`. Words go as an LLM's tokens (" word"), so the server holds each
last word until the next begins (it could still grow: stages/text_stream.py), and first audio includes one word
interval; `--pieces trailing-space` sends "word " instead, as a client that cuts its text at word ends would.
Per utterance: time from the first word sent to the first audio received, and whether it plays gap-free (a player
that starts at its first audio and plays in real time never falls more than 100 ms behind: bench/loadgen/metrics.py).
Per level (connections at once): p50/p95 of that time, the gap-free share, audio-s/s, and where the server's part of
it went: each context's `done` carries its first audio's stages from its first text (`first_audio_ms`,
deployments/first_audio_timing.py), here as p50/p95 per stage, with `client_side` the rest of the client's time (the
socket both ways) and `open`, the part of it the server spent on the context's `open` before it read the first word.

`--processes N` spreads a level's connections over N worker processes that start together: one event loop reading
128 sockets' audio falls behind, and its lag lands in `client_side` and in the gap-free share (a frame read late
looks like a gap). Each level reports its worst event-loop lag (`client_loop_lag_ms`), as `bench.loadgen` does.

    python -m bench.live --url http://127.0.0.1:8000 --connections 1,64 --utterances 4 --processes 8 --out results/live
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import shlex
import sys
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.loadgen.metrics import CONTINUITY_THRESHOLD_S, Stats, audio_seconds, continuity
from bench.loadgen.report import stage_table
from bench.loadgen.runner import lag_monitor
from bench.loadgen.sentences import load_sentences
from deployments.ingress.schemas import parse_audio_frame


@dataclass
class Utterance:
    words: int
    first_audio_s: float | None = None  # first word sent -> first audio received
    audio_s: float = 0.0
    max_deficit_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    arrivals: list[tuple[float, float]] = field(default_factory=list)  # (arrival, audio seconds) per frame
    stages_ms: dict[str, float] = field(default_factory=dict)  # the server's first audio by stage (its `done`)
    open_ms: float | None = None  # the server's handling of the `open`, before it read the first word


async def _utterance(ws, cid: str, text: str, args) -> Utterance:
    words = text.split()
    u = Utterance(len(words))
    await ws.send(json.dumps({"type": "open", "context_id": cid, "model": args.model, "voice": args.voice,
                              "response_format": "pcm", "max_new_tokens": args.frames, "suppress_eos": True}))

    async def feed() -> float:
        t0 = time.perf_counter()
        for i, word in enumerate(words):
            if i:
                await asyncio.sleep(max(0.0, t0 + i * args.word_interval_s - time.perf_counter()))
            piece = word + " " if args.pieces == "trailing-space" else (" " if i else "") + word
            await ws.send(json.dumps({"type": "append", "context_id": cid, "text": piece}))
        await ws.send(json.dumps({"type": "end", "context_id": cid}))
        return t0

    feeder = asyncio.create_task(feed())
    try:
        async for raw in ws:
            now = time.perf_counter()
            if isinstance(raw, bytes):
                _, audio = parse_audio_frame(raw)
                u.arrivals.append((now, audio_seconds(len(audio))))
                continue
            message = json.loads(raw)
            if message["type"] == "done":
                u.finish_reason = message["finish_reason"]
                u.stages_ms = message.get("first_audio_ms", {})
                u.open_ms = message.get("open_ms")
                break
            if message["type"] == "error":
                u.error = message["error"]["message"]
                break
    finally:
        t0 = await feeder if feeder.done() or u.error is None else None
        feeder.cancel()
    if u.arrivals and t0 is not None:
        u.first_audio_s = u.arrivals[0][0] - t0
        u.audio_s = sum(a for _, a in u.arrivals)
        u.max_deficit_s = continuity([t for t, _ in u.arrivals], [a for _, a in u.arrivals]).max_deficit_s
        if "total" in u.stages_ms:
            u.stages_ms["client_side"] = u.first_audio_s * 1000 - u.stages_ms["total"]
            if u.open_ms is not None:  # part of client_side: the first word waited unread while the open ran
                u.stages_ms["open"] = u.open_ms
    u.arrivals = []
    return u


async def _connection(url: str, index: int, texts: list[str], args) -> list[Utterance]:
    from websockets.asyncio.client import connect

    out = []
    async with connect(url, max_size=None) as ws:
        for k in range(args.utterances):
            out.append(await _utterance(ws, f"c{index}-{k}", texts[(index + k) % len(texts)], args))
    return out


async def _connections(url: str, first: int, count: int, texts: list[str], args) -> tuple[list[list[Utterance]],
                                                                                           list[float]]:
    """Connections `first`..`first + count - 1` at once -> (their utterances, this loop's lag samples in s)."""
    lag: list[float] = []
    monitor = asyncio.create_task(lag_monitor(lag))
    try:
        results = await asyncio.gather(*(_connection(url, i, texts, args) for i in range(first, first + count)))
    finally:
        monitor.cancel()
    return list(results), lag


def _worker(url: str, first: int, count: int, texts: list[str], args: dict, barrier, out) -> None:
    barrier.wait()  # every worker (and the parent's clock) starts together
    try:
        out.put((first, *asyncio.run(_connections(url, first, count, texts, types.SimpleNamespace(**args)))))
    except BaseException as e:  # reported by the parent, which would otherwise wait forever
        out.put((first, e, []))


def _in_processes(url: str, connections: int, texts: list[str], args, processes: int
                  ) -> tuple[list[list[Utterance]], list[float], float]:
    """The level's connections spread over `processes` spawned workers -> (utterances by connection, lag, wall)."""
    import bench.live as this  # by its import name: workers' results unpickle here even when run as __main__

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no event loop or threads inherited
    barrier, out = ctx.Barrier(processes + 1), ctx.Queue()
    shares = [connections // processes + (k < connections % processes) for k in range(processes)]
    fields = {k: getattr(args, k) for k in ("model", "voice", "frames", "word_interval_s", "utterances", "pieces")}
    workers, first = [], 0
    for share in shares:
        workers.append(ctx.Process(target=this._worker, args=(url, first, share, texts, fields, barrier, out), daemon=True))
        first += share
    for w in workers:
        w.start()
    barrier.wait()
    t0 = time.perf_counter()
    parts = [out.get() for _ in workers]  # each worker puts exactly one result
    wall = time.perf_counter() - t0
    for w in workers:
        w.join()
    if failed := [p[1] for p in parts if isinstance(p[1], BaseException)]:
        raise RuntimeError(f"{len(failed)} live bench worker(s) failed: {failed[0]!r}") from failed[0]
    results = [r for _, rs, _ in sorted(parts, key=lambda p: p[0]) for r in rs]
    return results, [x for _, _, lag in parts for x in lag], wall


async def run_level(url: str, connections: int, texts: list[str], args) -> dict:
    """One level: `connections` sockets at once (spread over `args.processes` workers when > 1)."""
    processes = min(getattr(args, "processes", 1), connections)
    if processes > 1:
        results, lag, wall = await asyncio.to_thread(_in_processes, url, connections, texts, args, processes)
    else:
        t0 = time.perf_counter()
        results, lag = await _connections(url, 0, connections, texts, args)
        wall = time.perf_counter() - t0
    utterances = [u for r in results for u in r]
    ok = [u for u in utterances if u.error is None and u.first_audio_s is not None]
    first = Stats.of(u.first_audio_s * 1000 for u in ok)
    # each connection's first utterance apart: a cost paid once per connection (or replica) shows here
    opening = Stats.of(r[0].first_audio_s * 1000 for r in results if r and r[0].first_audio_s is not None)
    gap_free = [u.max_deficit_s <= CONTINUITY_THRESHOLD_S for u in ok]
    names = list(dict.fromkeys(name for u in ok for name in u.stages_ms))  # path order, as the server sent them
    stages = {name: {"p50": st.p50, "p95": st.p95, "n": st.n}
              for name in names if (st := Stats.of(u.stages_ms[name] for u in ok if name in u.stages_ms)).n}
    return {
        "connections": connections, "processes": processes, "utterances": len(utterances),
        "errors": len(utterances) - len(ok),
        "first_word_to_audio_ms": asdict(first), "first_utterance_of_connection_ms": asdict(opening),
        "gap_free_share": sum(gap_free) / len(gap_free) if gap_free else None,
        "audio_s_per_s": sum(u.audio_s for u in ok) / wall, "wall_s": wall,
        "client_loop_lag_ms": {"p99": Stats.of(x * 1000 for x in lag).p99, "max": max(lag, default=0.0) * 1000},
        "first_audio_stages_ms": stages,
        "error_examples": sorted({u.error for u in utterances if u.error})[:3],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--connections", default="1,64", help="levels: connections at once")
    p.add_argument("--utterances", type=int, default=4, help="utterances per connection, one after another")
    p.add_argument("--word-interval-s", type=float, default=0.1)
    p.add_argument("--frames", type=int, default=75, help="max_new_tokens of each utterance (EOS suppressed)")
    p.add_argument("--model", default=None)
    p.add_argument("--voice", default="vivian")
    p.add_argument("--pieces", choices=("leading-space", "trailing-space"), default="leading-space",
                   help="each word sent as ' word' (an LLM's tokens: the server holds the last word until the next "
                        "begins, since it could still grow) or as 'word ' (ends at a word boundary: final at once)")
    p.add_argument("--processes", type=int, default=1, help="worker processes a level's connections are spread over")
    p.add_argument("--out", type=Path, default=None, help="directory for live.json and live.md")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    url = args.url.replace("http://", "ws://").replace("https://", "wss://").rstrip("/") + "/v1/audio/speech/stream"
    texts = [s.text for s in load_sentences(language="en")]
    levels = []
    for c in (int(x) for x in args.connections.split(",")):
        level = asyncio.run(run_level(url, c, texts, args))
        first = level["first_word_to_audio_ms"]
        print(f"c={c}: first word -> audio p50 {first['p50'] or 0:.0f} ms, p95 {first['p95'] or 0:.0f} ms; gap-free "
              f"{(level['gap_free_share'] or 0) * 100:.0f}%; {level['audio_s_per_s']:.1f} audio-s/s; "
              f"{level['errors']} errors {level['error_examples']}; client loop lag max "
              f"{level['client_loop_lag_ms']['max']:.0f} ms ({level['processes']} process(es))", flush=True)
        levels.append(level)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        doc = {"command": "python -m bench.live " + shlex.join(sys.argv[1:] if argv is None else argv),
               "word_interval_s": args.word_interval_s, "pieces": args.pieces,
               "frames": args.frames, "levels": levels}
        (args.out / "live.json").write_text(json.dumps(doc, indent=1))
        rows = [f"| {lv['connections']} | {lv['first_word_to_audio_ms']['p50'] or 0:.0f} / "
                f"{lv['first_word_to_audio_ms']['p95'] or 0:.0f} | {(lv['gap_free_share'] or 0) * 100:.0f}% | "
                f"{lv['audio_s_per_s']:.1f} | {lv['errors']} | {lv['client_loop_lag_ms']['max']:.0f} "
                f"({lv['processes']}) |" for lv in levels]
        (args.out / "live.md").write_text("| connections | first word -> audio p50 / p95 (ms) | gap-free | "
                                          "audio-s/s | errors | client loop lag max ms (processes) |\n"
                                          "|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n"
                                          + _stages_table(levels))
    return 0


def _stages_table(levels: list[dict]) -> str:
    """The first audio by stage, p50 / p95 ms per level (the server's stages, then the client's rest)."""
    lines = stage_table("First audio by stage from the first text (the contexts' `done`: "
                        "deployments/first_audio_timing.py), p50 / p95 ms:", "connections",
                        [(str(lv["connections"]), lv["first_audio_stages_ms"]) for lv in levels])
    return "\n".join(lines) + "\n" if lines else ""


if __name__ == "__main__":
    raise SystemExit(main())
