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
  mkdir -p "$(dirname "$out")"
  # Go's own output (a `go: downloading` line per module on a first build) goes to a log beside the
  # binary; the terminal gets one line, and the end of the log when the build fails.
  buildlog="$(dirname "$out")/build.log"
  echo -n "kube-score/build.sh: building kube-score $version (Go's output: $buildlog) ... " >&2
  start=$SECONDS
  if ! (cd "$here" && CGO_ENABLED=0 GOFLAGS=-buildvcs=false go build -trimpath \
        -ldflags "-s -w -X main.version=$version" -o "$out.tmp" github.com/zegl/kube-score/cmd/kube-score) \
        > "$buildlog" 2>&1; then
    echo "failed; $buildlog ends with:" >&2
    tail -n 30 "$buildlog" | sed 's/^/    /' >&2
    exit 1
  fi
  mv "$out.tmp" "$out"
  echo "$((SECONDS - start)) s" >&2
fi
echo "$out"
