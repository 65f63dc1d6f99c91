"""Request planning (model routing, voice choice, prompt, sampling, limits) against tiny checkpoints' configs."""

from __future__ import annotations

import numpy as np
import pytest

from deployments.config import TTSServingArgs
from deployments.errors import APIError
from deployments.ingress.request_builder import build_request, check_limits, choose_voice, infer_model, resolve_model_name
from deployments.ingress.schemas import SpeechRequest
from deployments.ingress.voice_store import VoiceRecord
from deployments.messages import ModelInfo
from stages.contract import Priority, TaskType, VoiceClonePrompt
from tests.conftest import tiny_model_info

UPLOADED = VoiceRecord("myvoice", "uid", 0, "hello there", False, 10, "audio/wav")




@pytest.fixture(scope="module")
def infos(tiny_custom_voice, tiny_base, tiny_voice_design) -> dict[str, ModelInfo]:
    return {"cv": tiny_model_info("cv", tiny_custom_voice, ["tts-1"]), "base": tiny_model_info("base", tiny_base),
            "vd": tiny_model_info("vd", tiny_voice_design)}


@pytest.fixture(scope="module")
def args() -> TTSServingArgs:
    return TTSServingArgs.model_validate({
        "models": [{"name": "cv", "aliases": ["tts-1"]}, {"name": "base"}, {"name": "vd"}],
        "streaming": {"first_chunk_frames": 2, "steady_chunk_frames": 10},
        "ingress": {"max_input_chars": 50, "max_instructions_chars": 20},
    })


def _find(name):
    return UPLOADED if name.lower() == "myvoice" else None


def _req(**fields) -> SpeechRequest:
    return SpeechRequest.model_validate({"input": "Hello there.", **fields})


def _status(fn, *a) -> tuple[int, str | None, str]:
    with pytest.raises(APIError) as e:
        fn(*a)
    return e.value.status, e.value.param, e.value.message


def test_model_names_and_aliases_resolve_case_insensitively():
    names = {"cv": "cv", "tts-1": "cv", "base": "base"}
    assert resolve_model_name("TTS-1", names) == "cv"
    status, param, message = _status(resolve_model_name, "gpt-4o", names)
    assert (status, param) == (404, "model") and "['base', 'cv']" in message


@pytest.mark.parametrize("fields, expected", [
    ({"voice": "vivian"}, "cv"),
    ({}, "cv"),  # only CustomVoice has a default voice
    ({"voice": "myvoice"}, "base"),
    ({"ref_audio": "AAAA", "ref_text": "hi"}, "base"),
    ({"instructions": "a deep voice"}, "vd"),
    ({"task_type": "VoiceDesign", "instructions": "x"}, "vd"),
])
def test_model_is_inferred_when_unambiguous(infos, fields, expected):
    assert infer_model(_req(**fields), infos, _find) == expected


def test_ambiguous_or_unfit_request_needs_a_model(infos):
    # CustomVoice (default speaker + instruction) and VoiceDesign both fit
    status, param, message = _status(infer_model, _req(voice="default", instructions="calm"), infos, _find)
    assert (status, param) == (400, "model") and "2 served models fit" in message
    status, param, message = _status(infer_model, _req(voice="alloy"), infos, _find)
    assert (status, param) == (400, "model") and "no served models fit" in message


@pytest.mark.parametrize("model, fields, param, fragment", [
    ("cv", {"voice": "alloy"}, "voice", "unknown voice 'alloy'"),
    ("cv", {"voice": "myvoice"}, "voice", "needs a Base model"),
    ("cv", {"task_type": "Base"}, "task_type", "cannot do task_type Base"),
    ("cv", {"ref_audio": "AAAA"}, "ref_audio", "only valid for Base"),
    ("cv", {"ref_text": "hi"}, "ref_text", "only valid for Base"),
    ("vd", {"voice": "vivian"}, "voice", "no preset voices"),
    ("vd", {}, "instructions", "needs `instructions`"),
    ("base", {}, "voice", "needs a voice"),
    ("base", {"voice": "nobody"}, "voice", "unknown voice"),
    ("base", {"ref_audio": "AAAA"}, "ref_text", "needs `ref_text`"),
    ("base", {"ref_audio": "AAAA", "ref_text": "x", "voice": "myvoice"}, "voice", "not both"),
])
def test_voice_choice_errors_name_the_problem(infos, model, fields, param, fragment):
    status, got_param, message = _status(choose_voice, _req(**fields), infos[model], _find)
    assert (status, got_param) == (400, param)
    assert fragment in message


def test_voice_choices(infos):
    assert choose_voice(_req(), infos["cv"], _find).speaker == "vivian"
    assert choose_voice(_req(voice="Ryan"), infos["cv"], _find).speaker == "ryan"
    assert choose_voice(_req(voice="default", instructions="x"), infos["vd"], _find).speaker is None
    assert choose_voice(_req(voice="MyVoice"), infos["base"], _find).uploaded is UPLOADED
    assert choose_voice(_req(ref_audio="AAAA", x_vector_only_mode=True), infos["base"], _find).inline


def test_build_request_uses_checkpoint_sampling_defaults_and_overrides(infos, args):
    body = _req(voice="vivian", language="English", seed=7, temperature=0.5, suppress_eos=True, max_new_tokens=40,
                initial_codec_chunk_frames=3)
    info = infos["cv"]
    request, options = build_request(body, info, choose_voice(body, info, _find), None, args, "rid")
    assert request.request_id == "rid" and request.seed == 7 and request.max_frames == 40
    assert request.sampling.temperature == 0.5 and request.sampling.suppress_eos
    assert request.sampling.top_k == info.generation.sampling.top_k == 50
    assert request.prompt.speaker_id == info.config.talker.speakers["vivian"]
    assert request.prompt.language_id == info.config.talker.languages["english"]
    assert options.first_chunk_frames == 3
    default = build_request(_req(), info, choose_voice(_req(), info, _find), None, args, "r2")
    assert default[0].max_frames == 300 and default[1].first_chunk_frames is None
    assert default[0].priority is Priority.REALTIME  # speech, long-form and WebSocket requests
    batch = build_request(_req(), info, choose_voice(_req(), info, _find), None, args, "r3", priority=Priority.BATCH)
    assert batch[0].priority is Priority.BATCH  # a batch job's item (deployments/ingress/batch_worker.py)


def test_base_request_carries_the_voice_and_x_vector_only_drops_reference_codes(infos, args):
    info = infos["base"]
    voice = VoiceClonePrompt(np.zeros(info.config.talker.hidden_size, np.float32),
                             ref_codes=np.zeros((5, 16), np.int64), ref_text_ids=(1, 2))
    body = _req(voice="myvoice")
    request, _ = build_request(body, info, choose_voice(body, info, _find), voice, args, "r")
    assert request.prompt.voice is voice and request.prompt.voice.icl
    xvec = _req(voice="myvoice", x_vector_only_mode=True)
    request, _ = build_request(xvec, info, choose_voice(xvec, info, _find), voice, args, "r")
    assert not request.prompt.voice.icl


@pytest.mark.parametrize("fields, param, fragment", [
    ({"input": "   "}, None, "empty"),
    ({"language": "klingon"}, None, "unsupported language"),
    ({"max_new_tokens": 513}, "max_new_tokens", "limit 512"),
    ({"initial_codec_chunk_frames": 11}, "initial_codec_chunk_frames", "<= 10"),
    ({"temperature": 0.0}, None, "temperature"),
])
def test_build_request_rejects(infos, args, fields, param, fragment):
    body = _req(voice="vivian", **fields)
    info = infos["cv"]
    status, got_param, message = _status(build_request, body, info, choose_voice(body, info, _find), None, args, "r")
    assert (status, got_param) == (400, param)
    assert fragment in message


@pytest.mark.parametrize("fields, param, fragment", [
    ({"input": "x" * 51}, "input", "limit is 50"),
    ({"instructions": "y" * 21}, "instructions", "limit is 20"),
    ({"ref_text": "z" * 31}, "ref_text", "limit is 30"),
    ({"suppress_eos": True}, "suppress_eos", "disabled"),
])
def test_limits_are_checked_first(fields, param, fragment):
    limits = TTSServingArgs.model_validate({"models": [{"name": "cv"}], "ingress": {
        "max_input_chars": 50, "max_instructions_chars": 20, "max_ref_text_chars": 30,
        "allow_suppress_eos": False}}).ingress
    status, got_param, message = _status(check_limits, _req(**fields), limits)
    assert (status, got_param) == (400, param) and fragment in message
    check_limits(_req(input="x" * 50, instructions="y" * 20), limits)


def test_task_of_models(infos):
    assert [i.task for i in infos.values()] == [TaskType.CUSTOM_VOICE, TaskType.BASE, TaskType.VOICE_DESIGN]


def test_requests_too_long_for_max_seq_len_are_refused_in_the_ingress(infos, args):
    """Prompt + frames beyond max_seq_len is a 400 here (the Talker never sees it); without max_new_tokens,
    a prompt that leaves fewer than `min_fitted_frames` is refused rather than answered with a few frames."""
    from stages.talker.layout import max_frames_that_fit, prefill_length

    info = infos["base"]
    long_ref = VoiceClonePrompt(np.zeros(info.config.talker.hidden_size, np.float32),
                                ref_codes=np.zeros((495, 16), np.int64), ref_text_ids=(1, 2))
    body = _req(voice="myvoice")
    choice = choose_voice(body, info, _find)
    status, param, message = _status(build_request, body, info, choice, long_ref, args, "r")
    assert (status, param) == (400, "input") and "leaves room for" in message
    request, _ = build_request(_req(voice="myvoice", x_vector_only_mode=True), info, choice, long_ref, args, "r")
    assert request.max_frames == 300  # the default, it fits

    fits = VoiceClonePrompt(long_ref.x_vector, ref_codes=np.zeros((400, 16), np.int64), ref_text_ids=(1, 2))
    request, _ = build_request(body, info, choice, fits, args, "r")
    room = max_frames_that_fit(prefill_length(request.prompt), 512)  # the engine's rule (test_servers checks it)
    assert args.ingress.min_fitted_frames <= request.max_frames == room < 300  # fitted, above the floor
    too_many = _req(voice="myvoice", max_new_tokens=room + 1)
    status, param, message = _status(build_request, too_many, info, choice, fits, args, "r")
    assert (status, param) == (400, "max_new_tokens") and "exceeds the model's max_seq_len 512" in message
    assert build_request(_req(voice="myvoice", max_new_tokens=room), info, choice, fits, args, "r")[0].max_frames == room


def test_error_messages_never_echo_unbounded_client_values(infos):
    body = _req(voice="v" * 200)
    status, param, message = _status(choose_voice, body, infos["cv"], _find)
    assert status == 400 and param == "voice" and len(message) < 400 and "v" * 70 not in message
    status, _, message = _status(resolve_model_name, "m" * 200, {"cv": "cv"})
    assert status == 404 and "m" * 70 not in message


def test_text_beyond_the_models_text_positions_is_refused_in_the_ingress(infos, args):
    """The engine ends a request whose utterance has more text positions than its `max_text_rows` (an error, and a
    traceback in the Talker's log): the ingress answers it first, a 400 naming `input` (code input_too_long). Base
    speaks in the streaming-text layout (one text position per token); the test tokenizer is byte-level: 4-byte
    characters pass `max_input_chars` with 4 positions each."""
    import dataclasses

    info = dataclasses.replace(infos["base"], max_text_rows=40)
    voice = VoiceClonePrompt(np.zeros(info.config.talker.hidden_size, np.float32))  # x-vector only
    body = _req(input="\U0001F600" * 11, voice="myvoice")  # 11 characters, 44 positions
    choice = choose_voice(body, info, _find)
    with pytest.raises(APIError) as e:
        build_request(body, info, choice, voice, args, "r")
    assert (e.value.status, e.value.param, e.value.code) == (400, "input", "input_too_long")
    assert "more than 40 text positions" in e.value.message
    assert build_request(_req(input="\U0001F600" * 10, voice="myvoice"), info, choice, voice, args, "r")
