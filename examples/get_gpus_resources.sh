#!/usr/bin/env bash
# Spark's GPU discovery script (spark.worker.resource.gpu.discoveryScript or
# spark.executor.resource.gpu.discoveryScript): the GPUs nvidia-smi lists on this host, as
# the resource Spark hands to tasks: {"name": "gpu", "addresses": ["0", "1"]}.
# SPARK_GPU_RESOURCE_NAME names another resource (ClusterConfig(gpu_resource=...)).
set -euo pipefail
name="${SPARK_GPU_RESOURCE_NAME:-gpu}"
indexes="$(nvidia-smi --query-gpu=index --format=csv,noheader)" || {
  echo "get_gpus_resources.sh: nvidia-smi failed on $(hostname): no GPU driver here?" >&2
  exit 1
}
addresses=""
for index in $indexes; do
  addresses="${addresses:+$addresses, }\"$index\""
done
echo "{\"name\": \"$name\", \"addresses\": [$addresses]}"
