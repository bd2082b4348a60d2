#!/usr/bin/env bash
# Creates .venv-packers with the REAL quantization packers (AutoAWQ 0.2.9, auto-gptq 0.7.1,
# GPTQModel 7.7.0, compressed-tensors 0.20.1, AutoRound 0.16.1; CPU only) that tests/test_real_packers.py,
# tests/test_compressed_tensors.py and tests/test_autoround.py cross-check moeconv against.
#
#   scripts/install-packers.sh               # idempotent: a no-op when the stamp is current
#   PYTHON=python3.11 scripts/install-packers.sh
#   PACKERS_VENV=/some/dir scripts/install-packers.sh   (the tests read MOECONV_PACKERS_VENV)
#
# Every package, dependencies included, is pinned in tests/packers/requirements.txt and installed
# with --no-deps (no resolver run, nothing newer sneaks in); torch is torch==2.13.0, the CPU wheel on
# disk. Needs only PyPI and the local wheel dir, no compiler. The stamp is written last, after a
# smoke run of tests/packers/pack_real.py, so a half-made environment is never taken as ready.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${PACKERS_VENV:-.venv-packers}"
LOCK=tests/packers/requirements.txt
STAMP="$VENV/.packers-installed"

want="$(cat "$LOCK" "$0" | sha256sum | cut -c1-16)"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  echo "install-packers: $VENV is up to date"
  exit 0
fi

version="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [[ "$version" != "3.11" ]]; then
  echo "install-packers: needs Python 3.11 (auto-gptq 0.7.1 is a cp311 wheel); $PYTHON is $version." >&2
  echo "install-packers: set PYTHON=python3.11" >&2
  exit 1
fi

start=$SECONDS
rm -f "$STAMP"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --no-deps -r "$LOCK"

# Smoke test: every packer imports and packs every case (a few seconds).
"$VENV/bin/python" tests/packers/pack_real.py --self-check 2>"$VENV/self-check.log" \
  || { cat "$VENV/self-check.log" >&2; exit 1; }
"$VENV/bin/python" -c "from auto_round import AutoRound; from auto_round.data_type.int import quant_tensor_sym" \
  2>>"$VENV/self-check.log" || { cat "$VENV/self-check.log" >&2; exit 1; }
echo "$want" > "$STAMP"
echo "install-packers: $VENV ready in $((SECONDS - start)) s"
