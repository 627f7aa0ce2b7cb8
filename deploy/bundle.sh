#!/usr/bin/env bash
# bundle.sh: packs dflashd for a host without network into one relocatable directory and tarball.
#
#   dist/dflashd-VERSION/
#     bin/dflashd          launcher: finds libtorch, sets the library path, execs the binary
#                          (exec keeps the PID, so systemd's Type=notify and signals see dflashd)
#     libexec/dflashd      the binary
#     lib/                 every shared library it needs that is neither glibc/libstdc++ nor
#                          torch/CUDA: prometheus-cpp, cpp-httplib, spdlog, fmt, yaml-cpp, ...
#     lib/torch/           only with --with-torch: the torch wheel's libraries and the nvidia-*
#                          libraries they load (several GB; without it the host needs the
#                          torch 2.11.0 wheel, found through python3 or DFLASHD_TORCH_LIB)
#     tests/               only with --with-tests: the test binaries, run the same way
#     share/               default config, systemd unit and examples (when present)
#
# Usage: deploy/bundle.sh BUILD_DIR [--with-torch] [--with-tests] [--out DIR]
# Install on the host: tar xf dflashd-VERSION.tar.gz -C /opt && /opt/dflashd-VERSION/bin/dflashd doctor
set -euo pipefail
build="${1:?usage: bundle.sh BUILD_DIR [--with-torch] [--with-tests] [--out DIR]}"
shift
with_torch=0 with_tests=0 out=dist
while (($#)); do
  case "$1" in
    --with-torch) with_torch=1 ;;
    --with-tests) with_tests=1 ;;
    --out) out="$2"; shift ;;
    *) echo "bundle.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
here="$(cd "$(dirname "$0")" && pwd)"
binary="$build/daemon/dflashd"
[ -x "$binary" ] || { echo "bundle.sh: $binary not built (make build)" >&2; exit 1; }
version="$("$binary" version | awk '{print $2}')"
root="$out/dflashd-$version"
rm -rf "$root"
mkdir -p "$root/bin" "$root/libexec" "$root/lib" "$root/share"

# Libraries every Linux host has (glibc, the C++ runtime) and the torch/CUDA stack (from the
# wheel, handled separately) are not copied.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libutil\.so|libstdc\+\+|libgcc_s|libtorch|libc10|libcaffe2|libgomp|libshm|libnv|libcu|libcupti|libnccl)'
copy_libs() {
  ldd "$1" | awk '/=> \//{print $1" "$3}' | while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    cp -Ln "$path" "$root/lib/$name" 2>/dev/null || true
  done
}
cp "$binary" "$root/libexec/dflashd"
copy_libs "$binary"
# Our own CUDA runtime dependency (the probe/kernels link libcudart): ship it, it is small.
cudart="$(ldd "$binary" | awk '/libcudart\.so/{print $3}')"
[ -n "$cudart" ] && cp -Ln "$cudart" "$root/lib/"

if ((with_torch)); then
  torch_dir="$("$here/bootstrap.sh" --print-torch-dir)"
  site="$(dirname "$torch_dir")"
  mkdir -p "$root/lib/torch/torch/lib" "$root/lib/torch/nvidia"
  cp -L "$torch_dir"/lib/*.so* "$root/lib/torch/torch/lib/"
  # The wheel's libraries find the nvidia-* libraries by $ORIGIN/../../nvidia/...: keep that shape.
  for d in "$site"/nvidia/*/; do
    [ -d "$d/lib" ] || continue
    mkdir -p "$root/lib/torch/nvidia/$(basename "$d")"
    cp -rL "$d/lib" "$root/lib/torch/nvidia/$(basename "$d")/"
  done
fi

if ((with_tests)); then
  mkdir -p "$root/tests"
  for t in "$build"/tests/*_test; do
    [ -x "$t" ] || continue
    cp "$t" "$root/tests/"
    copy_libs "$t"
  done
  for b in "$build"/bench/*_bench; do
    [ -x "$b" ] && cp "$b" "$root/libexec/"
  done
fi

cp "$here/../config/default.yaml" "$root/share/default.yaml"
[ -d "$here/systemd" ] && cp -r "$here/systemd" "$root/share/"
[ -d "$here/examples" ] && cp -r "$here/examples" "$root/share/"
[ -d "$here/prometheus" ] && cp -r "$here/prometheus" "$root/share/"
[ -d "$here/grafana" ] && cp -r "$here/grafana" "$root/share/"
cp "$here/../README.md" "$root/share/README.md"

cat > "$root/bin/dflashd" <<'LAUNCHER'
#!/usr/bin/env bash
# dflashd launcher (from deploy/bundle.sh): library path, then exec the binary.
set -euo pipefail
root="$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)"
torch_lib="${DFLASHD_TORCH_LIB:-}"
if [ -z "$torch_lib" ] && [ -d "$root/lib/torch/torch/lib" ]; then torch_lib="$root/lib/torch/torch/lib"; fi
if [ -z "$torch_lib" ]; then
  torch_lib="$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null || true)"
fi
if [ -z "$torch_lib" ] || [ ! -f "$torch_lib/libtorch.so" ]; then
  echo "dflashd: libtorch not found: install the torch 2.11.0 wheel, set DFLASHD_TORCH_LIB=.../torch/lib, or use a bundle made with --with-torch" >&2
  exit 4
fi
nvidia="$(cd "$torch_lib/../.." && pwd)/nvidia"
export LD_LIBRARY_PATH="$root/lib:$torch_lib:$nvidia/cu13/lib:$nvidia/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$root/libexec/${DFLASHD_EXEC:-dflashd}" "$@"
LAUNCHER
chmod +x "$root/bin/dflashd"
# Debug info stays in the build tree; the bundle carries stripped binaries.
find "$root/libexec" "$root/tests" -type f -perm -u+x -exec strip --strip-debug {} + 2>/dev/null || true
tar -C "$out" -czf "$out/dflashd-$version.tar.gz" "dflashd-$version"
echo "$root ($(du -sh "$root" | cut -f1)); $out/dflashd-$version.tar.gz"
