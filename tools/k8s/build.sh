#!/usr/bin/env bash
# Build the development control plane (etcd, kube-apiserver, kube-controller-manager), kubectl and helm
# from the Go module proxy, cached per version under $ADPFLEET_CACHE (default ~/.cache/adpfleet).
# Prints the directory holding the binaries. Skips every binary already present; a build prints one
# line per binary ([n/total] name ... seconds) and keeps Go's output in build.log beside the builds.
#
# KUBEBUILDER_ASSETS (a directory with etcd and kube-apiserver, as envtest expects) or
# TEST_ASSET_KUBE_APISERVER / TEST_ASSET_ETCD point at existing binaries; then those are not built.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
cache=${ADPFLEET_CACHE:-$HOME/.cache/adpfleet}
pinned="$cache/k8s/$KUBERNETES_VERSION-etcd$ETCD_VERSION-helm$HELM_VERSION"
mkdir -p "$pinned"
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false
log() { echo "build.sh: $*" >&2; }

# With overrides, the binaries live in a directory of their own, named after the overrides, so the
# pinned cache never holds (links to) binaries of other versions.
overrides="${KUBEBUILDER_ASSETS:-}|${TEST_ASSET_KUBE_APISERVER:-}|${TEST_ASSET_ETCD:-}"
if [ "$overrides" = "||" ]; then
  out=$pinned
else
  out="$cache/k8s/override-$(printf '%s' "$overrides" | sha256sum | cut -c1-12)"
  mkdir -p "$out"
fi

link_existing() {  # name path: use a binary the user already has
  local name=$1 path=$2
  [ -x "$path" ] || { log "$name: $path is not an executable file"; exit 1; }
  ln -sf "$(readlink -f "$path")" "$out/$name"
}
if [ -n "${KUBEBUILDER_ASSETS:-}" ]; then
  link_existing kube-apiserver "$KUBEBUILDER_ASSETS/kube-apiserver"
  link_existing etcd "$KUBEBUILDER_ASSETS/etcd"
  if [ -x "$KUBEBUILDER_ASSETS/kube-controller-manager" ]; then
    link_existing kube-controller-manager "$KUBEBUILDER_ASSETS/kube-controller-manager"
  fi
fi
if [ -n "${TEST_ASSET_KUBE_APISERVER:-}" ]; then link_existing kube-apiserver "$TEST_ASSET_KUBE_APISERVER"; fi
if [ -n "${TEST_ASSET_ETCD:-}" ]; then link_existing etcd "$TEST_ASSET_ETCD"; fi

# Go's own output (hundreds of `go: downloading` lines on a first build) goes to this log; the
# terminal gets one line per binary, and the end of the log when a build fails.
buildlog="$pinned/build.log"
names=() dirs=() pkgs=() flags=()
want() {  # name wrapper-dir package ldflags: queue a build into the pinned cache unless it is there
  local name=$1
  if [ -x "$out/$name" ]; then return; fi
  if [ -x "$pinned/$name" ]; then ln -sf "$pinned/$name" "$out/$name"; return; fi
  names+=("$name") dirs+=("$2") pkgs+=("$3") flags+=("$4")
}

build() {  # n total name wrapper-dir package ldflags
  local n=$1 total=$2 name=$3 dir=$4 pkg=$5 ldflags=$6 start=$SECONDS
  printf 'build.sh: [%d/%d] %s ... ' "$n" "$total" "$name" >&2
  echo "--- $(date +%Y-%m-%dT%H:%M:%S) [$n/$total] $name: go build $pkg" >> "$buildlog"
  if ! (cd "$here/$dir" && go build -trimpath -ldflags "-s -w $ldflags" -o "$pinned/$name.tmp" "$pkg") \
      >> "$buildlog" 2>&1; then
    echo "failed after $((SECONDS - start)) s" >&2
    log "building $name ($pkg) failed; Go's output is in $buildlog, which ends with:"
    tail -n 30 "$buildlog" | sed 's/^/    /' >&2
    exit 1
  fi
  mv "$pinned/$name.tmp" "$pinned/$name"
  echo "$((SECONDS - start)) s" >&2
  echo "$name $((SECONDS - start))" >> "$pinned/build-times.txt"
  if [ "$out" != "$pinned" ]; then ln -sf "$pinned/$name" "$out/$name"; fi
}

kminor=${KUBERNETES_VERSION#*.}; kminor=${kminor%%.*}
kver="-X k8s.io/component-base/version.gitVersion=v$KUBERNETES_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$kminor -X k8s.io/component-base/version.gitTreeState=clean -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z -X k8s.io/client-go/pkg/version.gitVersion=v$KUBERNETES_VERSION -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$kminor"
want etcd etcd go.etcd.io/etcd/server/v3 "-X go.etcd.io/etcd/api/v3/version.GitSHA=v$ETCD_VERSION"
want kube-apiserver kube k8s.io/kubernetes/cmd/kube-apiserver "$kver"
want kube-controller-manager kube k8s.io/kubernetes/cmd/kube-controller-manager "$kver"
# kubectl of the pinned version: tests and users must not depend on whatever kubectl a machine has.
want kubectl kube k8s.io/kubernetes/cmd/kubectl "$kver"
want helm helm helm.sh/helm/v3/cmd/helm "-X helm.sh/helm/v3/internal/version.version=v$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$kminor"

if [ ${#names[@]} -gt 0 ]; then
  if ! command -v go > /dev/null; then
    log "go is not on PATH; it is needed to build ${names[*]} (tools/k8s/kube/go.mod names the version)"
    exit 1
  fi
  log "building ${names[*]} into $pinned; the first build takes several minutes (Go's output: $buildlog)"
  for i in "${!names[@]}"; do
    build $((i + 1)) ${#names[@]} "${names[$i]}" "${dirs[$i]}" "${pkgs[$i]}" "${flags[$i]}"
  done
fi
echo "$out"
