"""Results as JSON (`results.json`), a markdown table (`results.md`) and PNG plots (matplotlib, optional).

The markdown and the plots are rendered from the JSON document alone, so they can be redrawn later:

    python -m bench.loadgen.report OUT_DIR/results.json [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .runner import SweepOutcome
from .summary import request_metrics

PLOTS = ("latency.png", "throughput.png", "continuity.png")


def build_document(meta: dict[str, Any], outcome: SweepOutcome, resume_s: float = 0.0) -> dict[str, Any]:
    points = []
    for run, summary in zip(outcome.runs, outcome.summaries, strict=True):
        point = summary.to_dict()
        point["request_rows"] = [asdict(request_metrics(r, resume_s)) for r in run.results]
        points.append(point)
    return {"meta": meta, "stop_reason": outcome.stop_reason, "points": points}


def write_results(doc: dict[str, Any], out: Path, plots: bool = True) -> list[Path]:
    """results.json + results.md (+ PNGs); returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False))
    (out / "results.md").write_text(markdown(doc))
    written = [out / "results.json", out / "results.md"]
    if plots:
        written += plot(doc, out)
    return written


# --------------------------------------------------------------------------------------------- markdown
def _f(x: float | None, digits: int = 0) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def level_name(mode: str) -> str:
    return "c" if mode == "closed" else "r (req/s)"


def markdown(doc: dict[str, Any]) -> str:
    meta, points = doc["meta"], doc["points"]
    mode = meta.get("sweep", {}).get("mode", points[0]["mode"] if points else "closed")
    s = meta.get("settings", {})
    lines = [
        f"### {'Closed loop (fixed concurrency)' if mode == 'closed' else 'Open loop (Poisson arrivals)'}"
        f"{' - ' + meta['label'] if meta.get('label') else ''}",
        "",
        f"{meta.get('date', '')}, `{meta.get('url', '')}`, model `{s.get('model')}`, voice `{s.get('voice')}`, "
        f"{s.get('response_format')}/{s.get('stream_format')}, max_new_tokens {s.get('max_new_tokens')}"
        f"{' (fixed length: EOS suppressed)' if s.get('fixed_length') else ''}, texts: {meta.get('texts', '')}.",
        f"Command: `{meta.get('command', '')}`",
        "",
        f"| {level_name(mode)} | ok / done | failures | TTFA p50 / p90 / p95 / p99 (ms) | E2E p50 / p95 / p99 (ms) "
        "| RTF p50 / p95 | audio-s/s | req/s | continuous (deficit ≤ 100 ms) | max deficit p95 / p99 (s) "
        "| stalls / stream, stall time p95 (s) (rebuffer) | peak in flight |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        t, e, rtf, d = p["ttfa_ms"], p["e2e_ms"], p["rtf"], p["max_deficit_s"]
        fails = ", ".join(f"{k} {v}" for k, v in p["failures"].items()) or "0"
        if p["aborted"]:
            fails += f"; aborted {p['aborted']}"
        lines.append(
            f"| {p['level']:g}{' (cut)' if p['truncated'] else ''} | {p['ok']} / {p['ok'] + p['failed']} | {fails} "
            f"| {_f(t['p50'])} / {_f(t['p90'])} / {_f(t['p95'])} / {_f(t['p99'])} "
            f"| {_f(e['p50'])} / {_f(e['p95'])} / {_f(e['p99'])} | {_f(rtf['p50'], 3)} / {_f(rtf['p95'], 3)} "
            f"| {_f(p['audio_s_per_s'], 1)} | {_f(p['requests_per_s'], 2)} | {_pct(p['continuous_share'])} "
            f"| {_f(d['p95'], 3)} / {_f(d['p99'], 3)} | {_f(p['stalls_mean'], 2)}, {_f(p['stall_s']['p95'], 3)} "
            f"| {p['peak_inflight']} |")
    lines += _stage_table(points)
    lines += _connection_table(points)
    lag = max((p["loop_lag_ms"]["max"] or 0.0 for p in points), default=0.0)
    late = max((p["send_lag_ms"]["max"] or 0.0 for p in points), default=0.0)
    lines += ["", f"Stopped: {doc.get('stop_reason') or 'all levels ran'}. "
              f"Load generator ({doc['meta'].get('processes', 1)} process(es) reading streams) event-loop lag, "
              f"worst: {lag:.0f} ms; latest send after its due time: {late:.0f} ms"
              f"{' (high: the client may inflate latencies)' if max(lag, late) > 50 else ''}.", ""]
    return "\n".join(lines)


def _stage_table(points: list[dict[str, Any]]) -> list[str]:
    """First audio by stage (the responses' Server-Timing), p50 / p95 ms per level; nothing if no server sent it."""
    return stage_table("First audio by stage (`Server-Timing`, deployments/first_audio_timing.py), p50 / p95 ms:",
                       "level", [(f"{p['level']:g}", p.get("server_timing_ms", {})) for p in points])


def stage_table(title: str, column: str, rows: list[tuple[str, dict[str, dict]]]) -> list[str]:
    """A table of stages' p50 / p95 (ms), one row per `(label, {stage: Stats as a dict})`, the stages in the order
    they first appear; nothing if no row has any (bench.loadgen's Server-Timing, bench.live's `first_audio_ms`)."""
    stages = list(dict.fromkeys(stage for _, by_stage in rows for stage in by_stage))
    if not stages:
        return []
    lines = ["", title, "", f"| {column} | " + " | ".join(stages) + " |", "|---:|" + "---:|" * len(stages)]
    for label, by_stage in rows:
        cells = []
        for stage in stages:
            st = by_stage.get(stage)
            cells.append(f"{_f(st['p50'], 1)} / {_f(st['p95'], 1)}" if st and st["n"] else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _connection_table(points: list[dict[str, Any]]) -> list[str]:
    """Per level: how many ok requests opened a connection, its setup, and the client's share of first audio
    (`client_side`) on new against kept-alive connections; nothing if the client did not trace connections."""
    if not any(p.get("new_connections") or (p.get("client_side_kept_ms") or {}).get("n") for p in points):
        return []
    lines = ["", "Client connections (aiohttp tracing), ms p50 / p95:", "",
             "| level | ok on a new connection | connect | client_side, new connection | client_side, kept alive |",
             "|---:|---:|---:|---:|---:|"]
    for p in points:
        cells = [f"{_f(p[k]['p50'], 1)} / {_f(p[k]['p95'], 1)}" if p[k]["n"] else "-"
                 for k in ("connect_ms", "client_side_new_ms", "client_side_kept_ms")]
        lines.append(f"| {p['level']:g} | {p['new_connections']} / {p['ok']} | " + " | ".join(cells) + " |")
    return lines


# ------------------------------------------------------------------------------------------------ plots
def plot(doc: dict[str, Any], out: Path) -> list[Path]:
    """Three PNGs, or none when matplotlib is missing or there is nothing to draw."""
    points = [p for p in doc["points"] if p["ok"]]
    if not points:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return []
    mode = points[0]["mode"]
    x = [p["level"] for p in points]
    xlabel = "concurrent streams (closed loop)" if mode == "closed" else "arrival rate, requests/s (open loop)"
    title = doc["meta"].get("label") or ""
    written = []

    def axis(ax, ylabel: str, log_y: bool = False) -> None:
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{v:g}" for v in x])
        ax.minorticks_off()
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)

    def series(ax, key: str, quantiles: Sequence[str], scale: float = 1.0) -> None:
        for q in quantiles:
            ys = [p[key][q] * scale if p[key][q] is not None else float("nan") for p in points]
            ax.plot(x, ys, marker="o", label=q)

    def save(fig, name: str) -> None:
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    series(a, "ttfa_ms", ("p50", "p90", "p95", "p99"))
    a.set_title("time to first audio")
    axis(a, "ms", log_y=True)
    series(b, "e2e_ms", ("p50", "p90", "p95", "p99"))
    b.set_title("end-to-end latency")
    axis(b, "ms", log_y=True)
    save(fig, "latency.png")

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.plot(x, [p["audio_s_per_s"] for p in points], marker="o", label="audio-s/s")
    a.plot(x, [p["requests_per_s"] for p in points], marker="s", label="requests/s")
    if mode == "open":  # what the arrivals ask for: rate x mean audio length
        a.plot(x, [p["level"] * (p["audio_len_s"]["mean"] or 0.0) for p in points], ls="--", color="gray",
               label="offered audio-s/s")
    a.set_title("throughput")
    axis(a, "per second of wall time")
    series(b, "rtf", ("p50", "p95", "p99"))
    b.axhline(1.0, color="k", lw=0.8, ls="--")
    b.set_title("real-time factor (latency / audio duration)")
    axis(b, "RTF")
    save(fig, "throughput.png")

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.plot(x, [p["continuous_share"] for p in points], marker="o", label="max deficit <= 100 ms (no rebuffer)")
    a.plot(x, [p.get("stall_ok_share") for p in points], marker="s", label="stalled <= 100 ms in all (rebuffering)")
    a.plot(x, [p["stall_free_share"] for p in points], marker="^", ls=":", label="no stall at all (rebuffering)")
    a.set_ylim(-0.02, 1.02)
    a.set_title("share of continuous streams")
    axis(a, "share of ok streams")
    series(b, "max_deficit_s", ("p50", "p95", "p99"))
    b.plot(x, [p["stall_s"]["p95"] for p in points], marker="x", ls=":", label="stall time p95 (rebuffer)")
    b.set_yscale("symlog", linthresh=0.01)
    b.axhline(0.1, color="k", lw=0.8, ls="--")
    b.set_title("playback deficit (underrun)")
    axis(b, "s")
    save(fig, "continuity.png")
    return written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="redraw results.md and the plots from a results.json")
    ap.add_argument("results", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="default: the folder of results.json")
    args = ap.parse_args(argv)
    doc = json.loads(args.results.read_text())
    out = args.out or args.results.parent
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(markdown(doc))
    for path in [out / "results.md", *plot(doc, out)]:
        print(path)


if __name__ == "__main__":
    main()
