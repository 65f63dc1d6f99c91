"""The command line the burst benches share (bench/text_path_burst.py, bench/talker_call_burst.py): burst sizes and
counts in, a local Ray cluster for the measurement, its JSON out."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path


def burst_main(argv: list[str] | None, doc: str, measure: Callable[..., dict], sizes: str,
               sizes_help: str, bursts: int, kinds: tuple[str, ...] = ()) -> int:
    """`measure(sizes, bursts)` on a fresh local Ray cluster (4 logical CPUs); `--out` gets its JSON. With `kinds`,
    `--kind` (the first by default) goes to `measure` as `kind`."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=sizes, help=sizes_help)
    p.add_argument("--bursts", type=int, default=bursts)
    p.add_argument("--out", type=Path, default=None)
    if kinds:
        p.add_argument("--kind", choices=kinds, default=kinds[0])
    args = p.parse_args(argv)
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    try:
        extra = {"kind": args.kind} if kinds else {}
        out = measure([int(x) for x in args.sizes.split(",")], args.bursts, **extra)
    finally:
        ray.shutdown()
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1))
    return 0
