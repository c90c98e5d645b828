#!/usr/bin/env bash
# The same `consequence train` on a two-node Ray cluster simulated on one machine (docs/async.md §6).
#
#   bash examples/ray_cluster/two_nodes.sh [RUN_DIR]
#
# Starts a head node and a second node on loopback (1 CPU each), runs a short training job
# whose two rollout workers land on different nodes (see manifest.json → rollout_workers →
# where → node), then stops the cluster. Note: `ray stop` stops every Ray process of this
# user on the machine, so run nothing else on Ray meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN_DIR=${1:-runs/ray-two-nodes}
PORT=${RAY_PORT:-6390}
export PATH="$PWD/.venv/bin:$PATH"
export RAY_AUTH_MODE=token  # Ray 2.60's default for `ray start`: every process reads ~/.ray/auth_token
[ -f ~/.ray/auth_token ] || ray get-auth-token --generate >/dev/null
trap 'ray stop >/dev/null 2>&1 || true' EXIT

ray start --head --port "$PORT" --num-cpus 1 --include-dashboard false --disable-usage-stats >/dev/null
ray start --address "127.0.0.1:$PORT" --num-cpus 1 --disable-usage-stats >/dev/null
python - "$PORT" <<'PY'
import sys, ray
ray.init(address=f"127.0.0.1:{sys.argv[1]}", log_to_driver=False)
print("cluster nodes:", [(n["NodeID"][:8], n["Resources"].get("CPU")) for n in ray.nodes() if n["Alive"]])
PY
consequence train --rollout-workers 2 --max-staleness 1 --ray-address "127.0.0.1:$PORT" \
  --iterations 2 --tasks-per-iteration 4 --group-size 4 --eval-every 0 --final-eval-episodes 0 --run-dir "$RUN_DIR"
python - "$RUN_DIR" <<'PY'
import json, sys
entry = json.load(open(f"{sys.argv[1]}/manifest.json"))["rollout_workers"][-1]
for i, w in enumerate(entry["where"]):
    print(f"rollout worker {i}: pid {w['pid']} on Ray node {w['node'][:8]}")
print("workers on distinct nodes:", len({w["node"] for w in entry["where"]}) == len(entry["where"]))
PY
