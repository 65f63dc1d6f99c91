"""The servers use their engines through Protocols (deployments/{talker,code2wav}/engine_protocol.py): the
production engines and the fake one implement every member, so the servers call them without probing."""

from __future__ import annotations

import inspect
from typing import Protocol

import pytest

from deployments.code2wav.engine_protocol import Code2WavEngineProtocol
from deployments.talker.engine_protocol import TalkerEngineProtocol
from tests.fake_engine import FakeTalkerEngine


def _members(protocol: type) -> set[str]:
    """A Protocol's own methods, properties and annotated attributes."""
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names


def _check(engine_cls: type, protocol: type, config_members: type) -> None:
    """Every member on the class (or, for the config and per-instance attributes, set in __init__), and the config
    class has every field the server reads, with the Protocol's parameter names."""
    init = inspect.getsource(engine_cls.__init__)
    for name in _members(protocol):
        assert hasattr(engine_cls, name) or f"self.{name}" in init, f"{engine_cls.__name__} lacks {name}"
        member = getattr(protocol, name, None)
        if callable(member) and not isinstance(member, property):
            wanted = list(inspect.signature(member).parameters)
            have = list(inspect.signature(getattr(engine_cls, name)).parameters)
            assert have[:len(wanted)] == wanted, f"{engine_cls.__name__}.{name}{have} vs {wanted}"
    fields = set(inspect.signature(engine_cls.config_cls).parameters)
    assert set(config_members.__annotations__) <= fields


@pytest.mark.parametrize("engine_path", ["stages.talker.engine:TalkerEngine", "tests.fake_engine:FakeTalkerEngine"])
def test_talker_engines_implement_the_protocol(engine_path):
    from deployments.loading import import_object
    from deployments.talker.engine_protocol import TalkerEngineSettings

    _check(import_object(engine_path), TalkerEngineProtocol, TalkerEngineSettings)


def test_the_code2wav_engine_implements_the_protocol():
    from deployments.code2wav.engine_protocol import Code2WavEngineSettings
    from stages.code2wav.engine import Code2WavEngine

    _check(Code2WavEngine, Code2WavEngineProtocol, Code2WavEngineSettings)


def test_a_fake_engine_instance_is_a_talker_engine_at_run_time():
    assert isinstance(FakeTalkerEngine(model=None), TalkerEngineProtocol)
    assert not isinstance(object(), TalkerEngineProtocol)
    assert issubclass(TalkerEngineProtocol, Protocol)


def test_the_aligner_implements_the_protocol():
    """stages.aligner.Aligner as AlignerServer uses it (deployments/aligner/engine_protocol.py)."""
    from deployments.aligner.engine_protocol import AlignerEngineProtocol
    from stages.aligner.aligner import Aligner

    init = inspect.getsource(Aligner.__init__)
    for name in _members(AlignerEngineProtocol):
        assert hasattr(Aligner, name) or f"self.{name}" in init, f"Aligner lacks {name}"
        member = getattr(AlignerEngineProtocol, name, None)
        if callable(member):
            wanted = list(inspect.signature(member).parameters)
            assert list(inspect.signature(getattr(Aligner, name)).parameters)[:len(wanted)] == wanted
    assert _members(AlignerEngineProtocol) == {"max_seconds", "min_samples", "prepare_piece", "warm_up",
                                               "one_time_work",
                                               "align_prepared"}
