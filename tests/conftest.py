"""Shared test fixtures: paths of real models and of the transformers reference interpreter.

Sections are owned by different developers: keep this file additive. Locations and the
skip-or-fail policy live in tests/hf_harness.py: a missing reference env or model skips the
tests that need it, except under CI (env CI set), where it fails them.
"""

import os
import pathlib
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # tests/ helpers importable

import hf_harness  # noqa: E402


def _pin_xdist_worker() -> None:
  """Give each pytest-xdist worker its own share of the allowed CPUs, before JAX starts: XLA
  sizes its CPU thread pools from the affinity mask, so 2 workers on 2 cores no longer run 2
  threads each on the same cores (suite subsets measured 5.7-7% faster in wall time)."""
  worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
  if not (worker and count and hasattr(os, "sched_setaffinity")):
    return
  cpus, index, count = sorted(os.sched_getaffinity(0)), int(worker.removeprefix("gw")), int(count)
  if 1 < count <= len(cpus):
    os.sched_setaffinity(0, cpus[index % count::count])


_pin_xdist_worker()


def _memory_mappings() -> tuple[int, int] | None:
  """(memory mappings this process holds, the kernel's per-process limit vm.max_map_count), or
  None where /proc does not tell."""
  try:
    with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
      return sum(1 for _ in maps), int(limit.read())
  except OSError:
    return None


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
  """Drop jax's compiled programs after each test file. XLA:CPU maps every compiled kernel's code
  and data into memory mappings of their own (~70 per stories260K `generate` call); an xdist
  worker that kept all of its files' programs alive reached vm.max_map_count (65530 by default)
  about 90% through the suite, and the next compile segfaulted (the CI of session 54's
  submission; a local run in session 55 crashed at 64K mappings). With the caches dropped a
  file's programs are all a worker holds; a file that alone holds more than half the limit fails
  here, by name, instead of crashing a later file's compile."""
  yield
  import gc

  import jax
  jax.clear_caches()
  gc.collect()
  held = _memory_mappings()
  if held is not None and held[0] > held[1] // 2:
    pytest.fail(f"{held[0]} memory mappings are still held after this file's compiled programs "
                f"were dropped (vm.max_map_count is {held[1]}); a later compile would segfault "
                f"at the limit")


# The env var naming the run's persistent compilation cache ("" turns it off). Set it to a
# directory of your own to keep compiled programs across local runs.
COMPILE_CACHE_ENV = "SPARSEDEC_TEST_COMPILE_CACHE"


def pytest_configure(config):
  """One on-disk cache of compiled programs for the run, shared by the xdist workers. Every
  test file drops its compiled programs (`_release_compiled_programs`), and the workers are
  separate processes, so the same stories260K / SmolLM2 steps were compiled again file after
  file; now a later compile of the same program (same HLO, options and jax version: jax's
  cache key) loads it from disk. Compile counts are unchanged: jax reports a load from the
  cache as a compile (`backend_compile_duration`), so the recompile tests still see them. The
  controller (or a plain run) makes a fresh directory and removes it at the end; the workers
  it starts inherit the env var."""
  if COMPILE_CACHE_ENV not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ[COMPILE_CACHE_ENV] = tempfile.mkdtemp(prefix="sparsedec-compiled-")
    config.add_cleanup(lambda: shutil.rmtree(os.environ.pop(COMPILE_CACHE_ENV),
                                             ignore_errors=True))
  path = os.environ.get(COMPILE_CACHE_ENV, "")
  if path:
    import jax
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # No size bound: with one, jax locks the directory and scans every entry on each write
    # (quadratic: the suite ran slower than without a cache). Unlocked, a worker that reads an
    # entry the other is still writing gets a decompression error, which jax turns into a
    # warning and a compile.


ROOT = hf_harness.REPO
SHARED = hf_harness.SHARED
STORIES_HF = hf_harness.STORIES260K
# The embedded default checkpoint (sparsedec format, in every clone; test_weights checks it
# equals STORIES_HF's weights): what tests load when they need the model, not its HF files.
STORIES = hf_harness.REPO / "checkpoints" / "stories260K"


@pytest.fixture(scope="session")
def hf_python() -> pathlib.Path:
  """The Python 3.11 interpreter with transformers: $SPARSEDEC_HF_PYTHON, else <repo>/.hfenv,
  else <repo>/../.hfenv. Skips when absent (fails under CI)."""
  python = hf_harness.find_hf_python()
  if python is None:
    tried = ", ".join(str(p) for p in hf_harness.hf_python_candidates())
    hf_harness.unavailable(
        f"transformers reference interpreter not found (tried {tried}; set SPARSEDEC_HF_PYTHON)")
  return python


@pytest.fixture(scope="session")
def hf_reference(hf_python, tmp_path_factory) -> hf_harness.HFReference:
  """Runs tests/hf_reference/reference.py jobs (`.run(job_name, tasks)`), once per session."""
  return hf_harness.HFReference(hf_python, tmp_path_factory.mktemp("hf_reference"))


@pytest.fixture(scope="session")
def stories_hf_dir() -> pathlib.Path:
  """stories260K in HF layout (../shared/models/stories260K)."""
  if not (STORIES_HF / "config.json").is_file():
    hf_harness.unavailable(f"stories260K not found at {STORIES_HF}")
  return STORIES_HF


@pytest.fixture(scope="session")
def smollm2_gguf() -> pathlib.Path:
  """SmolLM2-135M-Instruct Q4_1 GGUF (env SPARSEDEC_SMOLLM2_GGUF, default
  <repo>/.cache/models/...; scripts/setup.sh fetches it). Skips when absent (fails under CI)."""
  path = hf_harness.smollm2_gguf_path()
  if not path.is_file():
    hf_harness.unavailable(f"SmolLM2 GGUF not found at {path} (set SPARSEDEC_SMOLLM2_GGUF)")
  return path


@pytest.fixture(scope="module")
def stories():
  """(cfg, params, tokenizer) of the embedded stories260K checkpoint (fp32)."""
  from sparsedec.weights.checkpoint import load_model
  return load_model(STORIES)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
  """(cfg, params, tokenizer) of SmolLM2-135M-Instruct from its GGUF, in fp32, the params as
  device arrays (`load_gguf` returns numpy, which every jitted call would copy again)."""
  import jax
  from sparsedec.weights.gguf_file import load_gguf
  cfg, params, tok = load_gguf(smollm2_gguf, dtype="float32")
  return cfg, jax.device_put(params), tok
