"""Reference clips from requests and voice uploads: base64 / data: URIs, or http(s) URLs from the allowlist.

Local files are never read (no `file://`, no paths). Sizes are checked before decoding, and the clip
is probed (format, duration) here so that bad audio is a fast 4xx; what libsndfile cannot read (webm/opus,
m4a/aac from browsers and phones) is decoded here by PyAV into a WAV (deployments/audio/clip_decoding.py). The
waveform itself is decoded by the Base model's Talker replica, which computes the clone prompt.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from typing import NamedTuple

import soundfile as sf
from fastapi import Request

from deployments import constants as C
from deployments.config import IngressConfig
from deployments.errors import APIError, bad_request
from deployments.ingress.schemas import MAX_NAME_CHARS, VoiceUploadJSON

MAX_CONSENT_CHARS = MAX_NAME_CHARS


class VoiceUpload(NamedTuple):
    name: str
    audio: bytes
    mime_type: str | None
    ref_text: str | None
    x_vector_only: bool
    consent: str | None = None  # the speaker's consent (OpenAI: a consent recording's id), stored with the voice
    replace: bool = False  # replace an existing voice of this name


_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+\-]+/[\w.+\-]+)?(?P<params>(;[\w\-]+=[^;,]*)*)(?P<b64>;base64)?,", re.I)


async def load_ref_audio(value: str, limits: IngressConfig, param: str = "ref_audio") -> tuple[bytes, str | None]:
    """-> (encoded audio bytes, mime type if known). Raises APIError 400/413."""
    value = value.strip()
    lowered = value[:16].lower()
    if lowered.startswith(("http://", "https://")):
        return await _fetch(value, limits, param)
    if lowered.startswith("data:"):
        match = _DATA_URI.match(value)
        if match is None or not match.group("b64"):
            raise bad_request("ref_audio data: URI must be base64 encoded (data:<mime>;base64,...)", param)
        data = decode_base64(value[match.end():], limits.max_ref_audio_bytes, param)
        return data, match.group("mime")
    if re.match(r"^[a-z][a-z0-9+.\-]*:", lowered) or value.startswith(("/", "./", "../", "~")):
        raise bad_request("ref_audio must be base64 audio, a data: URI or an allowlisted http(s) URL; "
                          "local files and other schemes are not accepted", param, code="unsupported_source")
    return decode_base64(value, limits.max_ref_audio_bytes, param), None


def decode_base64(text: str, max_bytes: int, param: str) -> bytes:
    if len(text) * 3 // 4 > max_bytes + 3:
        raise _too_large(max_bytes, param)
    try:
        data = base64.b64decode(re.sub(r"\s+", "", text), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param} is not valid base64", param) from None
    if len(data) > max_bytes:
        raise _too_large(max_bytes, param)
    if not data:
        raise bad_request(f"{param} is empty", param)
    return data


def usable_clip(data: bytes, max_seconds: float, param: str = "ref_audio") -> bytes:
    """A clip the Talker can read (libsndfile: wav, flac, ogg, mp3), probed within the limits: `data` itself, or
    what browsers and phones record (webm/opus, m4a/aac, ...) decoded into a WAV by PyAV. Blocking (decodes):
    run it in a thread. 400 naming `param` when it is not audio."""
    try:
        sf.info(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError):
        from deployments.audio.clip_decoding import decode_to_wav

        wav = decode_to_wav(data, max_seconds)
        if wav is None:
            raise bad_request(f"{param} could not be decoded as audio (formats: wav, flac, mp3, ogg, webm/opus, "
                              "m4a/aac)", param, code="invalid_audio") from None
        data = wav
    probe_audio(data, max_seconds, param)
    return data


def probe_audio(data: bytes, max_seconds: float, param: str = "ref_audio") -> float:
    """Duration in seconds of an encoded clip; 400 if it cannot be decoded, is empty or is too long."""
    try:
        info = sf.info(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError):  # libsndfile's text names heap addresses
        raise bad_request(f"{param} could not be decoded as audio (formats: wav, flac, ogg, mp3)", param,
                          code="invalid_audio") from None
    if info.frames <= 0 or info.samplerate <= 0:
        raise bad_request(f"{param} contains no audio", param, code="invalid_audio")
    if info.samplerate < C.MIN_REF_AUDIO_SAMPLE_RATE:  # a 1 Hz "clip" decodes, but is no voice
        raise bad_request(f"{param} has a sample rate of {info.samplerate} Hz; at least "
                          f"{C.MIN_REF_AUDIO_SAMPLE_RATE} Hz is needed", param, code="invalid_audio")
    seconds = info.frames / info.samplerate
    if seconds < C.MIN_REF_AUDIO_SECONDS:
        raise bad_request(f"{param} is {seconds:.2f} s long; at least {C.MIN_REF_AUDIO_SECONDS:g} s is needed",
                          param, code="audio_too_short")
    if seconds > max_seconds:
        raise bad_request(f"{param} is {seconds:.1f} s long; the limit is {max_seconds:g} s", param,
                          code="audio_too_long")
    return seconds


async def _fetch(url: str, limits: IngressConfig, param: str) -> tuple[bytes, str | None]:
    if not any(url.startswith(prefix) for prefix in limits.ref_audio_url_allowlist):
        raise bad_request("ref_audio URL is not on this server's allowlist (ingress.ref_audio_url_allowlist)", param,
                          code="url_not_allowed")
    import httpx

    try:
        async with httpx.AsyncClient(timeout=C.REF_AUDIO_FETCH_TIMEOUT_S, follow_redirects=False) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise bad_request(f"fetching ref_audio failed: HTTP {response.status_code}", param,
                                      code="fetch_failed")
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > limits.max_ref_audio_bytes:
                        raise _too_large(limits.max_ref_audio_bytes, param)
                    chunks.append(chunk)
                return b"".join(chunks), response.headers.get("content-type")
    except httpx.HTTPError as e:
        raise bad_request(f"fetching ref_audio failed: {type(e).__name__}", param, code="fetch_failed") from None


def _too_large(max_bytes: int, param: str) -> APIError:
    return APIError(413, f"{param} is larger than {max_bytes} bytes", param=param, code="audio_too_large")


async def read_voice_upload(request: Request, limits: IngressConfig) -> VoiceUpload:
    """`POST /v1/audio/voices` body: multipart (`audio_sample` file) or JSON (`audio_sample` base64/data URI)."""
    limit = limits.max_ref_audio_bytes
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        try:
            form = await request.form()
        except Exception:  # Starlette's HTTPException or python-multipart's parse errors
            raise bad_request("the multipart/form-data body could not be parsed", code="invalid_multipart") from None
        upload = form.get("audio_sample")
        if upload is None or isinstance(upload, str):
            raise bad_request("multipart field `audio_sample` (a file) is required", "audio_sample")
        audio = await upload.read(limit + 1)
        if len(audio) > limit:
            raise _too_large(limit, "audio_sample")
        if not audio:
            raise bad_request("audio_sample is empty", "audio_sample")
        x_vector_only = str(form.get("x_vector_only_mode") or "false").lower() in ("1", "true", "yes")
        consent = str(form.get("consent") or "").strip() or None
        if consent is not None and len(consent) > MAX_CONSENT_CHARS:
            raise bad_request(f"consent is longer than {MAX_CONSENT_CHARS} characters", "consent")
        return VoiceUpload(str(form.get("name") or ""), audio, upload.content_type,
                           str(form.get("ref_text") or "").strip() or None, x_vector_only, consent,
                           str(form.get("replace") or "false").lower() in ("1", "true", "yes"))
    try:
        body = VoiceUploadJSON.model_validate_json(await request.body())
    except ValueError as e:
        raise bad_request(f"voice upload must be multipart/form-data or JSON {list(VoiceUploadJSON.model_fields)}: "
                          f"{str(e).splitlines()[0]}") from None
    if body.audio_sample.startswith("data:"):
        audio, mime = await load_ref_audio(body.audio_sample, limits, "audio_sample")
    else:
        audio, mime = decode_base64(body.audio_sample, limit, "audio_sample"), None
    return VoiceUpload(body.name, audio, mime, (body.ref_text or "").strip() or None, body.x_vector_only_mode,
                       (body.consent or "").strip() or None, body.replace)
