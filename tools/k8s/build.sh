#!/usr/bin/env bash
# Build the development control plane (etcd, kube-apiserver, kube-controller-manager), kubectl and helm
# from the Go module proxy, cached per version under $ADPFLEET_CACHE (default ~/.cache/adpfleet).
# Prints the directory holding the binaries. Skips every binary already present.
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

build() {  # name wrapper-dir package ldflags: build into the pinned cache, link into $out
  local name=$1 dir=$2 pkg=$3 ldflags=$4
  if [ -x "$out/$name" ]; then return; fi
  if [ ! -x "$pinned/$name" ]; then
    log "building $name ($pkg); the first build takes several minutes"
    local start=$SECONDS
    (cd "$here/$dir" && go build -trimpath -ldflags "-s -w $ldflags" -o "$pinned/$name.tmp" "$pkg")
    mv "$pinned/$name.tmp" "$pinned/$name"
    log "built $name in $((SECONDS - start)) s"
    echo "$name $((SECONDS - start))" >> "$pinned/build-times.txt"
  fi
  if [ "$out" != "$pinned" ]; then ln -sf "$pinned/$name" "$out/$name"; fi
}

kminor=${KUBERNETES_VERSION#*.}; kminor=${kminor%%.*}
kver="-X k8s.io/component-base/version.gitVersion=v$KUBERNETES_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$kminor -X k8s.io/component-base/version.gitTreeState=clean -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z -X k8s.io/client-go/pkg/version.gitVersion=v$KUBERNETES_VERSION -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$kminor"
build etcd etcd go.etcd.io/etcd/server/v3 "-X go.etcd.io/etcd/api/v3/version.GitSHA=v$ETCD_VERSION"
build kube-apiserver kube k8s.io/kubernetes/cmd/kube-apiserver "$kver"
build kube-controller-manager kube k8s.io/kubernetes/cmd/kube-controller-manager "$kver"
# kubectl of the pinned version: tests and users must not depend on whatever kubectl a machine has.
build kubectl kube k8s.io/kubernetes/cmd/kubectl "$kver"
build helm helm helm.sh/helm/v3/cmd/helm "-X helm.sh/helm/v3/internal/version.version=v$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$kminor"
echo "$out"
