"""Uploaded voices on disk: the reference clip, its transcript, and each Base model's clone prompt, cached.

Layout (one directory per voice, written to a temporary name and renamed, so readers never see half):

    <voices_dir>/<name>/meta.json                  name, uid, created_at, ref_text, owner, consent, ...
    <voices_dir>/<name>/audio                      the uploaded bytes, as received
    <voices_dir>/<name>/prompt-<fingerprint>.npz   VoiceClonePrompt for the weights with that fingerprint

A clone prompt is computed once per (voice, checkpoint) and reused across requests and restarts.
Several ingress replicas may share the directory; the in-memory cache is keyed by the voice's `uid`,
so a re-upload or delete elsewhere is noticed at the next request.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from stages.contract import VoiceClonePrompt

VOICE_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,63}$")


@dataclass(frozen=True)
class VoiceRecord:
    name: str
    uid: str
    created_at: int
    ref_text: str | None
    x_vector_only_mode: bool
    file_size: int
    mime_type: str | None
    owner: str | None = None  # the uploader's API key id (sha256), None when the server had no keys
    consent: str | None = None  # the speaker's consent as the uploader gave it (OpenAI: a consent id)

    def public(self) -> dict:
        d = asdict(self)
        del d["uid"], d["owner"]
        return d


class VoiceStore:
    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self._prompts: dict[tuple[str, str, str], VoiceClonePrompt] = {}  # (name, uid, fingerprint) -> prompt

    # ------------------------------------------------------------------ records
    def list(self) -> list[VoiceRecord]:
        records = []
        for meta in sorted(self.root.glob("*/meta.json")):
            record = self._read(meta.parent.name)
            if record is not None:
                records.append(record)
        return records

    def get(self, name: str) -> VoiceRecord | None:
        if not VOICE_NAME_PATTERN.match(name):
            return None
        return self._read(name)

    def find(self, name: str, usable: Callable[[VoiceRecord], bool] = lambda _r: True) -> VoiceRecord | None:
        """Case-insensitive lookup (request voices are case-insensitive, like preset speakers) of a voice `usable`
        says the caller may see (its exact name first). Blocking: the ingress calls it in a thread. A miss costs
        one directory listing (voice directories bear their names)."""
        if not VOICE_NAME_PATTERN.match(name):
            return None
        record = self._read(name)
        if record is not None and usable(record):
            return record
        lowered = name.lower()
        with os.scandir(self.root) as entries:
            matches = sorted(e.name for e in entries if e.name.lower() == lowered and e.name != name)
        return next((r for r in map(self._read, matches) if r is not None and usable(r)), None)

    def audio(self, record: VoiceRecord) -> bytes:
        return (self.root / record.name / "audio").read_bytes()

    def save(
        self, name: str, audio: bytes, ref_text: str | None, x_vector_only_mode: bool, mime_type: str | None,
        prompts: dict[str, VoiceClonePrompt], owner: str | None = None, consent: str | None = None,
    ) -> VoiceRecord:
        """Write (or replace) a voice with the clone prompts already computed for `{fingerprint: prompt}`."""
        record = VoiceRecord(name=name, uid=uuid.uuid4().hex, created_at=int(time.time()), ref_text=ref_text,
                             x_vector_only_mode=x_vector_only_mode, file_size=len(audio), mime_type=mime_type,
                             owner=owner, consent=consent)
        tmp = self.root / f".{name}.{record.uid}.tmp"
        tmp.mkdir(parents=True)
        (tmp / "audio").write_bytes(audio)
        for fingerprint, prompt in prompts.items():
            _write_prompt(tmp / f"prompt-{fingerprint}.npz", prompt)
        (tmp / "meta.json").write_text(json.dumps(asdict(record)), encoding="utf-8")
        final = self.root / name
        if final.exists():
            old = self.root / f".{name}.{record.uid}.old"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        for fingerprint, prompt in prompts.items():
            self._prompts[(name, record.uid, fingerprint)] = prompt
        return record

    def delete(self, name: str) -> bool:
        record = self.get(name)
        if record is None:
            return False
        gone = self.root / f".{name}.{record.uid}.deleted"
        os.replace(self.root / name, gone)
        shutil.rmtree(gone, ignore_errors=True)
        self._forget(name)
        return True

    # ------------------------------------------------------------------ clone prompts
    def prompt(self, record: VoiceRecord, fingerprint: str) -> VoiceClonePrompt | None:
        key = (record.name, record.uid, fingerprint)
        if key in self._prompts:
            return self._prompts[key]
        path = self.root / record.name / f"prompt-{fingerprint}.npz"
        if not path.exists():
            return None
        prompt = _read_prompt(path)
        self._prompts[key] = prompt
        return prompt

    def put_prompt(self, record: VoiceRecord, fingerprint: str, prompt: VoiceClonePrompt) -> None:
        """Cache a prompt computed later (a model added after the upload)."""
        directory = self.root / record.name
        tmp = directory / f".prompt-{fingerprint}.{uuid.uuid4().hex}.npz"
        _write_prompt(tmp, prompt)
        os.replace(tmp, directory / f"prompt-{fingerprint}.npz")
        self._prompts[(record.name, record.uid, fingerprint)] = prompt

    # ------------------------------------------------------------------ internals
    def _read(self, name: str) -> VoiceRecord | None:
        try:
            data = json.loads((self.root / name / "meta.json").read_text(encoding="utf-8"))
        except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
            return None
        record = VoiceRecord(**data)
        self._drop_stale(record)
        return record

    def _drop_stale(self, record: VoiceRecord) -> None:
        stale = [k for k in self._prompts if k[0] == record.name and k[1] != record.uid]
        for k in stale:
            del self._prompts[k]

    def _forget(self, name: str) -> None:
        for k in [k for k in self._prompts if k[0] == name]:
            del self._prompts[k]


def _write_prompt(path: Path, prompt: VoiceClonePrompt) -> None:
    arrays = {"x_vector": np.asarray(prompt.x_vector, dtype=np.float32)}
    if prompt.ref_codes is not None:
        arrays["ref_codes"] = np.asarray(prompt.ref_codes, dtype=np.int64)
    if prompt.ref_text_ids is not None:
        arrays["ref_text_ids"] = np.asarray(prompt.ref_text_ids, dtype=np.int64)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _read_prompt(path: Path) -> VoiceClonePrompt:
    with np.load(path) as data:
        return VoiceClonePrompt(
            x_vector=data["x_vector"],
            ref_codes=data["ref_codes"] if "ref_codes" in data else None,
            ref_text_ids=tuple(int(i) for i in data["ref_text_ids"]) if "ref_text_ids" in data else None,
        )
