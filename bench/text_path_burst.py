"""Live text's way into a Talker at a burst of new contexts, on a local Ray cluster (CPU; no model, no Serve).

N contexts open at once against one ingress replica's real `TextMailbox` (deployments/text_mailbox.py) and
one Talker replica's real `LiveTextPump` (deployments/talker/text_pump.py) inside an actor standing in for the
Talker. Per context, what the ingress and the Talker do: the Talker's side of the request starts (`add`, as
`Talker.generate_live_many` does for each of its requests; not awaited, as a Serve call is not), then the first
text is put (awaited, as the ingress awaits each put). Reported per burst size, p50 / p95 / max ms: the first text's
way from its put to the pump handing it to the engine (a live first audio's `to_talker_text` stage without the Serve
hop). Five bursts each.

    python -m bench.text_path_burst --sizes 1,8,32,64 --out text_path.json
"""

from __future__ import annotations

import asyncio
import time

import ray

from bench.burst_cli import burst_main
from bench.loadgen.metrics import Stats
from deployments.talker.text_pump import LiveTextPump
from deployments.text_mailbox import MailboxWriter, TextEvent, new_mailbox


class _FirstTextEngine:
    """The engine's text side as the pump calls it, noting when each request's first text came."""

    def __init__(self):
        self.first: dict[str, float] = {}

    def append_text(self, request_id: str, text: str) -> None:
        self.first.setdefault(request_id, time.time())

    def flush_text(self, request_id: str) -> None:
        pass

    def end_text(self, request_id: str) -> None:
        pass

    def abort(self, request_id: str) -> None:
        pass


@ray.remote(num_cpus=0)
class _Talker:
    def __init__(self, mailbox):
        self.engine = _FirstTextEngine()
        self.pump = LiveTextPump(self.engine, mailbox)

    async def add(self, request_id: str) -> None:
        self.pump.add(request_id)

    async def first_text(self) -> dict[str, float]:
        return dict(self.engine.first)

    async def remove(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.pump.remove(request_id)


async def _burst(writer: MailboxWriter, talker, n: int, tag: str) -> list[float]:
    put_at: dict[str, float] = {}

    async def one(i: int) -> None:
        request_id = f"{tag}-{i}"
        talker.add.remote(request_id)
        put_at[request_id] = time.time()
        await writer.put(request_id, [TextEvent("append", "hello")])  # as the ingress puts: coalesced

    await asyncio.gather(*(one(i) for i in range(n)))
    first = await talker.first_text.remote()
    while not all(r in first for r in put_at):
        await asyncio.sleep(0.01)  # another process's state: polled, with the whole burst bounded by the caller
        first = await talker.first_text.remote()
    await talker.remove.remote(list(put_at))
    for request_id in put_at:
        writer.close(request_id)
    return [(first[r] - put_at[r]) * 1000 for r in put_at]


async def run(sizes: list[int], bursts: int) -> dict[str, dict]:
    mailbox = new_mailbox()
    await mailbox.open_boxes.remote()
    talker, writer = _Talker.remote(mailbox), MailboxWriter(mailbox)
    await talker.first_text.remote()  # both actors' workers started before the first burst
    await _burst(writer, talker, 1, "warm")  # and the Talker's first contact with the mailbox made
    out = {}
    for n in sizes:
        ms = [x for k in range(bursts) for x in await asyncio.wait_for(_burst(writer, talker, n, f"{n}-{k}"), 120)]
        st = Stats.of(ms)
        out[str(n)] = {"p50": round(st.p50, 2), "p95": round(st.p95, 2), "max": round(st.max, 2), "n": st.n}
        print(f"{n} at once: first text put -> engine p50 / p95 / max {st.p50:.1f} / {st.p95:.1f} / {st.max:.1f} ms",
              flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    return burst_main(argv, __doc__, lambda sizes, bursts: asyncio.run(run(sizes, bursts)), "1,8,32,64",
                      "contexts opening at once", 5)


if __name__ == "__main__":
    raise SystemExit(main())
