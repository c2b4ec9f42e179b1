#!/bin/sh
# Init container: lays out the model repository sluice serves from two sources,
#   STORE    the model store volume: <name>/<version>/model.onnx (or model.plan), maybe config.yaml
#   CONFIGS  the sluice-model-configs ConfigMap: <name>.yaml, the config of model <name>
# into REPO (an emptyDir): REPO/<name>/<version> are symlinks into STORE, so large models are
# neither copied nor duplicated per pod, and REPO/<name>/config.yaml comes from CONFIGS when it
# has one (else from STORE). The main container mounts STORE at the same path.
#
#   assemble-repository.sh [STORE=/model-store] [CONFIGS=/etc/sluice/models] [REPO=/models]
set -eu

store="${1:-/model-store}"
configs="${2:-/etc/sluice/models}"
repo="${3:-/models}"
count=0

for model in "$store"/*/; do
    [ -d "$model" ] || continue
    name="$(basename "$model")"
    mkdir -p "$repo/$name"
    for entry in "$model"*; do
        [ -e "$entry" ] || continue
        ln -sfn "$entry" "$repo/$name/$(basename "$entry")"
    done
    count=$((count + 1))
done

for config in "$configs"/*.yaml; do
    [ -f "$config" ] || continue
    name="$(basename "$config" .yaml)"
    if [ ! -d "$repo/$name" ]; then
        # A config for a model that is not in the store is a typo or a missing upload: say so
        # instead of serving without it.
        echo "assemble-repository: $config configures model '$name'," \
            "but $store has no folder '$name'" >&2
        exit 1
    fi
    rm -f "$repo/$name/config.yaml"
    cp "$config" "$repo/$name/config.yaml"
done

echo "assemble-repository: $count model(s) from $store in $repo"
