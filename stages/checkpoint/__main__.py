"""`python -m stages.checkpoint`: write a random-weight checkpoint, or load one strictly and say what it holds.

    python -m stages.checkpoint random OUT --size 0.6b|1.7b --kind custom_voice|base|voice_design \
        [--tiny] [--dtype bfloat16] [--device cpu] [--seed 0]
    python -m stages.checkpoint check PATH [--device cpu]
"""

from __future__ import annotations

import argparse

from stages.qwen3_tts import Qwen3TTS
from stages.random_checkpoint import write_random_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.checkpoint", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    rnd = sub.add_parser("random", help="write a random-weight checkpoint in the Hugging Face layout")
    rnd.add_argument("out")
    rnd.add_argument("--size", default="0.6b", choices=["0.6b", "1.7b", "0b6", "1b7"])
    rnd.add_argument("--kind", default="custom_voice", choices=["custom_voice", "base", "voice_design"])
    rnd.add_argument("--tiny", action="store_true", help="tiny shapes for CPU tests and the embedded default")
    rnd.add_argument("--dtype", default="bfloat16")
    rnd.add_argument("--device", default="cpu")
    rnd.add_argument("--seed", type=int, default=0)
    chk = sub.add_parser("check", help="load a checkpoint strictly and print what it holds")
    chk.add_argument("path")
    chk.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.command == "random":
        write_random_checkpoint(args.out, args.size, args.kind, tiny=args.tiny, dtype=args.dtype,
                                device=args.device, seed=args.seed)
    else:
        m = Qwen3TTS.load(args.path, device=args.device, dtype="float32", log=print)
        print(f"{m.path}: {m.config.model_size} {m.config.model_kind}; speakers={sorted(m.config.talker.speakers)}")


if __name__ == "__main__":
    main()
