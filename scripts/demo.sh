#!/usr/bin/env bash
# THE main job: prepare .venv, then generate from a prompt with the embedded stories260K model
# (checkpoints/stories260K). The text goes to stdout; the stats line (tokens/s, steps, tau) to
# stderr. Extra arguments go to `sparsedec generate` (e.g. --temperature 0.8 --seed 1).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/setup.sh --venv-only
exec .venv/bin/sparsedec generate --prompt "Once upon a time" --max-new-tokens 200 "$@"
