#!/bin/bash
# The e2e kind cluster's pod network (what kind's kindnetd does, in a page of shell): every few
# seconds, write this node's CNI config (ptp + host-local on the node's spec.podCIDR, masquerade
# off the pod range) and route every other node's podCIDR to that node's InternalIP.
# Runs as a hostNetwork DaemonSet (default-cni.yaml) with NET_ADMIN; NODE_NAME from the downward
# API, CONTROL_PLANE_ENDPOINT from kind (it patches the manifest, so no Service VIP is needed).
set -uo pipefail
CONF=/etc/cni/net.d/10-rljob-ptp.conflist
SA=/var/run/secrets/kubernetes.io/serviceaccount
API="https://${CONTROL_PLANE_ENDPOINT:-${KUBERNETES_SERVICE_HOST}:${KUBERNETES_SERVICE_PORT}}"

while true; do
  if nodes=$(curl -sf --max-time 10 --cacert "$SA/ca.crt" \
    -H "Authorization: Bearer $(cat "$SA/token")" "$API/api/v1/nodes"); then
    own=$(jq -r --arg n "$NODE_NAME" \
      '.items[] | select(.metadata.name == $n) | .spec.podCIDR // empty' <<<"$nodes")
    if [[ -n $own ]]; then
      conf=$(jq -n --arg subnet "$own" '{
        cniVersion: "0.4.0", name: "rljob-ptp",
        plugins: [
          {type: "ptp", ipMasq: true, mtu: 1500,
           ipam: {type: "host-local", ranges: [[{subnet: $subnet}]], routes: [{dst: "0.0.0.0/0"}]}},
          {type: "portmap", capabilities: {portMappings: true}}
        ]}')
      if [[ "$(cat "$CONF" 2>/dev/null)" != "$conf" ]]; then
        echo "$conf" >"$CONF.tmp" && mv "$CONF.tmp" "$CONF" && echo "node $NODE_NAME: pods on $own"
      fi
    fi
    jq -r --arg n "$NODE_NAME" '.items[] | select(.metadata.name != $n and .spec.podCIDR != null)
      | "\(.spec.podCIDR) \(.status.addresses[] | select(.type == "InternalIP") | .address)"' \
      <<<"$nodes" | while read -r cidr via; do
      if [[ "$(ip route show "$cidr")" != *"via $via "* ]]; then
        ip route replace "$cidr" via "$via" && echo "route $cidr via $via"
      fi
    done
  else
    echo "API $API not reachable yet"
  fi
  sleep 5
done
