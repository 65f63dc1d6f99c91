#!/usr/bin/env bash
# Make the GPU bundle (.gpubundle/, from the workplace's make_bundle.sh) carry PyAV too, within the device tool's
# 64 MiB: the Ray tarball without what Serve never imports (Ray Data, Tune, LLM, the dashboard's web client: an
# empty page stands in) recompressed at xz -9, the cryptography wheel dropped (Ray imports it only for TLS and
# cloud launchers) and virtualenv's (only Ray's pip/uv runtime environments import it; no config uses them), and
# PyAV (the FFmpeg encoders of every response_format but pcm/wav) unpacked, its own extension modules stripped, as
# av.tar.xz. install_bundle.sh unpacks it into /tmp/site after Ray.
#   bash bench/gpu_bundle_trim.sh [.gpubundle]
set -euo pipefail
B="${1:-.gpubundle}"; T="$(mktemp -d)"
[ -f "$B/.trimmed" ] && { echo "$B already trimmed"; exit 0; }
mkdir -p "$T/ray" "$T/stub/ray/dashboard/client/build/static" "$T/av"
tar -C "$T/ray" -xJf "$B/ray.tar.xz"
cp "$T"/ray/ray/dashboard/client/build/{index.html,favicon.ico} "$T/stub/ray/dashboard/client/build/"
tar -C "$T/ray" --exclude=ray/dashboard/client --exclude=ray/data --exclude=ray/tune --exclude=ray/llm -cf "$T/ray.tar" .
tar -C "$T/stub" -rf "$T/ray.tar" ./ray/dashboard/client
xz -T0 -9 -c "$T/ray.tar" > "$B/ray.tar.xz"
rm -f "$B"/wheels/cryptography-*.whl "$B"/wheels/virtualenv-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$T" "av>=14,<20"
(cd "$T/av" && python3 -m zipfile -e "$T"/av-*.whl . && find av -name '*.so' -exec strip --strip-unneeded {} \;)
tar -C "$T/av" -cf - . | xz -T0 -9 > "$B/av.tar.xz"
grep -q av.tar.xz "$B/install_bundle.sh" || sed -i 's|  tar -C /tmp/site -xJf "$_B/ray.tar.xz" \&\& touch /tmp/site/.ray_done|  tar -C /tmp/site -xJf "$_B/ray.tar.xz" \&\& touch /tmp/site/.ray_done\n  [ -f "$_B/av.tar.xz" ] \&\& tar -C /tmp/site -xJf "$_B/av.tar.xz"|' "$B/install_bundle.sh"
touch "$B/.trimmed"; rm -rf "$T"; du -sh "$B"
