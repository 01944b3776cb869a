#!/usr/bin/env bash
# Build kube-score, the outside linter tests/chart/test_kube_score.py judges the chart with, from the Go
# module proxy at the version go.mod beside this script pins, cached per version under $ADPFLEET_CACHE
# (default ~/.cache/adpfleet). Prints the binary's path. Skips the build when the binary is there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=$(awk '$1 == "github.com/zegl/kube-score" {print $2}' "$here/go.mod")
[ -n "$version" ] || { echo "kube-score/build.sh: no github.com/zegl/kube-score in $here/go.mod" >&2; exit 1; }
cache=${ADPFLEET_CACHE:-$HOME/.cache/adpfleet}
out="$cache/kube-score/$version/kube-score"
if [ ! -x "$out" ]; then
  echo "kube-score/build.sh: building kube-score $version; the first build takes a few minutes" >&2
  mkdir -p "$(dirname "$out")"
  (cd "$here" && CGO_ENABLED=0 GOFLAGS=-buildvcs=false go build -trimpath -ldflags "-s -w -X main.version=$version" \
    -o "$out.tmp" github.com/zegl/kube-score/cmd/kube-score)
  mv "$out.tmp" "$out"
fi
echo "$out"
