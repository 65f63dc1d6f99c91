"""Builder inspection: build the application from each shipped config and assert the Serve options (no cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from deployments import constants as C
from deployments.builder import build_app
from deployments.config import TTSServingArgs

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _app_args(name: str) -> dict:
    with open(CONFIGS / name, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    (application,) = config["applications"]
    assert application["import_path"] == "deployments.builder:build_app"
    return application["args"]


def _deployments(app) -> dict:
    """name -> bound deployment, for the ingress and everything bound into it."""
    ingress = app._bound_deployment
    talkers, code2wav, _args = ingress.init_args
    out = {ingress.name: ingress, code2wav._bound_deployment.name: code2wav._bound_deployment}
    out.update({t._bound_deployment.name: t._bound_deployment for t in talkers.values()})
    if (aligner := ingress.init_kwargs.get("aligner")) is not None:
        out[aligner._bound_deployment.name] = aligner._bound_deployment
    return out


SHIPPED = ["local.yaml", "local_all.yaml", "high_concurrency.yaml", "split.yaml", "multi_model.yaml", "replicas.yaml"]


def test_every_config_in_the_folder_is_tested():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(SHIPPED)


@pytest.mark.parametrize("config", SHIPPED)
def test_every_shipped_config_decodes_statefully(config):
    """README and docs/code2wav.md §6 say so: a chunk decodes its new frames only, with a state slot for each row
    of a Talker replica at least (least recently used beyond: such a stream decodes over its left context)."""
    from stages.code2wav.engine_config import Code2WavEngineConfig
    from stages.talker.engine_config import TalkerEngineConfig

    args = TTSServingArgs.model_validate(_app_args(config))
    kwargs = args.code2wav.engine_kwargs
    assert args.code2wav.stateful
    rows = max(m.engine_kwargs.get("max_num_seqs", TalkerEngineConfig.max_num_seqs) for m in args.models)
    assert kwargs.get("state_slots", Code2WavEngineConfig.state_slots) >= rows


@pytest.mark.parametrize("config", SHIPPED)
def test_every_shipped_config_builds(config):
    args = TTSServingArgs.model_validate(_app_args(config))
    deployments = _deployments(build_app(args))
    names = {C.INGRESS_DEPLOYMENT_NAME, C.CODE2WAV_DEPLOYMENT_NAME, *(m.deployment_name for m in args.models)}
    assert set(deployments) == names | ({C.ALIGNER_DEPLOYMENT_NAME} if args.aligner is not None else set())
    for d in deployments.values():  # admission limits are always explicit (Serve's defaults: 5 and unbounded)
        assert d._deployment_config.max_queued_requests > 0
        assert d._deployment_config.max_ongoing_requests >= 1


@pytest.mark.parametrize("config", ["local.yaml", "high_concurrency.yaml", "multi_model.yaml"])
def test_ingress_drains_longer_than_every_talker(config):
    """Deleting or redeploying the app stops every deployment at once: the Talkers' streams must end (their
    replicas killed at their graceful timeout) while the ingress is still there to end them visibly."""
    deployments = _deployments(build_app(_app_args(config)))
    talkers = [d for name, d in deployments.items() if name.startswith(C.TALKER_DEPLOYMENT_PREFIX)]
    drain = max(t._deployment_config.graceful_shutdown_timeout_s for t in talkers)
    ingress = deployments[C.INGRESS_DEPLOYMENT_NAME]._deployment_config.graceful_shutdown_timeout_s
    assert ingress == drain + C.INGRESS_GRACEFUL_SHUTDOWN_MARGIN_S


def test_local_config_is_cpu_embedded_and_fits_two_cores():
    args = TTSServingArgs.model_validate(_app_args("local.yaml"))
    assert all(m.model is None and m.device == "cpu" for m in args.models)
    assert args.codec_source == args.models[0].source  # the codec of the embedded checkpoint
    deployments = _deployments(build_app(args))
    cpus = sum(d.ray_actor_options.get("num_cpus", 1) for d in deployments.values())
    assert cpus <= 2
    assert not any(d.ray_actor_options.get("num_gpus") for d in deployments.values())


def test_local_config_serves_the_embedded_aligner_on_cpu_to_the_ingress():
    args = TTSServingArgs.model_validate(_app_args("local.yaml"))
    app = build_app(args)
    aligner = _deployments(app)[C.ALIGNER_DEPLOYMENT_NAME]
    (config,) = aligner.init_args
    assert config.model is None and config.device == "cpu" and config == args.aligner
    assert aligner.func_or_class.__name__ == "AlignerServer"
    assert aligner.ray_actor_options["num_cpus"] < 1 and not aligner.ray_actor_options.get("num_gpus")
    assert aligner._deployment_config.max_ongoing_requests == config.max_batch_size * C.ALIGNER_ONGOING_PER_BATCH_SLOT
    assert aligner._deployment_config.max_queued_requests == C.DEFAULT_ALIGNER_MAX_QUEUED_REQUESTS
    assert set(app._bound_deployment.init_kwargs) == {"aligner"}


def test_without_an_aligner_block_there_is_no_aligner():
    args = _app_args("local.yaml")
    del args["aligner"]
    app = build_app(args)
    assert TTSServingArgs.model_validate(args).aligner is None
    assert C.ALIGNER_DEPLOYMENT_NAME not in _deployments(app)
    assert app._bound_deployment.init_kwargs == {}


def test_aligner_options_are_the_defaults_merged_with_its_deployment_config():
    args = {"models": [{"name": "a"}], "aligner": {
        "model": "Qwen/Qwen3-ForcedAligner-0.6B", "max_batch_size": 16,
        "deployment_config": {"ray_actor_options": {"num_gpus": 0.1}, "max_queued_requests": 7}}}
    aligner = _deployments(build_app(args))[C.ALIGNER_DEPLOYMENT_NAME]
    assert aligner.ray_actor_options == {"num_cpus": 1, "num_gpus": 0.1}
    assert aligner._deployment_config.max_queued_requests == 7
    assert aligner._deployment_config.max_ongoing_requests == 16 * C.ALIGNER_ONGOING_PER_BATCH_SLOT
    with pytest.raises(ValidationError, match="aligner.device"):
        TTSServingArgs.model_validate({"models": [{"name": "a"}], "aligner": {"device": "tpu"}})
    with pytest.raises(ValidationError, match="max_batch_size"):
        TTSServingArgs.model_validate({"models": [{"name": "a"}], "aligner": {"max_batch_size": 0}})


def test_the_documented_gpu_aligner_fits_beside_code2wav_on_one_gpu():
    """docs/aligner.md, "Configs": its `aligner:` block added to high_concurrency.yaml (Code2Wav at 0.45 of the GPU)
    builds, and the GPU fractions and memory caps of the three fit one GPU."""
    text = (CONFIGS.parent / "docs" / "aligner.md").read_text(encoding="utf-8").split("### Configs", 1)[1]
    block = yaml.safe_load(text.split("```yaml", 1)[1].split("```", 1)[0])
    args = _app_args("high_concurrency.yaml")
    args["code2wav"]["deployment_config"]["ray_actor_options"]["num_gpus"] = 0.45
    deployments = _deployments(build_app({**args, **block}))
    aligner = deployments[C.ALIGNER_DEPLOYMENT_NAME]
    assert aligner.init_args[0].model == "Qwen/Qwen3-ForcedAligner-0.6B"
    assert sum(d.ray_actor_options.get("num_gpus", 0) for d in deployments.values()) <= 1.0
    assert sum(d.init_args[0].gpu_memory_fraction for name, d in deployments.items()
               if name != C.INGRESS_DEPLOYMENT_NAME) <= 1.0


def test_replicas_config_is_high_concurrency_with_one_pair_per_gpu_raylet():
    """configs/replicas.yaml scales the co-located pair out: the same engines, N replicas of each stage, at most
    one of each per Ray node (one raylet per GPU), so each GPU holds exactly one Talker and one Code2Wav."""
    one, many = (_deployments(build_app(_app_args(c))) for c in ("high_concurrency.yaml", "replicas.yaml"))
    for name in ("Talker:qwen3-tts", "Code2Wav"):
        a, b = one[name], many[name]
        assert b._deployment_config.num_replicas == 2 and b._replica_config.max_replicas_per_node == 1
        assert b.ray_actor_options == a.ray_actor_options
        def strip(args, name=name):  # placement apart; Code2Wav keeps 2x the streams per GPU in state slots (streams land
            # unevenly on N replicas: docs/benchmarks.md, "Scale-out on 4x H200: state slots")
            return [c.model_copy(update={"deployment_config": {}, **({"engine_kwargs": {}} if name == "Code2Wav"
                                                                     else {})})
                    if hasattr(c, "deployment_config") else c for c in args]
        assert strip(b.init_args) == strip(a.init_args)  # the same engines and streaming
    slots = [d["Code2Wav"].init_args[0].engine_kwargs["state_slots"] for d in (one, many)]
    assert slots[1] == 2 * slots[0]
    assert many["TTSIngress"]._deployment_config.autoscaling_config.min_replicas == 8


def test_high_concurrency_colocates_fractional_gpus():
    deployments = _deployments(build_app(_app_args("high_concurrency.yaml")))
    talker, code2wav = deployments["Talker:qwen3-tts"], deployments["Code2Wav"]
    assert talker.ray_actor_options["num_gpus"] == code2wav.ray_actor_options["num_gpus"] == 0.5
    talker_config, streaming = talker.init_args
    slots = talker_config.engine_config_kwargs()["max_num_seqs"]
    assert slots == 512
    # every slot can be busy with more requests waiting inside the engine, then Serve queues, then 429
    assert talker._deployment_config.max_ongoing_requests > slots
    assert talker._deployment_config.max_queued_requests == 64
    assert talker._deployment_config.graceful_shutdown_timeout_s == 180
    assert talker_config.gpu_memory_fraction + code2wav.init_args[0].gpu_memory_fraction <= 1.0
    ingress = deployments["TTSIngress"]
    backpressure = ingress._deployment_config.backpressure_config
    assert (backpressure.status_code, backpressure.retry_after_s) == (429, 1)
    ingress_scaling = ingress._deployment_config.autoscaling_config
    # several ingress event loops from the first request (issue 11), still room to grow
    assert ingress_scaling.min_replicas == 4 and ingress_scaling.max_replicas > 4


def test_split_pins_each_stage_to_its_gpu_and_uses_queue_depth_policies():
    deployments = _deployments(build_app(_app_args("split.yaml")))
    talker, code2wav = deployments["Talker:qwen3-tts"], deployments["Code2Wav"]
    assert talker.ray_actor_options["resources"] == {"gpu_0": 1}
    assert code2wav.ray_actor_options["resources"] == {"gpu_1": 1}
    assert talker.ray_actor_options["num_gpus"] == code2wav.ray_actor_options["num_gpus"] == 1
    t_auto = talker._deployment_config.autoscaling_config
    c_auto = code2wav._deployment_config.autoscaling_config
    assert t_auto.policy.policy_function == "deployments.autoscaling:talker_policy"
    assert c_auto.policy.policy_function == "deployments.autoscaling:code2wav_policy"
    assert (t_auto.target_ongoing_requests, t_auto.upscale_delay_s) == (192, 10)


def test_multi_model_has_one_talker_per_checkpoint_and_one_code2wav():
    args = TTSServingArgs.model_validate(_app_args("multi_model.yaml"))
    app = build_app(args)
    talkers, code2wav, ingress_args = app._bound_deployment.init_args
    assert list(talkers) == ["qwen3-tts-customvoice", "qwen3-tts-base", "qwen3-tts-voicedesign"]
    assert code2wav._bound_deployment.init_args[1].model == "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"
    assert ingress_args.ingress.ref_audio_url_allowlist == ["https://voices.example.com/"]
    base = talkers["qwen3-tts-base"]._bound_deployment
    assert base.name == "Talker:qwen3-tts-base"
    # autoscaling without a target gets 0.75 x engine slots, and our policy
    auto = base._deployment_config.autoscaling_config
    assert auto.target_ongoing_requests == 36 and auto.max_replicas == 2
    assert auto.policy.policy_function == "deployments.autoscaling:talker_policy"


def test_defaults_derive_admission_from_engine_slots():
    app = build_app({"models": [{"name": "m", "engine_kwargs": {"max_num_seqs": 10}}],
                     "code2wav": {"max_batch_size": 4}})
    d = _deployments(app)
    talker = d["Talker:m"]._deployment_config
    # the replica holds 15 speech requests open (1.5 per row) and refuses the next; Serve's bound counts calls and
    # is set above that, so that it never queues a batched call whole; 10 requests wait at each ingress replica
    (config,) = TTSServingArgs.model_validate({"models": [{"name": "m", "engine_kwargs": {"max_num_seqs": 10}}]}).models
    assert (config.max_ongoing_requests, config.max_queued_requests) == (15, 10)
    assert (talker.max_ongoing_requests, talker.max_queued_requests) == (30, 10)
    assert talker.autoscaling_config is None
    assert d["Code2Wav"]._deployment_config.max_ongoing_requests == 4 * C.CODE2WAV_ONGOING_PER_BATCH_SLOT
    assert d["TTSIngress"]._deployment_config.backpressure_config.status_code == 429


def test_yaml_deployment_config_overrides_defaults_deeply():
    app = build_app({"models": [{"name": "m", "deployment_config": {
        "ray_actor_options": {"num_gpus": 0.25, "resources": {"gpu_3": 0.25}},
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 5, "target_ongoing_requests": 7,
                               "policy": {"policy_function": "deployments.autoscaling:code2wav_policy"}}}}]})
    talker = _deployments(app)["Talker:m"]
    assert talker.ray_actor_options == {"num_cpus": 1, "num_gpus": 0.25, "resources": {"gpu_3": 0.25}}
    auto = talker._deployment_config.autoscaling_config
    assert (auto.target_ongoing_requests, auto.policy.policy_function) == (7, "deployments.autoscaling:code2wav_policy")


@pytest.mark.parametrize("args, message", [
    ({"models": []}, "at least 1"),
    ({"models": [{"name": "a", "typo": 1}]}, "Extra inputs"),
    ({"models": [{"name": "a"}, {"name": "b", "aliases": ["A"]}]}, "used twice"),
    ({"models": [{"name": "a", "deployment_config": {"max_ongoing": 3}}]}, "unknown Serve deployment options"),
    ({"models": [{"name": "bad name"}]}, "pattern"),
    ({"models": [{"name": "a"}], "ingress": {"ref_audio_url_allowlist": ["file:///etc/"]}}, "URL prefix"),
    ({"models": [{"name": "a"}], "ingress": {"backpressure": {"status_code": 500}}}, "429"),
    ({"models": [{"name": "a", "embedded_kind": "tts"}]}, "custom_voice"),
    # device, dtype and autoscaling keys: the error names the field and what it takes
    ({"models": [{"name": "a", "device": "gpu"}]}, r"models\.0\.device\n.*device 'gpu' is not one of"),
    ({"models": [{"name": "a"}], "code2wav": {"device": "cuda:x"}}, r"code2wav\.device\n"),
    ({"models": [{"name": "a", "dtype": "bfloat"}]}, r"models\.0\.dtype\n.*dtype 'bfloat' is not one of"),
    ({"models": [{"name": "a", "deployment_config": {"autoscaling_config": {"min_replica": 1}}}]},
     r"models\.0\.deployment_config\n.*unknown autoscaling_config keys \['min_replica'\]"),
    ({"models": [{"name": "a"}], "ingress": {"deployment_config": {"autoscaling_config": {"target": 3}}}},
     r"ingress\.deployment_config\n.*autoscaling_config keys \['target'\]"),
])
def test_invalid_args_fail_validation(args, message):
    with pytest.raises(ValidationError, match=message):
        TTSServingArgs.model_validate(args)


@pytest.mark.parametrize("args, message", [
    ({"models": [{"name": "a"}], "streaming": {"ramp": [0]}}, "ramp"),
    ({"models": [{"name": "a", "engine_kwargs": {"max_batchsize": 4}}]}, "max_batchsize"),
    ({"models": [{"name": "a", "engine_kwargs": {"max_seq_len": 8}}]}, "max_seq_len >= 16"),
    ({"models": [{"name": "a"}], "code2wav": {"engine_kwargs": {"cuda_graph": True}}}, "cuda_graph"),
])
def test_inconsistent_engine_options_fail_at_build_time(args, message):
    with pytest.raises(ValueError, match=message):
        build_app(args)


def test_a_config_naming_only_the_model_gets_the_fast_path_of_high_concurrency():
    """Defaults are the measured fast path: a config that names the model, device, dtype and GPU fraction gets what
    configs/high_concurrency.yaml runs (which sets only what differs: sizes)."""
    from stages.talker.engine_config import TalkerEngineConfig

    minimal = {"models": [{"name": "m", "model": "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", "device": "cuda",
                           "dtype": "bfloat16", "gpu_memory_fraction": 0.55}]}
    for args in (TTSServingArgs.model_validate(minimal),
                 TTSServingArgs.model_validate(_app_args("high_concurrency.yaml"))):
        talker, code2wav = args.models[0], args.code2wav
        assert code2wav.stateful and code2wav.max_batch_size == 64
        assert (code2wav.batch_fill_chunks, code2wav.batch_fill_wait_ms, code2wav.batch_fill_idle_wait_ms) == (64, 20, 60)
        assert args.streaming.schedule().first_chunk_frames == 1
        assert (talker.first_chunk_decode_max_running, talker.first_chunk_decode_count_pending) == (160, True)
        ingress = _deployments(build_app(args))[C.INGRESS_DEPLOYMENT_NAME]._deployment_config.autoscaling_config
        assert ingress.min_replicas == 4
    assert TTSServingArgs.model_validate(minimal).models[0].max_num_seqs == TalkerEngineConfig.max_num_seqs


def test_a_config_setting_num_replicas_keeps_the_ingress_at_that_count():
    app = build_app({"models": [{"name": "m"}], "ingress": {"deployment_config": {"num_replicas": 1}}})
    ingress = _deployments(app)[C.INGRESS_DEPLOYMENT_NAME]._deployment_config
    assert ingress.autoscaling_config is None and ingress.num_replicas == 1


@pytest.mark.parametrize("value, message", [("many", "is not an integer"), ("-3", "must not be negative")])
def test_a_bad_environment_value_names_its_variable(value, message):
    import os
    import subprocess
    import sys

    env = {**os.environ, "QWEN3_TTS_MAX_INPUT_CHARS": value, "PYTHONPATH": str(CONFIGS.parent)}
    result = subprocess.run([sys.executable, "-c", "import deployments.constants"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0
    assert f"environment variable QWEN3_TTS_MAX_INPUT_CHARS={value!r} {message}" in result.stderr


def test_suppress_eos_is_refused_by_default_and_only_the_cpu_config_allows_it():
    import yaml

    from deployments.config import IngressConfig

    assert IngressConfig().allow_suppress_eos is False
    repo = Path(__file__).resolve().parents[2]
    for path in sorted((repo / "configs").glob("*.yaml")):
        ingress = yaml.safe_load(path.read_text())["applications"][0]["args"].get("ingress", {})
        assert ingress.get("allow_suppress_eos", False) == path.name.startswith("local"), path.name


def test_overload_maps_to_429_json_with_retry_after():
    from ray.serve.exceptions import BackPressureError

    from deployments.errors import to_api_error

    error = to_api_error(BackPressureError(num_queued_requests=4, max_queued_requests=4), overload_status=429,
                         retry_after_s=2)
    response = error.response()
    assert response.status_code == 429 and response.headers["retry-after"] == "2"
    assert error.body()["error"]["code"] == "overloaded"


def test_an_overload_names_its_limit_to_the_ingress_logs_and_metrics_not_to_the_client(monkeypatch):
    """Which limit refused a request (an ingress replica's open requests, a Serve handle's queue, an engine's
    waiting queue) is counted in tts_rejections{limit} and logged; the client gets the same 429 whichever."""
    from ray.serve.exceptions import BackPressureError

    from deployments.config import BackpressureSettings
    from deployments.errors import OVERLOAD_LIMITS, APIError
    from deployments.ingress.http_guard import OpenWork
    from deployments.ingress.outcomes import Outcomes
    from stages.contract import EngineOverloadedError

    work = OpenWork(1, retry_after_s=1.0)
    work.acquire()
    with pytest.raises(APIError) as full:
        work.acquire()
    outcomes = Outcomes(BackpressureSettings(), ["m"])
    counted = []
    monkeypatch.setattr(outcomes.metrics.rejections, "inc",
                        lambda value=1.0, tags=None: counted.append((tags["model"], tags["limit"])))
    errors = [outcomes.failed(exc, "m", stream=True) for exc in (
        full.value, BackPressureError(num_queued_requests=4, max_queued_requests=4), EngineOverloadedError("full"))]
    assert [e.limit for e in errors] == list(OVERLOAD_LIMITS) and counted == [("m", x) for x in OVERLOAD_LIMITS]
    assert {e.status for e in errors} == {429} and len({str(e.body()) for e in errors}) == 1


def test_local_all_serves_every_task_type_on_two_cpus():
    args = TTSServingArgs.model_validate(_app_args("local_all.yaml"))
    assert sorted(m.embedded_kind for m in args.models if m.model is None) == ["base", "custom_voice", "voice_design"]
    assert all(m.device == "cpu" for m in args.models) and args.ingress.allow_suppress_eos
    deployments = _deployments(build_app(args))
    cpus = sum(d._deployment_config.num_replicas * d.ray_actor_options.get("num_cpus", 1)
               for d in deployments.values())
    assert cpus <= 1.5, cpus  # leaves room on a 2-core machine
    assert args.aligner is not None and args.aligner.device == "cpu" and "Aligner" in deployments  # timestamps


@pytest.mark.parametrize("text, env, expected", [
    ("${M}", {"M": "/ckpt"}, "/ckpt"),
    ("${M:-Qwen/x}", {}, "Qwen/x"),
    ("${M:-Qwen/x}", {"M": ""}, "Qwen/x"),  # `:-`: unset or empty
    ("${M-Qwen/x}", {"M": ""}, ""),  # `-`: unset only
    ("${M:-}", {}, ""),
    ("a-${M}-${N:-n}", {"M": "m"}, "a-m-n"),
    ("$${M} $HOME", {"M": "m"}, "${M} $HOME"),  # `$$` escapes; a bare `$NAME` is left as written
])
def test_environment_references_are_substituted_as_a_shell_does(text, env, expected):
    from deployments.config import substitute_env

    assert substitute_env({"a": [text]}, env) == {"a": [expected]}


def test_an_unset_variable_without_a_default_names_itself_and_its_field(monkeypatch):
    monkeypatch.delenv("QWEN3_TTS_TEST_UNSET", raising=False)
    args = _app_args("local.yaml")
    args["models"][0]["model"] = "${QWEN3_TTS_TEST_UNSET}"
    with pytest.raises(ValidationError, match=r"args\.models\[0\]\.model: environment variable QWEN3_TTS_TEST_UNSET"):
        TTSServingArgs.model_validate(args)


@pytest.mark.parametrize("config", ["local.yaml", "local_all.yaml"])
def test_cpu_configs_serve_qwen3_tts_model_else_the_embedded_checkpoint(config, monkeypatch, tmp_path):
    for var in ("QWEN3_TTS_MODEL", "QWEN3_TTS_BASE_MODEL", "QWEN3_TTS_VOICEDESIGN_MODEL"):
        monkeypatch.delenv(var, raising=False)
    args = TTSServingArgs.model_validate(_app_args(config))
    assert all(m.source.embedded for m in args.models) and args.codec_source.embedded
    monkeypatch.setenv("QWEN3_TTS_MODEL", str(tmp_path))
    args = TTSServingArgs.model_validate(_app_args(config))
    assert args.models[0].model == str(tmp_path) and not args.codec_source.embedded
    assert all(m.source.embedded for m in args.models[1:])


@pytest.mark.parametrize("config", ["high_concurrency.yaml", "split.yaml", "replicas.yaml", "multi_model.yaml"])
def test_gpu_configs_default_to_the_released_checkpoint_and_take_qwen3_tts_model(config, monkeypatch):
    monkeypatch.delenv("QWEN3_TTS_MODEL", raising=False)
    assert TTSServingArgs.model_validate(_app_args(config)).models[0].model == "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"
    monkeypatch.setenv("QWEN3_TTS_MODEL", "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice")
    assert TTSServingArgs.model_validate(_app_args(config)).models[0].model == "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"


def test_a_deterministic_model_fixes_its_engine_and_code2wavs_shapes():
    """`deterministic: true` on a model: its engine runs in deterministic mode, it never decodes first chunks itself,
    and the shared Code2Wav decodes in fixed shapes; without it nothing changes."""
    from stages.code2wav.engine_config import Code2WavEngineConfig
    from stages.talker.engine_config import TalkerEngineConfig

    models = [{"name": "fixed", "deterministic": True}, {"name": "fast"}]
    args = TTSServingArgs.model_validate({"models": models})
    fixed, fast = args.models
    assert TalkerEngineConfig(**fixed.engine_config_kwargs()).deterministic
    assert not fixed.decodes_first_chunks and fast.decodes_first_chunks
    assert "deterministic" not in fast.engine_config_kwargs()
    assert Code2WavEngineConfig(**args.code2wav.engine_config_kwargs()).deterministic
    plain = TTSServingArgs.model_validate({"models": [{"name": "fast"}]})
    assert "deterministic" not in plain.code2wav.engine_kwargs
    _deployments(build_app(args))  # builds
