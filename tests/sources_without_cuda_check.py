#!/usr/bin/env python3
"""The sources that keep CUDA-only code under `#ifdef DFLASHD_WITH_CUDA` compile without it.

The `cpu` preset (README: building by hand), and the default preset on a machine without nvcc,
build every .cc file without DFLASHD_WITH_CUDA and without the CUDA toolkit's headers; CI builds
the default preset only. This check takes each .cc file of the CUDA build's
compile_commands.json whose text names DFLASHD_WITH_CUDA, drops the define, the toolkit's include
directory and the precompiled header (built with the define), and compiles it with -fsyntax-only.

Usage: sources_without_cuda_check.py BUILD_DIR/compile_commands.json
"""
import json
import shlex
import subprocess
import sys


def without_cuda(arguments):
    """The compile command for a build without CUDA, checking syntax only."""
    out, skip = [], 0
    for i, a in enumerate(arguments):
        if skip:
            skip -= 1
            continue
        if a in ("-o", "-include") or (a == "-isystem" and i + 1 < len(arguments) and "cuda" in arguments[i + 1]):
            skip = 1
            continue
        if a in ("-c", "-Winvalid-pch", "-fpch-preprocess") or a.startswith("-DDFLASHD_WITH_CUDA"):
            continue
        out.append(a)
    return out + ["-fsyntax-only"]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        commands = json.load(f)
    checked, failed = 0, []
    for entry in commands:
        source = entry["file"]
        if not source.endswith(".cc"):
            continue
        with open(source, encoding="utf-8") as f:
            if "DFLASHD_WITH_CUDA" not in f.read():
                continue
        arguments = entry.get("arguments") or shlex.split(entry["command"])
        result = subprocess.run(without_cuda(arguments), cwd=entry["directory"], capture_output=True, text=True)
        checked += 1
        if result.returncode != 0:
            failed.append(source)
            print(f"{source}: does not compile without DFLASHD_WITH_CUDA:\n{result.stderr[-4000:]}")
    print(f"{checked} sources with CUDA-only parts checked without CUDA, {len(failed)} failed")
    if checked == 0:
        sys.exit("no source names DFLASHD_WITH_CUDA in " + sys.argv[1] + ": the check found nothing to check")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
