#!/usr/bin/env bash
# Runs every probe in a folder. Run from the linkwise repository root (built with CUDA):
#   bash bench/gpu_open_issues/run_all.sh bench/gpu_open_issues
# Each probe: `# RANKS: n` in its first lines; n > 1 runs under `python -m linkwise.cli launch -n n`.
# A probe passes only if it printed PASS lines and no FAIL line (a rank that crashed prints none).
set -u
shopt -s nullglob  # no probe left: an empty summary
D=${1:?usage: run_all.sh PROBE_DIR   (run from the repository root)}
D=$(cd "$D" && pwd)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
PY=${PYTHON:-python}
summary=()
for p in "$D"/probe_*.py; do
  name=$(basename "$p" .py)
  ranks=$(sed -n 's/^# RANKS: *\([0-9][0-9]*\).*/\1/p' "$p" | head -1)
  ranks=${ranks:-1}
  if [ "$ranks" -gt 1 ]; then
    cmd=("$PY" -m linkwise.cli launch -n "$ranks" "$p")
  else
    cmd=("$PY" "$p")
  fi
  start=$(date +%s)
  out=$(timeout 60 "${cmd[@]}" 2>&1); rc=$?
  secs=$(( $(date +%s) - start ))
  echo "=== $name (ranks=$ranks, rc=$rc, ${secs}s)"
  lines=$(printf '%s\n' "$out" | grep -E '(^|\] )(PASS|FAIL|INFO) ' || true)
  if [ -n "$lines" ]; then printf '%s\n' "$lines"; fi
  npass=$(printf '%s\n' "$lines" | grep -cE '(^|\] )PASS ' || true)
  nfail=$(printf '%s\n' "$lines" | grep -cE '(^|\] )FAIL ' || true)
  if [ "$rc" -eq 124 ]; then
    verdict="FAIL (timed out after 60 s)"
  elif [ "$nfail" -gt 0 ]; then
    verdict="FAIL"
  elif [ "$npass" -eq 0 ]; then
    verdict="FAIL (no verdict printed: a rank crashed? rc=$rc)"
  else
    verdict="PASS"
  fi
  if [ "$nfail" -gt 0 ] || [ "$npass" -eq 0 ] || [ "$rc" -ne 0 ]; then
    echo "--- last lines of output:"
    printf '%s\n' "$out" | grep -vE '(^|\] )(PASS|FAIL|INFO) ' | tail -n 8
  fi
  echo "RESULT $name: $verdict"
  summary+=("$name: $verdict")
done
echo
echo "===== summary"
printf '%s\n' "${summary[@]}"
