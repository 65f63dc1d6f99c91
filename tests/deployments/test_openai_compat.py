"""OpenAI's names and defaults (deployments/ingress/voice_aliases.py, schemas), browser and phone clips decoded by
PyAV (deployments/audio/clip_decoding.py, ingress/ref_audio.py) and voice ownership on disk (voice_store.py)."""

from __future__ import annotations

import io

import pytest
import soundfile as sf

from deployments.audio.clip_decoding import container_of, decode_to_wav
from deployments.config import IngressConfig
from deployments.errors import APIError
from deployments.ingress.ref_audio import usable_clip
from deployments.ingress.request_builder import choose_voice, infer_model
from deployments.ingress.schemas import SpeechRequest
from deployments.ingress.voice_aliases import DEFAULT_VOICE_ALIASES, OPENAI_MODEL_NAMES, alias_target, model_names
from deployments.ingress.voice_store import VoiceStore
from stages.random_checkpoint import SPEAKERS
from tests.audio_decode import RECORDED, recorded_clip
from tests.conftest import tiny_model_info

OPENAI_VOICES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
                 "shimmer", "verse")


def test_every_openai_voice_has_a_customvoice_speaker():
    assert set(DEFAULT_VOICE_ALIASES) == set(OPENAI_VOICES)
    assert set(DEFAULT_VOICE_ALIASES.values()) <= set(SPEAKERS)
    assert IngressConfig().voice_aliases == DEFAULT_VOICE_ALIASES
    assert IngressConfig(voice_aliases={"Nova": "Sohee"}).voice_aliases == {"nova": "sohee"}


def test_aliases_resolve_to_a_speaker_of_the_model_and_a_real_speaker_wins(tiny_custom_voice, tiny_base):
    cv, base = tiny_model_info("cv", tiny_custom_voice), tiny_model_info("base", tiny_base)
    aliases = {**DEFAULT_VOICE_ALIASES, "ryan": "vivian", "ghost": "nobody"}
    assert alias_target("Nova", aliases, cv.speakers) == "vivian"
    assert alias_target("ryan", aliases, cv.speakers) is None  # a speaker's own name is never re-aliased
    assert alias_target("ghost", aliases, cv.speakers) is None  # an alias of a speaker the model lacks
    for voice in OPENAI_VOICES:
        body = SpeechRequest(input="x", voice=voice)
        assert choose_voice(body, cv, lambda _n: None, aliases).speaker == DEFAULT_VOICE_ALIASES[voice]
        # without `model`, an OpenAI voice picks the CustomVoice model among several
        assert infer_model(body, {"cv": cv, "base": base}, lambda _n: None, aliases) == "cv"
    with pytest.raises(APIError):
        choose_voice(SpeechRequest(input="x", voice="nova"), cv, lambda _n: None, {})


def test_openai_model_names_go_to_the_first_model_unless_a_model_claims_them():
    names = model_names({"cv": "cv", "base": "base", "tts-1-hd": "base"}, "cv")
    assert {n: names[n] for n in OPENAI_MODEL_NAMES} == {"tts-1": "cv", "tts-1-hd": "base", "gpt-4o-mini-tts": "cv"}


def test_openai_defaults_stream_and_take_the_servers_format():
    body = SpeechRequest(input="x")
    assert body.streaming and body.response_format is None
    assert body.with_default_format("mp3").response_format == "mp3"
    assert SpeechRequest(input="x", response_format="wav").with_default_format("mp3").response_format == "wav"
    assert not SpeechRequest(input="x", stream=False).streaming
    assert IngressConfig().default_response_format == "mp3" and IngressConfig().max_instructions_chars == 4096
    with pytest.raises(ValueError):
        IngressConfig(default_response_format="ogg")


@pytest.mark.parametrize("kind", sorted(RECORDED))
def test_recorded_clips_decode_into_a_wav_the_talker_reads(kind):
    data = recorded_clip(2.0, *RECORDED[kind])
    wav = usable_clip(data, 5.0, "audio_sample")
    info = sf.info(io.BytesIO(wav))
    assert info.samplerate == 48000 and info.channels == 1 and info.duration == pytest.approx(2.0, abs=0.05)


def test_a_recorded_clip_keeps_the_duration_limits():
    with pytest.raises(APIError) as long:
        usable_clip(recorded_clip(4.0, *RECORDED["webm"]), 2.0, "audio_sample")
    assert long.value.param == "audio_sample" and long.value.code == "audio_too_long"
    with pytest.raises(APIError) as short:
        usable_clip(recorded_clip(0.2, *RECORDED["m4a"]), 5.0, "ref_audio")
    assert short.value.param == "ref_audio" and short.value.code == "audio_too_short"
    # decoding stops past the limit: a long clip costs no more than the limit
    assert sf.info(io.BytesIO(decode_to_wav(recorded_clip(6.0, *RECORDED["webm"]), 2.0))).duration < 3.5


@pytest.mark.parametrize("data", [b"junk" * 100, b"\x1a\x45\xdf\xa3" + b"\0" * 200, b"OggS" + b"\1" * 200,
                                  b"\0\0\0\x18ftypM4A " + b"\0" * 200, b"#EXTM3U\nfile:///etc/passwd\n" * 4])
def test_what_does_not_decode_is_a_400_naming_the_field(data):
    with pytest.raises(APIError) as e:
        usable_clip(data, 5.0, "audio_sample")
    assert e.value.status == 400 and e.value.param == "audio_sample" and "webm" in e.value.message


def test_only_known_containers_reach_ffmpeg():
    assert container_of(b"#EXTM3U\n") is None and container_of(b"ffconcat version 1.0") is None
    assert container_of(recorded_clip(0.5, *RECORDED["m4a"])) == "mov"


def test_the_store_keeps_owner_and_consent_and_finds_only_usable_voices(tmp_path):
    store = VoiceStore(tmp_path)
    store.save("Alice", b"RIFF", None, True, "audio/wav", {}, owner="a" * 64, consent="cons_123")
    store.save("alice", b"RIFF", None, True, "audio/wav", {}, owner="b" * 64)
    record = store.get("Alice")
    assert record.owner == "a" * 64 and record.consent == "cons_123"
    assert "owner" not in record.public() and record.public()["consent"] == "cons_123"
    assert store.find("ALICE", lambda r: r.owner == "b" * 64).name == "alice"
    assert store.find("ALICE", lambda r: r.owner == "a" * 64).name == "Alice"
    assert store.find("ALICE", lambda r: False) is None
