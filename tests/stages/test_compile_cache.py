"""CompileCache: a second process, with an empty local Inductor cache, compiles from the file the first wrote.

Two subprocesses, each with its own TORCHINDUCTOR_CACHE_DIR (so the only shared thing is the cache file, and the
built C++ kernels, which the later process is given to skip the compiler: `_with_kernels_of`):
the first compiles and writes the file, the second loads it and must get an FX graph cache hit, not a
compilation. CPU Inductor (needs a C++ compiler, as torch.compile on CPU does). Each first process is given the C++
kernels the test process's own Inductor cache and the module's earlier processes hold too (none of their caches of
graphs): the compiler's output is not what these tests are about, and on 2 cores it is most of their time. The
processes are forks of one that imported torch and nothing else (tests/forkserver.py), with their own Inductor cache
directory, as fresh processes would be.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from stages.compile_cache import CompileCache, contents
from tests import forkserver

pytestmark = pytest.mark.slow  # Triton interpreter / Inductor subprocesses: minutes on 2 cores

SCRIPT = r"""
import json, sys, torch
from torch._dynamo.utils import counters
import stages.layers
from stages.compile_cache import CompileCache

cache = CompileCache.for_model(sys.argv[1], torch.device("cpu"), {"model": "test"}, sources=(stages.layers.__file__,),
                               dynamo=sys.argv[2] == "1")
loaded = cache.load(lambda m: None)
if sys.argv[5] == "0":  # a start that cannot use the file's Dynamo work (traces again): Inductor's must serve it
    torch._dynamo.config.caching_precompile = False
f = torch.compile(stages.layers._rms, dynamic=True)  # a function of the engine's: the cache keys its file
if sys.argv[4] == "code2wav":  # under the grad mode of Code2WavEngine's decodes
    from stages.code2wav.engine import DECODE_MODE as mode
else:
    import contextlib
    mode = contextlib.nullcontext
for rows in map(int, sys.argv[3].split(",")):  # default two variants: one row, and every count above it
    with mode():
        f(torch.randn(rows, 3, 8), torch.randn(8), 1e-6)
wrote = cache.save(lambda m: None)
print(json.dumps({"loaded": loaded, "wrote": wrote, "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"],
                  "traced": counters["stats"]["unique_graphs"]}))
"""


def _python(script: str, args: list[str], inductor_dir: Path) -> dict:
    """`script` in a fresh process whose Inductor cache is `inductor_dir`; -> the JSON of its last line."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(inductor_dir), "PYTHONPATH": str(Path(__file__).parents[2])}
    out = forkserver.run([sys.executable, "-c", script, *args], env={**os.environ, **env}, timeout=600,
                         preload=("torch",), late_env=("TORCHINDUCTOR_CACHE_DIR",))  # torch's import reads no cache
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _with_kernels_of(earlier: Path, inductor_dir: Path) -> Path:
    """`inductor_dir` holding the C++ kernels an earlier process built (a later one skips the compiler) and none of
    its Dynamo, AOTAutograd or FX graph caches: what a process started on it does not trace or compile again can
    only come from the cache file."""
    shutil.copytree(earlier, inductor_dir, dirs_exist_ok=True, copy_function=_link, ignore=lambda folder, names: [
        n for n in names if Path(folder) == earlier and n in ("dynamo", "aotautograd", "fxgraph", "locks")])
    return inductor_dir


def _link(src: str, dst: str) -> None:
    """A hard link (Inductor writes a new file and renames it over, never into one it wrote), else a copy; none where
    the name is there already (Inductor names its files by a hash of what they hold)."""
    if os.path.lexists(dst):
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


_built: list[Path] = []  # the C++ kernels this module's processes built (one directory)


@pytest.fixture(scope="module", autouse=True)
def _built_kernels(tmp_path_factory):
    """Starts from the kernels in the test process's Inductor cache (the in-process compile tests' of this run, e.g.
    Code2Wav's transformer; its default location, read without the side effects of Inductor's `cache_dir()`)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    built = tmp_path_factory.mktemp("built_kernels")
    own = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    if own.is_dir():
        _with_kernels_of(own, built)
    _built.append(built)
    yield
    _built.clear()


def _first(run, inductor_dir: Path) -> dict:
    """`run()` of a first process: on an Inductor cache of the module's C++ kernels alone, whose own are kept."""
    _with_kernels_of(_built[0], inductor_dir)
    result = run()
    _with_kernels_of(inductor_dir, _built[0])
    return result


def _run(cache_dir: Path, inductor_dir: Path, dynamo: bool = True, rows: str = "1,4", mode: str = "grad",
         dynamo_work: bool = True, kernels_of: Path | None = None) -> dict:
    def run() -> dict:
        return _python(SCRIPT, [str(cache_dir), "1" if dynamo else "0", rows, mode, "1" if dynamo_work else "0"],
                       inductor_dir)

    if kernels_of is None:
        return _first(run, inductor_dir)
    _with_kernels_of(kernels_of, inductor_dir)
    return run()


def test_a_fresh_process_compiles_from_the_file(tmp_path):
    """Under the grad mode of the engines' forwards (Code2Wav's DECODE_MODE: under inference_mode Dynamo's cached
    work was loaded but every variant traced again in the next process, torch 2.13), the second process traces and
    compiles nothing."""
    first = _run(tmp_path / "shared", tmp_path / "inductor-a", mode="code2wav")
    assert first["loaded"] is False and first["wrote"] is True
    assert first["misses"] >= 1 and first["traced"] == 2  # Dynamo traced both variants
    second = _run(tmp_path / "shared", tmp_path / "inductor-b", mode="code2wav", kernels_of=tmp_path / "inductor-a")
    assert second["loaded"] and not second["wrote"]
    # nothing compiled again, and (Dynamo's caching precompile) nothing traced again either
    assert second["misses"] == 0 and second["traced"] == 0, second


@pytest.fixture(scope="module")
def four_then_one(tmp_path_factory) -> tuple[dict, dict, Path]:
    """A file written by a process that compiled rows of 4, then rewritten by one that loaded it and met a row of 1
    too -> (the first's counters, the second's, the file's directory). Two tests read it; each copies the
    directory before starting its own third process."""
    tmp = tmp_path_factory.mktemp("four_then_one")
    first = _run(tmp / "shared", tmp / "inductor-a", rows="4")
    second = _run(tmp / "shared", tmp / "inductor-b", rows="4,1", kernels_of=tmp / "inductor-a")  # one row: new
    return first, second, tmp


def test_a_variant_the_file_lacks_is_traced_after_loading(tmp_path, four_then_one):
    """Dynamo's names of a loaded function and of a new trace in the same module must not collide (they did: a
    process that loaded the file failed on its first new shape; CompileCache starts Dynamo's counter afresh)."""
    from torch._dynamo import bytecode_transformation

    assert hasattr(bytecode_transformation, "_unique_id_counter"), "the counter CompileCache restarts is gone"
    first, second, earlier = four_then_one
    assert first["wrote"] and first["traced"] == 1
    assert second["loaded"] and second["traced"] == 1, second
    # it wrote the file again with both variants: the next start traces and compiles nothing
    assert second["wrote"]
    shutil.copytree(earlier / "shared", tmp_path / "shared")
    third = _run(tmp_path / "shared", tmp_path / "inductor-c", rows="4,1", kernels_of=earlier / "inductor-b")
    assert third["loaded"] and not third["wrote"] and third["traced"] == 0 and third["misses"] == 0, third


def test_a_rewritten_file_keeps_what_it_had(tmp_path, four_then_one):
    """torch's save returns what this process recorded, and a variant served by Dynamo's loaded work records
    nothing: the rewrite after a new variant dropped the old variant's Inductor work (a served Talker's file went
    21.5 -> 3.7 MiB on an H100). Merged into the file, it stays: a later start that cannot use Dynamo's work (a
    guard that fails, a torch that drops it) traces both variants but compiles neither, in a fresh Inductor cache."""
    first, second, earlier = four_then_one
    assert first["wrote"] and first["misses"] == 1
    assert second["loaded"] and second["wrote"] and second["misses"] == 1  # the new variant only
    shutil.copytree(earlier / "shared", tmp_path / "shared")
    (file,) = (tmp_path / "shared").glob("torch-compile-*.bin")
    assert contents(file)["inductor"][0] == 2  # both variants' graphs (`python -m stages.compile_cache` lists them)
    third = _run(tmp_path / "shared", tmp_path / "inductor-c", rows="4,1", dynamo_work=False,
                 kernels_of=earlier / "inductor-b")
    assert third["loaded"] and third["traced"] == 2 and third["misses"] == 0 and third["hits"] == 2, third


def test_without_dynamo_a_fresh_process_traces_again_but_compiles_nothing(tmp_path):
    first = _run(tmp_path / "shared", tmp_path / "inductor-a", dynamo=False)
    assert first["wrote"] and first["traced"] == 2
    second = _run(tmp_path / "shared", tmp_path / "inductor-b", dynamo=False, kernels_of=tmp_path / "inductor-a")
    assert second["loaded"] and second["hits"] >= 1 and second["misses"] == 0 and second["traced"] == 2, second
    assert not second["wrote"]  # tracing again is not new work for a file without Dynamo's


ENGINE_SCRIPT = r"""
import json, sys
import numpy as np
from torch._dynamo.utils import counters
from stages.code2wav import compiled
from stages.code2wav.engine import Code2WavEngine, Code2WavEngineConfig
from stages.contract import CodecChunk
from stages.qwen3_tts import Qwen3TTS
compiled.enable = lambda decoder: True  # CPU: compile the stateful pre-transformer only (as the engine tests do)
decoder = Qwen3TTS.load(sys.argv[2], "cpu", "float32", talker=False, decoder=True, voice=False).decoder
config = Code2WavEngineConfig(stateful=True, state_slots=4, compile=True, compile_cache_dir=sys.argv[1], max_batch_size=4,
                              batch_buckets=(2, 4), length_buckets=(2, 4), cuda_graphs=False)
engine = Code2WavEngine(decoder, config)  # the compiled functions exist from here on; warmup loads the file
logs = []
engine.warmup(logs.append)
rng = np.random.default_rng(0)
for seq in range(2):
    engine.decode([CodecChunk(f"s{i}", seq, rng.integers(0, 2048, (3, 16)), 0) for i in range(3)])
cache = engine.compile_cache()  # a fresh handle (not `loaded`): it writes whenever torch recorded anything new
wrote = cache.save(logs.append)
print(json.dumps({"traced": counters["stats"]["unique_graphs"], "wrote": wrote, "logs": logs}))
"""


def test_a_code2wav_engine_reuses_dynamos_work_from_its_file(tmp_path, tiny_custom_voice):
    """The engine's compiled functions exist before its warm-up loads the file, and torch.compile reads Dynamo's
    caching precompile switch (which the load turns on) when it wraps a function: wrapped then, their Dynamo work
    was never recorded, and every start traced them again (an H100, 2026-11-25: the served Code2Wav's file held
    no Dynamo work; `stages/code2wav/compiled.py` now wraps at the first call)."""
    def run(inductor: str) -> dict:
        return _python(ENGINE_SCRIPT, [str(tmp_path / "shared"), str(tiny_custom_voice)], tmp_path / inductor)

    first = _first(lambda: run("inductor-a"), tmp_path / "inductor-a")
    assert first["traced"] >= 1
    (file,) = (tmp_path / "shared").glob("torch-compile-*.bin")
    assert "precompile" in contents(file), contents(file)
    _with_kernels_of(tmp_path / "inductor-a", tmp_path / "inductor-b")
    second = run("inductor-b")
    assert second["traced"] == 0 and not second["wrote"], second


TWO_CACHES_SCRIPT = r"""
import sys, torch
import stages.layers
from stages.compile_cache import CompileCache
first = CompileCache.for_model(sys.argv[1], torch.device("cpu"), {"model": "first"})
first.load(lambda m: None)
torch.compile(stages.layers._rms, dynamic=True)(torch.randn(4, 3, 8), torch.randn(8), 1e-6)
first.save(lambda m: None)
second = CompileCache.for_model(sys.argv[1], torch.device("cpu"), {"model": "second"})
second.load(lambda m: None)
torch.compile(lambda x: torch.sin(x) * 2, dynamic=True)(torch.randn(4, 8))
second.save(lambda m: None)
print("{}")
"""


def test_a_second_cache_in_a_process_writes_its_own_work_only(tmp_path):
    """torch's save returns everything the process serialized so far: the Talker's first-chunk decoder, saving
    after the Talker in one process, wrote the Talker's artifacts into its own file too (55.5 MiB for 6)."""
    _first(lambda: _python(TWO_CACHES_SCRIPT, [str(tmp_path / "shared")], tmp_path / "inductor"), tmp_path / "inductor")
    from torch.compiler._cache import CacheArtifactManager, _deserialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    CacheArtifactManager._ensure_cache_artifacts_registered()
    files = sorted((tmp_path / "shared").glob("torch-compile-*.bin"))
    assert len(files) == 2
    for file in files:  # one batch of each artifact type, one Inductor graph: nothing of the other cache's
        kinds = [kind for kind, _ in AppendingByteSerializer.to_list(file.read_bytes(),
                                                                    deserialize_fn=_deserialize_single_cache)]
        assert len(kinds) == len(set(kinds)) and contents(file)["inductor"][0] == 1, (file.name, kinds)


def test_a_broken_file_is_skipped_and_keys_differ(tmp_path):
    cache = CompileCache.for_model(tmp_path, torch.device("cpu"), {"model": "a"})
    assert cache.path != CompileCache.for_model(tmp_path, torch.device("cpu"), {"model": "b"}).path
    # the compiled code is part of the key: a file written by other source is never offered
    source = tmp_path / "kernels.py"
    source.write_text("def f(x):\n    return x + 1\n")
    keyed = CompileCache.for_model(tmp_path, torch.device("cpu"), {"model": "a"}, sources=(source,))
    source.write_text("def f(x):\n    return x + 2\n")
    assert keyed.path != CompileCache.for_model(tmp_path, torch.device("cpu"), {"model": "a"}, sources=(source,)).path
    assert keyed.path != cache.path
    # a file without Dynamo's work is another file
    assert CompileCache.for_model(tmp_path, torch.device("cpu"), {"model": "a"}, dynamo=False).path != cache.path
    # and so is one written under another torch thread count (Dynamo's global-state guard holds the count: a
    # replica, whose count is its OMP_NUM_THREADS, would trace and compile all of that file's work again)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert CompileCache.for_model(tmp_path, torch.device("cpu"), {"model": "a"}).path != cache.path
    finally:
        torch.set_num_threads(threads)
    assert CompileCache.for_model(tmp_path, torch.device("cpu"), {"model": "a"}).path == cache.path
    cache.path.write_bytes(b"not a cache")
    logs: list[str] = []
    assert cache.load(logs.append) is False and not cache.loaded
    assert "could not load" in logs[-1]


@pytest.mark.parametrize("engine_cls,expected", [(None, True), ("tests.fakes:FakeEngine", False)])
def test_deployment_defaults_the_cache_dir_for_the_real_engine(engine_cls, expected):
    from deployments import constants as C
    from deployments.config import TalkerDeploymentConfig

    kwargs = TalkerDeploymentConfig(name="m", engine_cls=engine_cls).engine_config_kwargs()
    assert (kwargs.get("compile_cache_dir") == str(C.COMPILE_CACHE_DIR)) == expected
    off = TalkerDeploymentConfig(name="m", engine_kwargs={"compile_cache_dir": None}).engine_config_kwargs()
    assert off["compile_cache_dir"] is None
