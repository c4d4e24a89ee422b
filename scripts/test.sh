#!/usr/bin/env bash
# THE test command: prepare the environments (scripts/setup.sh), then run the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k hf_equivalence -x).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/setup.sh
# Two pytest-xdist workers (the CI machines have 2 cores); --dist loadfile keeps a test file's
# session fixtures (HF reference runs, compiled steps) in one worker. --max-worker-restart=0: a
# worker that crashes ends the run at once, naming its test; with restarts, pytest-xdist 3.8's
# loadfile scheduler can wait forever for the replaced worker's files (pytest-xdist #1378).
exec .venv/bin/python -m pytest -q -n "${SPARSEDEC_TEST_WORKERS:-2}" --dist loadfile \
  --max-worker-restart=0 tests "$@"
