#!/usr/bin/env bash
# A/B runs of two prebuilt CPU extensions (Python 3.12) on the GPU machine's 64-core host:
#   bash bench/host64_ab.sh OUTDIR A.so B.so PLAN
# Each line of PLAN is "label | VAR=value ... | arguments": it runs
#   VAR=value ... python3 -m linkwise.cli <arguments> --no-progress
# with the package built around A.so when the label starts with "a", else around B.so, and
# keeps the result rows (the commands get no stdin: mpirun would read the rest of PLAN). A line whose arguments start with "cmd:" runs the rest in a shell
# instead (the package of its label on PYTHONPATH). Everything goes to OUTDIR/ab.txt.
set -uo pipefail
out=$1; a=$2; b=$3; plan=$4
mkdir -p "$out"; log="$out/ab.txt"
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
t0=$(date +%s)
stamp() { echo "# [$(( $(date +%s) - t0 )) s] $*" | tee -a "$log"; }
{ lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Socket|NUMA|L2|L3'; } 2>&1 | tee -a "$log"
for v in a b; do
  mkdir -p "/tmp/pkg_$v"; cp -r src/linkwise "/tmp/pkg_$v/"
  rm -f /tmp/pkg_$v/linkwise/_native*.so
  cp "$([ $v = a ] && echo "$a" || echo "$b")" "/tmp/pkg_$v/linkwise/"
done
while IFS='|' read -r label vars args; do
  label=$(echo $label); [ -z "$label" ] && continue
  case "$label" in a*) pkg=/tmp/pkg_a ;; *) pkg=/tmp/pkg_b ;; esac
  stamp "$label: $vars | $args"
  if [[ "$(echo $args)" == cmd:* ]]; then
    env PYTHONPATH=$pkg $vars timeout 200 bash -c "${args#*cmd:}" < /dev/null 2>&1 | tail -40 | tee -a "$log"
  else
    env PYTHONPATH=$pkg $vars timeout 200 python3 -m linkwise.cli $args --no-progress < /dev/null 2>&1 \
      | grep -v '^\(\[rank 0\] \)\?# *\(linkwise\|busbw\|time\|  \|Out\|Avg\)' | tee -a "$log"
  fi
done < "$plan"
stamp done
