#!/usr/bin/env python3
"""The sources that keep CUDA-only code under `#ifdef DFLASHD_WITH_CUDA` compile without it.

The `cpu` preset (README: building by hand), and the default preset on a machine without nvcc,
build every .cc file without DFLASHD_WITH_CUDA and without the CUDA toolkit's headers; CI builds
the default preset only. This check takes each .cc file of the CUDA build's
compile_commands.json whose text names DFLASHD_WITH_CUDA, drops the define, the toolkit's include
directory and the build's precompiled header (made with the define), and compiles it with
-fsyntax-only against a precompiled ATen header of its own (made once, without the define).
Warnings are errors here (-Werror): the CUDA build has none, and a parameter or variable that
only the CUDA branch uses would otherwise warn unseen in every `cpu` build.

Usage: sources_without_cuda_check.py BUILD_DIR/compile_commands.json
"""
import json
import os
import shlex
import subprocess
import sys
import tempfile


def without_cuda(arguments, source):
    """The compile flags of a build without CUDA: the command without its compiler output, the
    source, the define, the toolkit's headers and the build's precompiled header."""
    out, skip = [], 0
    for i, a in enumerate(arguments):
        if skip:
            skip -= 1
            continue
        if a in ("-o", "-include") or (a == "-isystem" and i + 1 < len(arguments) and "cuda" in arguments[i + 1]):
            skip = 1
            continue
        if a in ("-c", source, "-Winvalid-pch", "-fpch-preprocess") or a.startswith("-DDFLASHD_WITH_CUDA"):
            continue
        out.append(a)
    return out


def precompiled_aten(flags, directory, scratch):
    """-include arguments for ATen/ATen.h precompiled with these flags, or none where the
    compiler refuses (each source then parses the header itself)."""
    header = os.path.join(scratch, "aten.hxx")
    with open(header, "w") as f:
        f.write("#include <ATen/ATen.h>\n")
    made = subprocess.run(flags + ["-x", "c++-header", header, "-o", header + ".gch"], cwd=directory,
                          capture_output=True, text=True)
    return ["-include", header] if made.returncode == 0 else []


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        commands = json.load(f)
    sources = []
    for entry in commands:
        if entry["file"].endswith(".cc"):
            with open(entry["file"], encoding="utf-8") as f:
                if "DFLASHD_WITH_CUDA" in f.read():
                    sources.append(entry)
    checked, failed, aten = 0, [], None
    scratch = tempfile.TemporaryDirectory(prefix="dflashd-no-cuda-")
    for entry in sources:
        source = entry["file"]
        flags = without_cuda(entry.get("arguments") or shlex.split(entry["command"]), source)
        if aten is None:
            aten = precompiled_aten(flags, entry["directory"], scratch.name)
        command = flags + aten + ["-fsyntax-only", "-Werror", source]
        result = subprocess.run(command, cwd=entry["directory"], capture_output=True, text=True)
        checked += 1
        if result.returncode != 0:
            failed.append(source)
            print(f"{source}: does not compile cleanly without DFLASHD_WITH_CUDA:\n{result.stderr[-4000:]}")
    print(f"{checked} sources with CUDA-only parts checked without CUDA, {len(failed)} failed")
    if checked == 0:
        sys.exit("no source names DFLASHD_WITH_CUDA in " + sys.argv[1] + ": the check found nothing to check")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
