#!/usr/bin/env bash
# End-to-end smoke test on a local kind cluster (needs docker, kind, helm, kubectl, curl):
# builds the CPU image, loads it into kind, installs the chart with ci/kind.yaml, waits for
# every pod to be ready, sends one chat through the router Service, prints the answer and the
# KV transfer verdict, and uninstalls. Run from anywhere: bash deploy/kind-smoke.sh
#   KIND_CLUSTER  kind cluster to use (default pdserve; created if missing, kept afterwards)
#   NAMESPACE     namespace to install into (default pdserve-smoke)
set -euo pipefail
cd "$(dirname "$0")/.."
CLUSTER=${KIND_CLUSTER:-pdserve}
NAMESPACE=${NAMESPACE:-pdserve-smoke}
RELEASE=pdserve
IMAGE=pdserve
TAG=0.1.0-cpu
LOCAL_PORT=18000
ADMIN_SECRET=pdserve-smoke-admin

kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER"
docker build -f deploy/Dockerfile --build-arg VARIANT=cpu -t "$IMAGE:$TAG" .
kind load docker-image "$IMAGE:$TAG" --name "$CLUSTER"

cleanup() {
  [ -n "${FORWARD_PID:-}" ] && kill "$FORWARD_PID" 2>/dev/null || true
  helm uninstall "$RELEASE" -n "$NAMESPACE" --wait || true
}
trap cleanup EXIT

# an admin key, to read the transfer verdict: the router shows no internals to a keyless caller
ADMIN_KEY=$(python3 -c 'import secrets; print(secrets.token_urlsafe(24))')
kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f -
kubectl -n "$NAMESPACE" create secret generic "$ADMIN_SECRET" --from-literal=admin-api-key="$ADMIN_KEY" \
  --dry-run=client -o yaml | kubectl apply -f -
helm install "$RELEASE" deploy/helm/pdserve -n "$NAMESPACE" --create-namespace \
  -f deploy/helm/pdserve/ci/kind.yaml \
  --set image.repository="$IMAGE" --set image.tag="$TAG" --set image.pullPolicy=Never \
  --set router.adminKeySecret.name="$ADMIN_SECRET" \
  --wait --timeout 15m
kubectl -n "$NAMESPACE" wait --for=condition=Ready pod \
  -l app.kubernetes.io/instance="$RELEASE" --timeout=10m

kubectl -n "$NAMESPACE" port-forward "svc/$RELEASE-router" "$LOCAL_PORT:8000" >/dev/null &
FORWARD_PID=$!
for _ in $(seq 60); do
  curl -fsS "http://127.0.0.1:$LOCAL_PORT/v1/models" >/dev/null 2>&1 && break
  sleep 1
done

MODEL=$(curl -fsS "http://127.0.0.1:$LOCAL_PORT/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
REPLY=$(curl -fsS "http://127.0.0.1:$LOCAL_PORT/v1/chat/completions" \
  -H 'Content-Type: application/json' -H "Authorization: Bearer $ADMIN_KEY" \
  -d "{\"model\": \"$MODEL\", \"max_tokens\": 24, \"temperature\": 0,
       \"messages\": [{\"role\": \"user\", \"content\": \"Name three colours.\"}]}")
echo "answer: $(printf '%s' "$REPLY" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])')"
echo "transfer: $(printf '%s' "$REPLY" | python3 -c 'import json,sys; r=json.load(sys.stdin); print(json.dumps(r["pdserve"]["transfer"]))')"
