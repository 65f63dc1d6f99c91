"""Submit a JSONL file of speech requests as one batch job, follow it, and download its audio.

    python -m deployments.ingress.batch_cli requests.jsonl out/ --url http://127.0.0.1:8000
    python -m deployments.ingress.batch_cli requests.jsonl out/ --url ... --resume batch_<id>   # after Ctrl-C

Each line of the file is a `/v1/audio/speech` body. Progress shows as a bar (tqdm, when installed) or one line.
Once the job has ended, item i's audio is written to `out/<i>.<format>` (streamed to disk), and every failed
item's error to `out/errors.jsonl`. Ctrl-C leaves the job running on the server (`--resume` picks it up);
`--cancel-on-interrupt` cancels it instead. Exit status: 0 when every item completed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

ENDED = ("completed", "failed", "cancelled")
API = "/v1/audio/speech/batches"


class Progress:
    """tqdm when it is installed, else one line rewritten in place."""

    def __init__(self, total: int):
        self.total, self._shown = total, -1
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, unit="item", file=sys.stderr)

    def update(self, job: dict) -> None:
        done = job["completed"] + job["failed"]
        if self._bar is not None:
            self._bar.set_postfix(running=job["running"], failed=job["failed"], refresh=False)
            self._bar.update(done - self._bar.n)
        elif done != self._shown:
            print(f"\r{done}/{self.total} done ({job['failed']} failed, {job['running']} running)", end="",
                  file=sys.stderr, flush=True)
        self._shown = done

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            print(file=sys.stderr)


def submit(client: httpx.Client, path: Path) -> dict:
    r = client.post(API, content=path.read_bytes(), headers={"content-type": "application/x-ndjson"})
    if r.status_code != 202:
        raise SystemExit(f"submission refused: {r.status_code} {r.text}")
    return r.json()


def follow(client: httpx.Client, job_id: str, poll_s: float) -> dict:
    job = _status(client, job_id)
    progress = Progress(job["total"])
    try:
        while True:
            progress.update(job)
            if job["status"] in ENDED:
                return job
            time.sleep(poll_s)
            job = _status(client, job_id)
    finally:
        progress.close()


def download(client: httpx.Client, job: dict, out: Path) -> tuple[int, int]:
    """Every completed item's audio into `out`, every failed item's error into errors.jsonl; -> (saved, failed)."""
    out.mkdir(parents=True, exist_ok=True)
    saved = failed = 0
    with open(out / "errors.jsonl", "w", encoding="utf-8") as errors:
        for index in range(job["total"]):
            with client.stream("GET", f"{API}/{job['id']}/items/{index}") as r:
                if r.status_code == 200:
                    name = _filename(r.headers.get("content-disposition", ""), index)
                    tmp = out / f".{name}.part"
                    with open(tmp, "wb") as f:
                        for data in r.iter_bytes():
                            f.write(data)
                    tmp.replace(out / name)
                    saved += 1
                    continue
                body = json.loads(r.read() or b"{}")
                if body.get("error", {}).get("code") != "cancelled":
                    errors.write(json.dumps({"index": index, "status": r.status_code, **body}) + "\n")
                    failed += 1
    return saved, failed


def _filename(disposition: str, index: int) -> str:
    """`<index>.<format>` from the server's attachment name (`<batch>-<index>.<format>`)."""
    for part in disposition.split(";"):
        key, _, value = part.strip().partition("=")
        if key == "filename":
            return f"{index}.{value.strip(chr(34)).rsplit('.', 1)[-1]}"
    return f"{index}.audio"


def _status(client: httpx.Client, job_id: str) -> dict:
    for attempt in range(5):  # the store may answer 503 for a moment (retry as Retry-After says)
        r = client.get(f"{API}/{job_id}")
        if r.status_code != 503:
            break
        time.sleep(float(r.headers.get("retry-after", 1)) * (attempt + 1))
    if r.status_code != 200:
        raise SystemExit(f"status of {job_id}: {r.status_code} {r.text}")
    return r.json()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path, help="JSONL: one /v1/audio/speech body a line")
    parser.add_argument("out", type=Path, help="directory for the audio (<index>.<format>) and errors.jsonl")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--poll-s", type=float, default=2.0, help="seconds between status polls")
    parser.add_argument("--resume", metavar="BATCH_ID", help="follow a job submitted before instead of submitting")
    parser.add_argument("--cancel-on-interrupt", action="store_true", help="Ctrl-C cancels the job")
    args = parser.parse_args(argv)
    with httpx.Client(base_url=args.url, timeout=60) as client:
        job_id = args.resume or submit(client, args.file)["id"]
        print(f"batch {job_id}", file=sys.stderr)
        try:
            job = follow(client, job_id, args.poll_s)
        except KeyboardInterrupt:
            if args.cancel_on_interrupt:
                client.delete(f"{API}/{job_id}")
                print(f"cancelled {job_id}", file=sys.stderr)
            else:
                print(f"the job keeps running; resume with --resume {job_id}", file=sys.stderr)
            return 130
        saved, failed = download(client, job, args.out)
    print(f"{job['status']}: {saved} items saved to {args.out}, {failed} failed"
          + (f" (see {args.out / 'errors.jsonl'})" if failed else ""), file=sys.stderr)
    return 0 if saved == job["total"] else 1


if __name__ == "__main__":
    sys.exit(main())
