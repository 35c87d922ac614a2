#!/usr/bin/env bash
# Any file or folder too large for one device call (64 MiB with the working tree, which is ~10 MiB), split into
# parts under the ignored folder .device-parts/NAME/pNN/ that each travel in one call, and joined on the device.
#
# Usage (in the repository): bash tools/device-parts.sh NAME PATH [MIB]   (PATH: a file, or a folder sent as .tar;
#                                                                           MIB: part size, default 50)
# Then device calls back to back (the machine keeps /root about 30 s after a call):
#   every part but the last:  carry [".device-parts/NAME/pNN"]  command: bash .device-parts/NAME/pNN/put.sh
#   the last part:            carry [".device-parts/NAME/pNN", ...]  command: bash .device-parts/NAME/pNN/put.sh && <run>
# put.sh appends its part under /root/parts/NAME/; the last one joins them into /root/parts/NAME.file (or unpacks
# the folder under /root/parts/NAME/) and checks the SHA-256.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,11p' "$0"; exit 2; }
name=$1; src=$2; mib=${3:-50}
top=$(git rev-parse --show-toplevel)
grep -qx '/.device-parts/' "$top/.gitignore" || echo '/.device-parts/' >> "$top/.gitignore"
out=$top/.device-parts/$name; rm -rf "$out"; mkdir -p "$out"
tmp=$(mktemp -d)
if [ -d "$src" ]; then tar -C "$(dirname "$src")" -cf "$tmp/whole" "$(basename "$src")"; kind=tar
else cp "$src" "$tmp/whole"; kind=file; fi
sha=$(sha256sum "$tmp/whole" | cut -d' ' -f1)
split -b "${mib}m" -d -a 2 "$tmp/whole" "$tmp/part_"
parts=$(ls "$tmp" | grep -c '^part_'); i=0
for f in "$tmp"/part_*; do
  n=${f##*_}; i=$((i + 1)); mkdir -p "$out/p$n"; mv "$f" "$out/p$n/"
  { echo 'set -euo pipefail; here=$(cd "$(dirname "$0")" && pwd)'
    echo "mkdir -p /root/parts/$name.in && cp \"\$here\"/part_* /root/parts/$name.in/"
    if [ "$i" = "$parts" ]; then
      echo "cat /root/parts/$name.in/part_* > /root/parts/$name.whole"
      echo "echo '$sha  /root/parts/$name.whole' | sha256sum -c --quiet"
      if [ $kind = tar ]; then echo "mkdir -p /root/parts/$name && tar -C /root/parts/$name -xf /root/parts/$name.whole && rm /root/parts/$name.whole"
      else echo "mv /root/parts/$name.whole /root/parts/$name.file"; fi
      echo "rm -rf /root/parts/$name.in"
    fi; } > "$out/p$n/put.sh"
done
rm -rf "$tmp"
echo "$name: $parts parts under .device-parts/$name ($(ls "$out" | tr '\n' ' '))"
