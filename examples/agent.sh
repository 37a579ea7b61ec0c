#!/usr/bin/env bash
# Start one client agent (run on the device). Usage: examples/agent.sh COORD_HOST:PORT K
set -euo pipefail
coord=${1:-127.0.0.1:9092}; k=${2:-0}
here=$(dirname "$0")
fedshield agent start --coordinator "$coord" --root-cert "$here/certs/ca.crt" \
  --key "$here/keys/client-$k" --data "data/client-$k.npz"
