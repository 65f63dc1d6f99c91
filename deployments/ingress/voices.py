"""Voices in the ingress: the clone prompt a speech request uses, and the `/v1/audio/voices` endpoints.

Uploaded voices live on disk (deployments/ingress/voice_store.py, `VoiceStore`); every read and write of it runs in a
thread, never on the event loop. A Base Talker computes clone prompts; the ingress caches them (uploaded
voices on disk per checkpoint fingerprint, inline `ref_audio` clips in memory).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Callable

from fastapi import Request
from ray.serve.handle import DeploymentHandle

from deployments import constants as C
from deployments.config import IngressConfig
from deployments.errors import APIError, bad_request, plain, shown, unwrap
from deployments.ingress.api_keys import ApiKey
from deployments.ingress.auth import may_change, may_use
from deployments.ingress.http_guard import OpenWork
from deployments.ingress.outcomes import Outcomes
from deployments.ingress.ref_audio import load_ref_audio, read_voice_upload, usable_clip
from deployments.ingress.request_builder import VoiceChoice
from deployments.ingress.routing import ModelRouter
from deployments.ingress.schemas import SpeechRequest
from deployments.ingress.voice_store import VOICE_NAME_PATTERN, VoiceRecord, VoiceStore
from deployments.messages import ModelInfo
from stages.contract import TaskType, VoiceClonePrompt

logger = logging.getLogger("ray.serve")

VoiceFinder = Callable[[str], VoiceRecord | None]  # uploaded voice by name (case-insensitive), or None


class Voices:
    def __init__(self, store: VoiceStore, router: ModelRouter, limits: IngressConfig, work: OpenWork,
                 outcomes: Outcomes):
        self._store, self._router, self._limits = store, router, limits
        self._work, self._outcomes = work, outcomes
        self._inline: OrderedDict[str, VoiceClonePrompt] = OrderedDict()

    # ------------------------------------------------------------------ speech requests
    async def finder(self, body: SpeechRequest, key: ApiKey | None = None) -> VoiceFinder:
        """The uploaded voices `body` may name, read from disk in a thread, as the lookup that request
        planning (deployments/ingress/request_builder.py) calls synchronously. A preset speaker's name is never an
        uploaded voice's: the requests of preset voices (most of them) skip the thread and the disk read, which
        under load waited for the event loop's GIL on both ends. Only voices `key` may use are found (others'
        are unknown to it)."""
        presets = self._router.preset_voices()
        aliases = self._router.voice_aliases

        def may_be_uploaded(name: str | None) -> bool:
            return _could_be_uploaded(name) and (presets is None or name.lower() not in presets) \
                and name.lower() not in aliases

        def usable(record: VoiceRecord) -> bool:
            return may_use(record.owner, key)

        names = {n for n in (body.voice, (body.voice or "").strip()) if may_be_uploaded(n)}
        found = await asyncio.to_thread(lambda: {n: self._store.find(n, usable) for n in names}) if names else {}

        def find(name: str) -> VoiceRecord | None:
            if name in found:
                return found[name]
            if may_be_uploaded(name):  # planning asked about a name it does not take from the request
                raise LookupError(f"voice {name!r} was not looked up before planning")
            return None

        return find

    async def prompt(self, body: SpeechRequest, info: ModelInfo, choice: VoiceChoice) -> VoiceClonePrompt | None:
        """The clone prompt of a Base request: its own clip (cached in memory) or an uploaded voice's."""
        handle = self._router.handle(info.name)
        if choice.inline:
            audio, _mime = await load_ref_audio(body.ref_audio, self._limits)
            audio = await asyncio.to_thread(usable_clip, audio, self._limits.max_ref_audio_seconds)
            ref_text = (body.ref_text or "").strip() or None
            key = hashlib.sha256(audio).hexdigest() + json.dumps([ref_text, body.x_vector_only_mode, info.fingerprint])
            prompt = self._inline.get(key)
            if prompt is None:
                prompt = await _create_voice(handle, audio, ref_text, body.x_vector_only_mode, "ref_audio")
                self._inline[key] = prompt
                while len(self._inline) > C.INLINE_VOICE_CACHE_SIZE:
                    self._inline.popitem(last=False)
            self._inline.move_to_end(key)
            return prompt
        if choice.uploaded is not None:
            record = choice.uploaded
            prompt = await asyncio.to_thread(self._store.prompt, record, info.fingerprint)
            if prompt is None:  # a model added after the upload: compute once, keep it
                audio = await asyncio.to_thread(self._store.audio, record)
                prompt = await _create_voice(handle, audio, record.ref_text, record.x_vector_only_mode, "voice")
                await asyncio.to_thread(self._store.put_prompt, record, info.fingerprint, prompt)
            return prompt
        return None

    # ------------------------------------------------------------------ /v1/audio/voices
    async def listing(self, key: ApiKey | None = None) -> dict:
        """Preset speakers, OpenAI's names for them, and the uploaded voices `key` may use."""
        infos = await self._router.infos(self._limits.request_timeout_s)
        uploaded = [r for r in await asyncio.to_thread(self._store.list) if may_use(r.owner, key)]
        voices_of = {TaskType.VOICE_DESIGN: [C.DEFAULT_VOICE_NAME], TaskType.BASE: [r.name for r in uploaded]}
        per_model = {i.name: {"task_type": i.task.value, "voices": voices_of.get(i.task, i.speakers)} for i in infos}
        presets = sorted({s for i in infos for s in i.speakers})
        aliases = {a: s for a, s in self._router.voice_aliases.items() if s in presets}
        return {"voices": presets, "voice_aliases": aliases, "uploaded_voices": [r.public() for r in uploaded],
                "models": per_model}

    async def upload(self, request: Request, key: ApiKey | None = None):
        """The voice, owned by `key`; an OpenAI voice object (`id`, `object`, `name`, `created_at`) with our
        fields (`success`, `voice`)."""
        try:
            with self._work.admit():
                return await self._upload(request, key)
        except Exception as exc:  # a full Talker is 429 JSON + Retry-After, as for speech
            return self._outcomes.error(exc).response()

    async def _upload(self, request: Request, key: ApiKey | None) -> dict:
        async with asyncio.timeout(self._limits.request_timeout_s):
            upload = await read_voice_upload(request, self._limits)
            name, audio, mime, ref_text, x_vector_only = upload[:5]
            if ref_text is not None and len(ref_text) > self._limits.max_ref_text_chars:
                raise bad_request(f"ref_text is {len(ref_text)} characters; the limit is "
                                  f"{self._limits.max_ref_text_chars}", "ref_text", code="input_too_long")
            if not VOICE_NAME_PATTERN.match(name):
                raise bad_request(f"voice name {shown(name)} must match {VOICE_NAME_PATTERN.pattern}", "name")
            infos = await self._router.infos(self._limits.request_timeout_s)
            if name.lower() == C.DEFAULT_VOICE_NAME or name.lower() in self._router.voice_aliases or \
                    any(name.lower() in i.speakers for i in infos):
                raise bad_request(f"voice name {shown(name)} is taken by a preset voice", "name", code="name_taken")
            # any case of the name: a request's voice is case-insensitive
            replaced = await asyncio.to_thread(self._store.find, name)
            if replaced is not None and not (upload.replace and may_change(replaced.owner, key)):
                raise APIError(409, f"a voice named {shown(replaced.name)} exists; `replace: true` replaces one's "
                               "own", param="name", code="voice_exists")
            existing = await asyncio.to_thread(self._store.list)
            if replaced is None and len(existing) >= self._limits.max_uploaded_voices:
                raise bad_request(f"there are already {len(existing)} uploaded voices (the limit)", "name",
                                  code="too_many_voices")
            audio = await asyncio.to_thread(usable_clip, audio, self._limits.max_ref_audio_seconds, "audio_sample")
            if audio is not upload.audio:
                mime = "audio/wav"  # decoded by PyAV: the stored clip is the WAV
            base = [i for i in infos if i.task is TaskType.BASE]
            if not base:
                raise bad_request(f"uploaded voices are for Base (voice clone) models; none is served "
                                  f"(served: {[i.name for i in infos]})", code="unsupported_task")
            x_vector_only = x_vector_only or ref_text is None
            prompts = await asyncio.gather(*(
                _create_voice(self._router.handle(i.name), audio, ref_text, x_vector_only, "audio_sample")
                for i in base))
            record = await asyncio.to_thread(
                self._store.save, name, audio, ref_text, x_vector_only, mime,
                {i.fingerprint: p for i, p in zip(base, prompts, strict=True)}, key.id if key else None, upload.consent)
            if replaced is not None and replaced.name != name:  # replaced under another case of the name
                await asyncio.to_thread(self._store.delete, replaced.name)
        logger.info(f"voice {name!r} uploaded ({len(audio)} bytes, prompts for {[i.name for i in base]}, "
                    f"key={key.label if key else '-'})")
        return {"id": record.name, "object": "audio.voice", "name": record.name, "created_at": record.created_at,
                "consent": record.consent, "success": True, "voice": record.public()}

    async def delete(self, name: str, key: ApiKey | None = None) -> dict:
        """Only a voice `key` may change; others' are unknown to it (404), whatever the case of `name`."""
        record = await asyncio.to_thread(self._store.find, name, lambda r: may_change(r.owner, key)) if name else None
        if record is None or not await asyncio.to_thread(self._store.delete, record.name):
            raise APIError(404, f"no uploaded voice named {shown(name)}", param="name", code="voice_not_found")
        return {"success": True, "name": record.name}


def _could_be_uploaded(name: str | None) -> bool:
    """False for a name no uploaded voice can have (not a valid voice name, or the default voice's)."""
    return bool(name) and VOICE_NAME_PATTERN.match(name) is not None and name.lower() != C.DEFAULT_VOICE_NAME


async def _create_voice(handle: DeploymentHandle, audio: bytes, ref_text: str | None, x_vector_only: bool,
                        param: str) -> VoiceClonePrompt:
    """The Base Talker computes the clone prompt; audio it cannot use (ValueError) is the client's fault."""
    try:
        return await handle.create_voice.remote(audio, ref_text, x_vector_only)
    except Exception as exc:
        inner = unwrap(exc)
        if isinstance(inner, ValueError):
            raise bad_request(f"{param}: {plain(inner)}", param, code="invalid_audio") from None
        raise
