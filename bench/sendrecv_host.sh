#!/usr/bin/env bash
# sendrecv out of place and in place (comm.sendrecv_replace against MPI's Sendrecv_replace)
# on the GPU machine's host CPUs, rings of 2 and 4 ranks, and the 8-byte message rate
# (bench/message_rate.py: wait_all, a wait() loop, the native posts, Open MPI), alternated.
#   bash bench/sendrecv_host.sh OUTDIR   (from the repository root; builds the CPU part)
set -uo pipefail
out=${1:-/tmp/lw-sendrecv}
mkdir -p "$out"
log="$out/sendrecv_host.txt"
. bench/host_build.sh
host_build || exit 1
for n in 2 4; do
  echo "## sendrecv -N $n" | tee -a "$log"
  timeout 300 python3 -m linkwise.cli bench sendrecv -N "$n" -b 8 -e 16M -f 4 -n 200 -w 20 --compare mpi \
      --reps 3 --json "$out/sendrecv$n.json" --no-progress < /dev/null 2>&1 | tee -a "$log"
  python3 - "$out/sendrecv$n.json" <<'EOF' | tee -a "$log"
import json, sys
doc = json.load(open(sys.argv[1]))
rows = {s: {r["size"]: r for r in v["rows"]} for s, v in doc["systems"].items()}
print("# size  lw out us  lw in us  mpi out us  mpi in us  in place lw/mpi (mpi time / lw time)")
for size, r in rows["linkwise"].items():
    m = rows.get("mpi", {}).get(size)
    if not m:
        continue
    li, mi = r["ip"].get("time_us"), m["ip"].get("time_us")
    print(f"{size:>9} {r['oop'].get('time_us', 0):10.2f} {li or 0:9.2f} {m['oop'].get('time_us', 0):11.2f} "
          f"{mi or 0:10.2f}  {mi / li if li and mi else float('nan'):6.2f}")
EOF
done
echo "## message rate (us a message), alternated" | tee -a "$log"
for round in 1 2 3; do
  for mode in lw loop raw; do
    timeout 120 python3 -m linkwise.cli launch -n 2 bench/message_rate.py "$mode" < /dev/null 2>&1 | tail -1 | tee -a "$log"
  done
  timeout 120 mpirun -n 2 --allow-run-as-root python3 bench/message_rate.py mpi < /dev/null 2>&1 | tail -1 | tee -a "$log"
done
