#!/usr/bin/env bash
# The demo model's whole pipeline (issues 5, 20), one stage after another, with each stage's wall time
# (about 55 minutes on the 2-core development CPU; demo/model/README.md has the figures):
#
#   1 data      python -m demo.data                     generated tasks + some stdlib code, tokenizer, eval set
#   2 pretrain  wedlm-train configs/demo_pretrain.yaml  AR-only from scratch, exported to HF
#   3 convert   wedlm-convert hf-to-orbax, orbax-to-hf  the trained model through the converter and
#               back; the round trip must give the same tensors and config (checked here)
#   4 adapt     wedlm-train configs/demo_adapt.yaml     WeDLM adaptation (dual stream + AR loss) from
#               the round-tripped HF folder, exported to HF
#   5 decode    wedlm-decode streaming / ar / block     counting, arithmetic, code prompts of the eval
#               set; a decoding trace (HTML, and PNG with matplotlib)
#
# Usage (from the repository root, with the venv active or .venv present):
#   demo/pipeline.sh                               the real run (~55 min on a 2-core CPU)
#   demo/pipeline.sh --smoke                       every command on a small data subset, 20 steps
#   demo/pipeline.sh --measure                     step times of the real configs (a few steps each;
#                                                  needs a pretrained HF folder: run --smoke first)
# Options: --runs DIR (default runs/demo, or runs/demo_smoke with --smoke), --data DIR (default
# data/demo, or data/demo_smoke), --rebuild-data, --from STAGE (skip the stages before it), any
# further KEY=VALUE arguments go to both wedlm-train calls (e.g. mesh.data=1).
# Stage times are appended to RUNS/stages.tsv; decode results are RUNS/decode_<method>.json.
# A --runs folder that exists, is not empty and was not made by this script (no .demo-pipeline file
# in it) is refused, never overwritten; so is a --data folder that demo.data did not build.
set -euo pipefail

cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then source .venv/bin/activate; fi

MODE=real; RUNS=""; DATA=""; REBUILD=0; FROM=data; EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) MODE=smoke ;;
    --measure) MODE=measure ;;
    --runs) RUNS="$2"; shift ;;
    --data) DATA="$2"; shift ;;
    --rebuild-data) REBUILD=1 ;;
    --from) FROM="$2"; shift ;;
    *=*) EXTRA+=("$1") ;;
    *) echo "demo/pipeline.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
case "$FROM" in data|pretrain|convert|adapt|decode) ;;
  *) echo "demo/pipeline.sh: --from takes data, pretrain, convert, adapt or decode, not $FROM" >&2; exit 2 ;;
esac
if [ "$MODE" = smoke ]; then
  RUNS=${RUNS:-runs/demo_smoke}; DATA=${DATA:-data/demo_smoke}
  DATA_ARGS=(--train-mb 0.3 --eval-count 8 --eval-arith 8 --eval-lists 4 --eval-records 4 --eval-code 4)
  TRAIN_ARGS=(steps=20 optimizer.warmup_steps=4 data.seq_len=128 data.global_batch_size=8 log_every=5
              checkpoint.every=10)
  MAX_NEW=32
else
  RUNS=${RUNS:-runs/demo}; DATA=${DATA:-data/demo}
  DATA_ARGS=(); TRAIN_ARGS=(); MAX_NEW=64
fi
OWNED="$RUNS/.demo-pipeline"
if [ -e "$RUNS" ] && { [ ! -d "$RUNS" ] || [ -n "$(ls -A "$RUNS")" ]; } && [ ! -f "$OWNED" ]; then
  echo "demo/pipeline.sh: $RUNS exists and was not made by this pipeline (no $OWNED); refusing to" \
       "overwrite it: move it away or pass another --runs" >&2
  exit 2
fi
if [ -e "$DATA" ] && [ ! -f "$DATA/stats.json" ] && { [ ! -d "$DATA" ] || [ -n "$(ls -A "$DATA")" ]; }; then
  echo "demo/pipeline.sh: $DATA exists and was not built by python -m demo.data (no stats.json);" \
       "refusing to overwrite it: move it away or pass another --data" >&2
  exit 2
fi
mkdir -p "$RUNS"
touch "$OWNED"
STAGES="$RUNS/stages.tsv"
ORDER=(data pretrain convert adapt decode)
run_from() {  # run_from STAGE: true when STAGE is at or after --from
  local s; for s in "${ORDER[@]}"; do [ "$s" = "$FROM" ] && return 0; [ "$s" = "$1" ] && return 1; done
}
stage() {  # stage NAME COMMAND...: run, time, record
  local name=$1; shift
  echo "=== $name: $*" >&2
  local t0; t0=$(date +%s.%N)
  "$@"
  local dt; dt=$(python -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$t0" "$(date +%s.%N)")
  printf '%s\t%s\t%s\t%s\n' "$(date -u +%FT%TZ)" "$MODE" "$name" "$dt" >> "$STAGES"
  echo "=== $name: ${dt} s" >&2
}
step_times() {  # step_times METRICS.jsonl CONFIG [project]: median step time (compile excluded);
                # with "project" (the config's own shapes were run) the config's total time
  python - "$1" "$2" "${3:-}" <<'EOF'
import json, statistics, sys
from train.config import load_config
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
steady = [r["step_time_s"] for r in rows if not r.get("includes_compile") and "step_time_s" in r]
if not steady:
    sys.exit(f"{sys.argv[1]}: no steady-state steps logged")
cfg = load_config(sys.argv[2])
med = statistics.median(steady)
tps = statistics.median(r["tokens_per_s"] for r in rows if not r.get("includes_compile"))
line = (f"{sys.argv[1]}: median step {med:.2f} s over {len(steady)} logged steps (min {min(steady):.2f}, "
        f"max {max(steady):.2f}), {tps:,.0f} tokens/s")
if sys.argv[3] == "project":
    line += f"; {sys.argv[2]} ({cfg.steps} steps) ~ {med * cfg.steps / 3600:.2f} h"
print(line)
EOF
}

TRAIN_DATA=(data.train_files="[$DATA/train.jsonl]" data.tokenizer="$DATA/tokenizer")

if [ "$MODE" = measure ]; then
  HF="$RUNS/pretrain/hf"
  [ -f "$HF/config.json" ] || HF=runs/demo_smoke/pretrain/hf
  [ -f "$HF/config.json" ] || { echo "demo/pipeline.sh --measure: no pretrained HF folder ($RUNS/pretrain/hf or runs/demo_smoke/pretrain/hf); run --smoke first" >&2; exit 2; }
  [ -f "$DATA/train.jsonl" ] || { echo "demo/pipeline.sh --measure: no data in $DATA; run python -m demo.data --out $DATA" >&2; exit 2; }
  rm -rf "$RUNS/measure_pretrain" "$RUNS/measure_adapt"
  stage measure_pretrain wedlm-train --config configs/demo_pretrain.yaml --no-progress "${TRAIN_DATA[@]}" steps=12 \
    optimizer.warmup_steps=2 log_every=1 checkpoint.dir="$RUNS/measure_pretrain" checkpoint.export_hf=null \
    checkpoint.every=1000 "${EXTRA[@]}"
  stage measure_adapt wedlm-train --config configs/demo_adapt.yaml --no-progress "${TRAIN_DATA[@]}" model.from_hf="$HF" \
    steps=8 optimizer.warmup_steps=2 log_every=1 checkpoint.dir="$RUNS/measure_adapt" checkpoint.export_hf=null \
    checkpoint.every=1000 "${EXTRA[@]}"
  step_times "$RUNS/measure_pretrain/metrics.jsonl" configs/demo_pretrain.yaml project | tee "$RUNS/step_times.txt"
  step_times "$RUNS/measure_adapt/metrics.jsonl" configs/demo_adapt.yaml project | tee -a "$RUNS/step_times.txt"
  exit 0
fi

# 1. data
if run_from data; then
  if [ -f "$DATA/stats.json" ] && [ $REBUILD = 0 ]; then
    echo "=== data: reusing $DATA (--rebuild-data to build it again)" >&2
  else
    stage data python -m demo.data --out "$DATA" --force "${DATA_ARGS[@]}"
  fi
fi

# 2. AR-only pretraining from scratch, exported to HF
if run_from pretrain; then
  rm -rf "$RUNS/pretrain"
  stage pretrain wedlm-train --config configs/demo_pretrain.yaml --no-progress "${TRAIN_DATA[@]}" \
    checkpoint.dir="$RUNS/pretrain" checkpoint.export_hf="$RUNS/pretrain/hf" \
    "${TRAIN_ARGS[@]}" "${EXTRA[@]}"
  step_times "$RUNS/pretrain/metrics.jsonl" configs/demo_pretrain.yaml
fi

# 3. the trained model through the converter and back: same tensors, same config
if run_from convert; then
  stage convert_to_orbax wedlm-convert hf-to-orbax --hf "$RUNS/pretrain/hf" --out "$RUNS/pretrain/orbax" \
    --force --no-progress
  stage convert_to_hf wedlm-convert orbax-to-hf --orbax "$RUNS/pretrain/orbax" --out "$RUNS/pretrain/hf_roundtrip" \
    --force --no-progress
  python - "$RUNS/pretrain/hf" "$RUNS/pretrain/hf_roundtrip" <<'EOF'
import json, os, sys
import numpy as np
from safetensors.numpy import load_file
a, b = sys.argv[1], sys.argv[2]
ta, tb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
assert ta.keys() == tb.keys(), sorted(set(ta) ^ set(tb))
worst = max(float(np.abs(ta[k].astype(np.float64) - tb[k].astype(np.float64)).max()) for k in ta)
ca, cb = (json.load(open(os.path.join(d, "config.json"))) for d in (a, b))
assert ca == cb, {k: (ca.get(k), cb.get(k)) for k in set(ca) | set(cb) if ca.get(k) != cb.get(k)}
assert os.path.exists(os.path.join(b, "tokenizer.json")), "tokenizer.json did not travel"
assert worst == 0.0, f"round trip changed a tensor by {worst}"
print(f"convert round trip: {len(ta)} tensors identical, config.json identical, tokenizer carried")
EOF
fi

# 4. WeDLM adaptation from the round-tripped HF folder
if run_from adapt; then
  rm -rf "$RUNS/adapt"
  stage adapt wedlm-train --config configs/demo_adapt.yaml --no-progress "${TRAIN_DATA[@]}" \
    model.from_hf="$RUNS/pretrain/hf_roundtrip" checkpoint.dir="$RUNS/adapt" \
    checkpoint.export_hf="$RUNS/adapt/hf" "${TRAIN_ARGS[@]}" "${EXTRA[@]}"
  step_times "$RUNS/adapt/metrics.jsonl" configs/demo_adapt.yaml
fi

# 5. decode eval prompts (one counting, one arithmetic, one code) with each method, and a trace
if run_from decode; then
  python - "$DATA/eval.jsonl" "$RUNS/prompts.jsonl" <<'EOF'
import json, sys
items = [json.loads(l) for l in open(sys.argv[1])]
picked = [next(e for e in items if e["kind"] == k) for k in ("counting", "arith", "records", "code")]
with open(sys.argv[2], "w") as f:
    for e in picked:
        f.write(json.dumps({"prompt": e["prompt"]}) + "\n")
EOF
  for m in streaming ar block; do
    stage "decode_$m" wedlm-decode --checkpoint "$RUNS/adapt/hf" --prompts-file "$RUNS/prompts.jsonl" \
      --method "$m" --max-new-tokens "$MAX_NEW" --json > "$RUNS/decode_$m.json"
  done
  python - "$RUNS" <<'EOF'
import json, sys
runs = sys.argv[1]
print(f"{'method':<10}{'tokens':>8}{'forwards':>10}{'tok/fwd':>9}{'p_cache':>9}{'tok/s':>9}")
for m in ("streaming", "ar", "block"):
    t = json.load(open(f"{runs}/decode_{m}.json"))["total"]
    print(f"{m:<10}{t['n_gen']:>8}{t['steps']:>10}{t['tokens_per_forward']:>9.2f}{t['p_cache']:>9.3f}"
          f"{t['tokens_per_s']:>9.1f}")
for r in json.load(open(f"{runs}/decode_streaming.json"))["results"]:
    print("---", repr(r["prompt"][:60]), "->", repr(r["text"][:120]))
EOF
  TRACE_PROMPT=$(head -n 1 "$RUNS/prompts.jsonl" | python -c "import json,sys; print(json.loads(sys.stdin.read())['prompt'])")
  stage trace_html wedlm-decode --checkpoint "$RUNS/adapt/hf" --prompt "$TRACE_PROMPT" --method streaming \
    --max-new-tokens 32 --trace "$RUNS/trace.html" > /dev/null
  if python -c "import matplotlib" 2>/dev/null; then
    stage trace_png wedlm-decode --checkpoint "$RUNS/adapt/hf" --prompt "$TRACE_PROMPT" --method streaming \
      --max-new-tokens 32 --trace "$RUNS/trace.png" > /dev/null
  fi
fi
echo "stage times: $STAGES" >&2
