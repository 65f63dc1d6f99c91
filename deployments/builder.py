"""Builders: validated `TTSServingArgs` -> the Serve application (the `import_path` target).

    import_path: deployments.builder:build_app        # args: validated into TTSServingArgs

One `Talker:<model>` deployment per served checkpoint, one shared `Code2Wav`, one `TTSIngress`, and with `aligner:`
one `Aligner` (word timestamps).
Every Serve option is the builder's default deep-merged with the config's `deployment_config`
(YAML `deployments:` overrides still apply on top, by these names). The final options are logged.
"""

# no `from __future__ import annotations`: Serve reads build_app's annotation to validate `args`
import copy
import logging
from typing import Any

from ray import serve
from ray.serve import Application

from deployments import constants as C
from deployments.aligner.server import AlignerServer
from deployments.code2wav.server import DEFAULT_ENGINE_CLS as CODE2WAV_ENGINE
from deployments.code2wav.server import Code2WavServer
from deployments.config import (
    AlignerDeploymentConfig,
    CheckpointSource,
    Code2WavDeploymentConfig,
    StreamingConfig,
    TalkerDeploymentConfig,
    TTSServingArgs,
)
from deployments.ingress import TTSIngress, make_fastapi_app, make_fastapi_ingress
from deployments.ingress.http_guard import BodyLimits
from deployments.loading import engine_config
from deployments.talker.server import DEFAULT_ENGINE_CLS as TALKER_ENGINE
from deployments.talker.server import TalkerServer

logger = logging.getLogger("ray.serve")

TALKER_POLICY = "deployments.autoscaling:talker_policy"
CODE2WAV_POLICY = "deployments.autoscaling:code2wav_policy"


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _with_policy(options: dict[str, Any], policy: str, target: float) -> dict[str, Any]:
    """Autoscaling, when configured, defaults to our queue-depth policy and a target from engine capacity."""
    autoscaling = options.get("autoscaling_config")
    if isinstance(autoscaling, dict):
        autoscaling.setdefault("policy", {"policy_function": policy})
        autoscaling.setdefault("target_ongoing_requests", target)
    return options


def talker_deployment_options(config: TalkerDeploymentConfig) -> dict[str, Any]:
    slots = config.max_num_seqs
    defaults = {
        "name": config.deployment_name,
        "max_queued_requests": config.max_queued_requests,
        "graceful_shutdown_timeout_s": C.TALKER_GRACEFUL_SHUTDOWN_TIMEOUT_S,
        "health_check_period_s": 10,
        "health_check_timeout_s": 30,
        "ray_actor_options": {"num_cpus": 1},
    }
    options = _with_policy(deep_merge(defaults, config.deployment_config), TALKER_POLICY, max(1.0, 0.75 * slots))
    # the config's `max_ongoing_requests` counts requests, which the replica bounds itself; Serve's counts calls
    return {**options, "max_ongoing_requests": config.max_ongoing_calls}


def code2wav_deployment_options(config: Code2WavDeploymentConfig, stream_affinity: bool = False) -> dict[str, Any]:
    """`stream_affinity`: Code2Wav routes by `StreamAffinityRouter` (a call naming the replica that holds its streams'
    state goes there: deployments/ingress/placement.py); without it, by Serve's own router."""
    defaults = {
        "name": C.CODE2WAV_DEPLOYMENT_NAME,
        "max_ongoing_requests": config.max_batch_size * C.CODE2WAV_ONGOING_PER_BATCH_SLOT,
        "max_queued_requests": C.DEFAULT_CODE2WAV_MAX_QUEUED_REQUESTS,
        "health_check_period_s": 10,
        "ray_actor_options": {"num_cpus": 1},
    }
    if stream_affinity:
        defaults["request_router_config"] = {"request_router_class": C.CODE2WAV_REQUEST_ROUTER}
    return _with_policy(deep_merge(defaults, config.deployment_config), CODE2WAV_POLICY, float(config.max_batch_size))


def aligner_deployment_options(config: AlignerDeploymentConfig) -> dict[str, Any]:
    """Each call is one piece; a replica takes a few batches' worth (the rest queue at the caller, then 503)."""
    defaults = {
        "name": C.ALIGNER_DEPLOYMENT_NAME,
        "max_ongoing_requests": config.max_batch_size * C.ALIGNER_ONGOING_PER_BATCH_SLOT,
        "max_queued_requests": C.DEFAULT_ALIGNER_MAX_QUEUED_REQUESTS,
        "health_check_period_s": 10,
        "ray_actor_options": {"num_cpus": 1},
    }
    return deep_merge(defaults, config.deployment_config)


def ingress_deployment_options(args: TTSServingArgs) -> dict[str, Any]:
    """The ingress drains longer than any Talker (Serve's default, 20 s, is far shorter than a Talker's): when
    the app is deleted or redeployed, every deployment stops at once, and an ingress killed first would cut its
    clients' streams off while the Talkers still drain them (a stream that could have finished is lost; an SSE
    client gets no error event). Outliving the Talkers, it ends each stream as its Talker ends it.

    The ingress autoscales from `INGRESS_AUTOSCALING` (several replicas from the first request: one event loop does
    not carry hundreds of streams, docs/serving.md) unless the config sets `num_replicas` (a CPU config: 1)."""
    backpressure = args.ingress.backpressure
    talker_drain_s = max(talker_deployment_options(m)["graceful_shutdown_timeout_s"] for m in args.models)
    defaults = {
        "name": C.INGRESS_DEPLOYMENT_NAME,
        "max_ongoing_requests": C.DEFAULT_INGRESS_MAX_ONGOING_REQUESTS,
        "max_queued_requests": C.DEFAULT_INGRESS_MAX_QUEUED_REQUESTS,
        "backpressure_config": {"status_code": backpressure.status_code, "retry_after_s": backpressure.retry_after_s},
        "graceful_shutdown_timeout_s": talker_drain_s + C.INGRESS_GRACEFUL_SHUTDOWN_MARGIN_S,
        "ray_actor_options": {"num_cpus": 1},
    }
    if "num_replicas" not in args.ingress.deployment_config:
        defaults["autoscaling_config"] = dict(C.INGRESS_AUTOSCALING)
    options = deep_merge(defaults, args.ingress.deployment_config)
    if options["graceful_shutdown_timeout_s"] <= talker_drain_s:
        logger.warning(f"{options['name']}: graceful_shutdown_timeout_s {options['graceful_shutdown_timeout_s']} "
                       f"does not exceed the Talkers' ({talker_drain_s}): deleting or redeploying the app cuts "
                       "open streams off when the ingress stops, before their Talker has drained them")
    return options


def build_talker_deployment(config: TalkerDeploymentConfig, streaming: StreamingConfig) -> Application:
    options = talker_deployment_options(config)
    logger.info(f"{options['name']} deployment options: {options}")
    return serve.deployment(TalkerServer, **options).bind(config, streaming)


def build_code2wav_deployment(config: Code2WavDeploymentConfig, source: CheckpointSource,
                              streaming: StreamingConfig, stream_affinity: bool = False) -> Application:
    options = code2wav_deployment_options(config, stream_affinity)
    logger.info(f"{options['name']} deployment options: {options}")
    return serve.deployment(Code2WavServer, **options).bind(config, source, streaming)


def build_aligner_deployment(config: AlignerDeploymentConfig) -> Application:
    options = aligner_deployment_options(config)
    logger.info(f"{options['name']} deployment options: {options}")
    return serve.deployment(AlignerServer, **options).bind(config)


def build_app(args: TTSServingArgs) -> Application:
    """The application: ingress -> {Talker:<model>}, the shared Code2Wav and the Aligner where configured."""
    if not isinstance(args, TTSServingArgs):
        args = TTSServingArgs.model_validate(args)
    # inconsistent schedules and unknown engine options fail here, not in crash-looping replicas
    args.streaming.schedule()
    for m in args.models:
        engine_config(m.engine_cls or TALKER_ENGINE, m.engine_config_kwargs())
    engine_config(args.code2wav.engine_cls or CODE2WAV_ENGINE,
                  {"max_batch_size": args.code2wav.max_batch_size, **args.code2wav.engine_kwargs})
    talkers = {m.name: build_talker_deployment(m, args.streaming) for m in args.models}
    code2wav = build_code2wav_deployment(args.code2wav, args.codec_source, args.streaming, args.stream_affinity)
    aligner = build_aligner_deployment(args.aligner) if args.aligner is not None else None
    return build_ingress_deployment(args, talkers, code2wav, aligner)


def build_ingress_deployment(args: TTSServingArgs, talkers: dict[str, Application], code2wav: Application,
                             aligner: Application | None = None) -> Application:
    """`TTSIngress` behind a FastAPI app made now, for this application (deployments/ingress/app.py)."""
    options = ingress_deployment_options(args)
    logger.info(f"{options['name']} deployment options: {options}")
    app = make_fastapi_app(BodyLimits(args.ingress.max_request_bytes, args.ingress.body_read_timeout_s),
                           args.ingress.auth)
    extra = {"aligner": aligner} if aligner is not None else {}
    return serve.deployment(make_fastapi_ingress(TTSIngress, app=app), **options).bind(talkers, code2wav, args,
                                                                                       **extra)
