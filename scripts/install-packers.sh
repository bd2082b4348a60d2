#!/usr/bin/env bash
# Creates .venv-packers: the REAL quantization packers that tests/test_real_packers.py
# cross-checks moeconv's decoders and encoders against (AutoAWQ, auto-gptq, GPTQModel).
# CPU only; see shared reference checkpoints.md §3 for why each package is installed the way it is.
#
# Idempotent: does nothing when the stamp file matches this script's pins.
# Usage: scripts/install-packers.sh            (PYTHON=python3.11 to choose the interpreter)
#        PACKERS_VENV=path scripts/install-packers.sh
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${PACKERS_VENV:-.venv-packers}"
STAMP="$VENV/.packers-installed"

# Every version pinned. torch MUST be the CPU wheel on disk (an unpinned torch pulls CUDA).
TORCH="torch==2.13.0"
BASE_PINS=(
  "numpy==2.3.5"
  "safetensors==0.8.0"
  "transformers==5.24.0"
  "accelerate==1.15.0"
)
PACKERS=(
  "autoawq==0.2.9"      # sdist, pure python; import bypasses awq/__init__ (needs datasets + old transformers)
  "auto-gptq==0.7.1"    # cp311 wheel; import bypasses auto_gptq/__init__ (needs peft, rouge, gekko, ...)
  "gptqmodel==7.7.0"    # sdist, pure-python build; metadata wants torch>=2.14.1, hence --no-deps
)
# What GPTQModel's import chain needs beyond the base pins (its own requirements drag in far more).
GPTQMODEL_DEPS=(
  "pypcre==0.2.8"
  "logbar==0.2.4"
  "threadpoolctl==3.6.0"
  "device-smi==0.5.2"
  "tokenicer==0.0.6"
  "defuser==0.0.7"
  "pillow==12.0.0"
  "requests==2.32.5"
  "urllib3==2.5.0"
  "certifi==2025.11.12"
)

want="$(printf '%s\n' "$TORCH" "${BASE_PINS[@]}" "${PACKERS[@]}" "${GPTQMODEL_DEPS[@]}" | sha256sum | cut -c1-16)"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  echo "install-packers: $VENV is up to date"
  exit 0
fi

start=$SECONDS
rm -f "$STAMP"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" "$TORCH"
"${PIP[@]}" "$TORCH" "${BASE_PINS[@]}"
"${PIP[@]}" --no-deps "${PACKERS[@]}"
"${PIP[@]}" --no-deps "${GPTQMODEL_DEPS[@]}"

# Smoke test: the packers import the way tests/packers/pack_real.py imports them.
"$VENV/bin/python" tests/packers/pack_real.py --self-check
echo "$want" > "$STAMP"
echo "install-packers: $VENV ready in $((SECONDS - start)) s"
