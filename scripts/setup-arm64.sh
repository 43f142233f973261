#!/usr/bin/env bash
# An aarch64 Python with onnxruntime's aarch64 wheel, run by QEMU's user-mode emulator, for the portability tests
# (tests/verify/test_portability.py runs gpt2onnx.verify.cpu_worker in it as an emulated Neoverse-N1: NEON with the dot-product
# instructions, the path of Graviton 2 and most ARM servers). Everything goes to .arm64/ (ignored by git):
#   root/   Debian bookworm's arm64 python3.11 and the libraries it loads, unpacked (apt-get download + dpkg -x)
#   site/   the aarch64 wheels of what the worker imports (onnxruntime, onnx, numpy and theirs), the versions .venv has
#   cpuinfo an ARM /proc/cpuinfo: QEMU 7.2 passes the host's x86 one through, on which onnxruntime's CPU detection
#           crashes; the test bind-mounts this one over it in a private mount namespace (unshare, as root)
# Needs root (dpkg --add-architecture, apt) and qemu-user; safe to rerun (about 1 s when everything is there).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.arm64
PY=.venv/bin/python
[ -x "$DIR/root/usr/bin/python3.11" ] && [ -f "$DIR/site/.complete" ] && { echo "aarch64 python: $DIR (present)"; exit 0; }
rm -rf "$DIR.tmp" && mkdir -p "$DIR.tmp/debs"
dpkg --print-foreign-architectures | grep -qx arm64 || dpkg --add-architecture arm64
apt-get update -qq
PACKAGES=(python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libc6 libexpat1 zlib1g libffi8 libssl3
  libbz2-1.0 liblzma5 libstdc++6 libgcc-s1 libuuid1 libncursesw6 libtinfo6 libreadline8 libsqlite3-0 libgomp1
  libcrypt1 libnsl2 libtirpc3 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1 libdb5.3)
(cd "$DIR.tmp/debs" && apt-get download -qq "${PACKAGES[@]/%/:arm64}")
mkdir -p "$DIR.tmp/root"
for deb in "$DIR.tmp/debs"/*.deb; do dpkg -x "$deb" "$DIR.tmp/root"; done
rm -rf "$DIR.tmp/debs"
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps --only-binary=:all: --target "$DIR.tmp/site" \
  --python-version 3.11 --implementation cp --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64 \
  --platform manylinux2014_aarch64 "onnxruntime==$(version onnxruntime-gpu)" "onnx==$(version onnx)" \
  "numpy==$(version numpy)" "ml_dtypes==$(version ml_dtypes)" "protobuf==$(version protobuf)" \
  "typing_extensions==$(version typing_extensions)" 2>&1 | grep -v "^WARNING: Location" || true
cat > "$DIR.tmp/cpuinfo" <<'EOF'
processor	: 0
BogoMIPS	: 50.00
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs
CPU implementer	: 0x41
CPU architecture: 8
CPU variant	: 0x3
CPU part	: 0xd0c
CPU revision	: 1

EOF
touch "$DIR.tmp/site/.complete"
rm -rf "$DIR" && mv "$DIR.tmp" "$DIR"
echo "aarch64 python: $DIR ($(du -sh "$DIR" | cut -f1))"
