import atexit
import functools
import gc
import json
import os
import shutil
import tempfile
from pathlib import Path

# OpenMP threads that spin ~300k times between parallel regions collapse when other processes
# want the same cores (a test of a few decode steps took minutes next to three other jobs on
# 2 cores): the wait policy kvserve's CLI sets, before torch loads libgomp (see kvserve/__init__)
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
# kvserve's on-disk cache (GGUF tokenizers rebuilt once: kvserve.engine.tokenizer) in a folder of
# this test session, which the server and rank processes the tests start inherit
if "KVSERVE_CACHE_DIR" not in os.environ:
    os.environ["KVSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvserve-test-cache-")
    atexit.register(shutil.rmtree, os.environ["KVSERVE_CACHE_DIR"], True)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)

#: transformers' fp32 greedy outputs for SmolLM2 on the same GGUF (a copy of the project's
#: shared/reference/smollm2_greedy.json, kept here so that a clean clone runs the comparison).
REFERENCE = Path(__file__).resolve().parent / "data" / "smollm2_greedy.json"


_frozen_for = [None]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """At the first test of each module (the previous module's fixtures torn down by then):
    collect the garbage, then move every object still alive (imported modules, session
    fixtures, caches: ~0.4-1 million objects once transformers, scipy and sympy are loaded) to
    the collector's permanent generation (``gc.freeze``). Each full collection then walks only
    the objects made since, not all of them: every engine start runs one
    (``release_freed_memory``), and each took 0.2-0.4 s in this process (11 of the 15 s of the
    randomized engine test). Frozen objects are still freed by reference counting."""
    module = item.nodeid.split("::")[0]
    if module != _frozen_for[0]:
        _frozen_for[0] = module
        gc.collect()
        gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def _cache_weights():
    """Load each model file once per test session (dequantizing the GGUF takes seconds)."""
    import kvserve.worker.loader as loader
    import kvserve.worker.worker as worker_mod

    cached = functools.lru_cache(maxsize=4)(loader.load_weights)
    orig = worker_mod.load_weights
    worker_mod.load_weights = lambda path, progress=None, keep_quantized=False: _copy(cached(path, keep_quantized=keep_quantized))
    yield
    worker_mod.load_weights = orig


def _copy(res):
    cfg, state = res
    return cfg, dict(state)  # tensors are shared read-only; the dict is the caller's


@pytest.fixture(scope="session")
def reference():
    if not REFERENCE.is_file():
        pytest.skip(f"reference outputs not found at {REFERENCE}")
    return json.loads(REFERENCE.read_text())


@pytest.fixture(scope="session")
def smollm2_path():
    from kvserve.worker.default_model import ModelNotFoundError, default_model_path

    try:
        return default_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def llm_fp32(smollm2_path):
    from kvserve import LLM

    return LLM(dtype="float32", max_model_len=1024, quantization="none")  # (dequantized: the reference's numbers)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """arch -> (folder, transformers model) for the tiny random configs."""
    from tiny_models import make_model

    cache = {}

    def get(arch: str):
        if arch not in cache:
            d = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[arch] = (d, make_model(d, arch))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' SmolLM2 from the same GGUF, float32 (the reference implementation)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def tp_pool():
    """``get(world_size=2)``: a :class:`tp_harness.RankPool` of that many spawned ranks in one gloo
    group, started on first use (a few seconds) and again after a failure killed it; closed at
    the end of the test module (no rank outlives the tests that use it)."""
    from tp_harness import RankPool

    pools = {}

    def get(world_size: int = 2):
        pool = pools.get(world_size)
        if pool is None or not pool.alive:
            pool = pools[world_size] = RankPool(world_size)
        return pool

    yield get
    for pool in pools.values():
        pool.close()
