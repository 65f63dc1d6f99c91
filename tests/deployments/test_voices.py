"""VoiceStore: uploads persist on disk with their clone prompts; stale caches are dropped."""

from __future__ import annotations

import numpy as np

from deployments.ingress.voice_store import VoiceStore
from stages.contract import VoiceClonePrompt


def _prompt(seed: int, icl: bool = True) -> VoiceClonePrompt:
    rng = np.random.default_rng(seed)
    return VoiceClonePrompt(rng.standard_normal(64).astype(np.float32),
                            ref_codes=rng.integers(0, 2048, (7, 16)) if icl else None,
                            ref_text_ids=(5, 6, 7) if icl else None)


def _same(a: VoiceClonePrompt, b: VoiceClonePrompt) -> bool:
    return (np.array_equal(a.x_vector, b.x_vector) and a.ref_text_ids == b.ref_text_ids
            and (a.ref_codes is None) == (b.ref_codes is None)
            and (a.ref_codes is None or np.array_equal(a.ref_codes, b.ref_codes)))


def test_voice_survives_a_new_store_instance(tmp_path):
    store = VoiceStore(tmp_path)
    record = store.save("Alice", b"RIFFdata", "hello", False, "audio/wav", {"fp1": _prompt(1)})
    again = VoiceStore(tmp_path)  # a restarted ingress
    (listed,) = again.list()
    assert listed == record and listed.public()["name"] == "Alice" and "uid" not in listed.public()
    assert again.audio(listed) == b"RIFFdata"
    assert _same(again.prompt(listed, "fp1"), _prompt(1))
    assert again.prompt(listed, "fp2") is None
    again.put_prompt(listed, "fp2", _prompt(2, icl=False))
    assert _same(VoiceStore(tmp_path).prompt(listed, "fp2"), _prompt(2, icl=False))
    assert again.find("alice") == listed


def test_reupload_replaces_and_invalidates_cached_prompts(tmp_path):
    store = VoiceStore(tmp_path)
    old = store.save("v", b"a", None, True, None, {"fp": _prompt(1)})
    other = VoiceStore(tmp_path)
    assert _same(other.prompt(other.get("v"), "fp"), _prompt(1))
    new = store.save("v", b"b", None, True, None, {"fp": _prompt(2)})
    assert new.uid != old.uid
    assert _same(other.prompt(other.get("v"), "fp"), _prompt(2))  # other replica sees the new voice
    assert len(store.list()) == 1


def test_delete_and_bad_names(tmp_path):
    store = VoiceStore(tmp_path)
    store.save("v", b"a", None, True, None, {})
    assert store.delete("v") and not store.delete("v")
    assert store.list() == []
    assert store.get("../etc") is None and store.get("a/b") is None
