#!/usr/bin/env bash
# preStop hook of the RayService's GPU pods: drain the node, then stop Ray. `ray stop` alone kills the replicas at
# once and cuts every stream they carry; draining first lets Serve start replacements elsewhere and stop this node's
# replicas gracefully (each within its graceful_shutdown_timeout_s: open streams finish), while Ray schedules nothing
# new here. The hook returns when no Serve replica is left on the node, or when the budget is spent.
#   prestop_drain.sh [BUDGET_S]   BUDGET_S: terminationGracePeriodSeconds less a margin for `ray stop` (230)
set -uo pipefail
budget="${1:-230}"
poll_s="${QWEN3_TTS_DRAIN_POLL_S:-2}"
start=$SECONDS
echo "preStop: draining this Ray node for up to ${budget}s"
ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --reason-message "pod terminating (KubeRay preStop)" \
  --deadline-remaining-seconds "$budget" || echo "preStop: the drain request failed; waiting for the replicas anyway"
while (( SECONDS - start < budget )) && pgrep -f "^ray::ServeReplica" >/dev/null; do
  sleep "$poll_s"
done
echo "preStop: $(pgrep -fc '^ray::ServeReplica' || true) Serve replicas left after $((SECONDS - start))s; stopping Ray"
ray stop
