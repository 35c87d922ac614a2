#!/usr/bin/env bash
# Ray for the device machine, whose image lacks it: the ray wheel (cp312, ~80 MB) is larger than one call may carry
# (64 MiB with the working tree), so it is split in two parts under the ignored folder .device-ray/ and rejoined
# there. Part b also holds the small wheels ray needs that the image lacks (jsonschema and its dependencies).
#
# Usage (in the repository): bash tools/device-ray-parts.sh [RAY_VERSION]   (default 2.60.0, the `ray` extra's pin)
#
# Then two device calls in a row (the machine stays warm about 30 s between calls; /root stays while it is warm):
#   call 1: carry [".device-ray/a"]  command: mkdir -p /root/ray && cp .device-ray/a/* /root/ray/
#   call 2: carry [".device-ray/b"]  command: bash .device-ray/b/install.sh && export PYTHONPATH=/tmp/site:$PWD && <run>
# install.sh rejoins the wheel, checks its sha256 and installs everything into /tmp/site without the network.
set -euo pipefail
version=${1:-2.60.0}
top=$(git rev-parse --show-toplevel)
out=$top/.device-ray
rm -rf "$out"; mkdir -p "$out/a" "$out/b"
grep -qx '/.device-ray/' "$top/.git/info/exclude" 2>/dev/null || echo '/.device-ray/' >> "$top/.git/info/exclude"
tmp=$(mktemp -d)
pick=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$tmp")
python3 -m pip download -q "${pick[@]}" "ray==$version"
# ray's requirements missing from the device image (its package list has click, filelock, msgpack, packaging,
# protobuf, pyyaml, requests and attrs): jsonschema and what jsonschema needs
python3 -m pip download -q "${pick[@]}" jsonschema jsonschema-specifications referencing rpds-py
wheel=$(cd "$tmp" && ls ray-*.whl)
(cd "$tmp" && sha256sum "$wheel") > "$out/b/SHA256"
split -b 48m "$tmp/$wheel" "$tmp/part_"
mv "$tmp/part_aa" "$out/a/"
mv "$tmp"/part_a[b-z] "$out/b/"
mv "$tmp"/*.whl "$out/b/" 2>/dev/null || true
rm -f "$out/b/$wheel"
cat > "$out/b/install.sh" <<SH
set -euo pipefail
here=\$(cd "\$(dirname "\$0")" && pwd)
cp "\$here"/part_* /root/ray/
cat /root/ray/part_* > "/root/ray/$wheel"
(cd /root/ray && sha256sum -c "\$here/SHA256")
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
  "/root/ray/$wheel" "\$here"/*.whl
SH
rm -rf "$tmp"
du -sh "$out/a" "$out/b"
echo "parts ready under $out (ray $version for Python 3.12)"
