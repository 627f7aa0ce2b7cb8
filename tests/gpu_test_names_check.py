#!/usr/bin/env python3
"""The GPU tests' names: the one selection that `make test-gpu` and `run_h200.sh tests` run, and
the check that every test that skips without a GPU is inside it.

CI has no GPU, so a GPU test runs only when someone runs it on a GPU host; `make test-gpu` and
`bench/run_h200.sh tests` select them by name: `*Gpu*`, and the GatedDeltaNetKernels and
NcclGradients suites, as this file prints it (--ctest-regex, --gtest-filter). The check reads the
test sources: a test whose body skips on a GPU condition (a GTEST_SKIP on a line that names CUDA,
a GPU, Hopper or a device count, or right after such an `if`) must match that selection. It
prints each test that does not and exits 1.

Usage: gpu_test_names_check.py TESTS_DIR | --ctest-regex | --gtest-filter
"""
import pathlib
import re
import sys

NAME_PART = "Gpu"  # a test whose suite or name holds it is a GPU test
SUITES = ("GatedDeltaNetKernels", "NcclGradients")  # GPU tests whatever their names
HEADER = re.compile(r"^TEST(?:_F|_P)?\((\w+),\s*(\w+)\)", re.M)
GPU_WORDS = re.compile(r"hasCUDA|device_count|GPU|CUDA|Hopper|sm_90|fp8_gemm_unavailable")


def gpu_skips(body):
    """Whether a test body skips on a GPU condition."""
    lines = body.splitlines()
    for i, line in enumerate(lines):
        if "GTEST_SKIP" in line and (GPU_WORDS.search(line) or (i > 0 and GPU_WORDS.search(lines[i - 1]))):
            return True
    return False


def main(tests_dir):
    missing = []
    for path in sorted(pathlib.Path(tests_dir).glob("*.cc")):
        text = path.read_text()
        headers = list(HEADER.finditer(text))
        for n, m in enumerate(headers):
            end = headers[n + 1].start() if n + 1 < len(headers) else len(text)
            closing = text.find("\n}\n", m.end(), end)  # the body ends at the first `}` in column 0
            suite, name = m.group(1), m.group(2)
            selected = NAME_PART in suite + name or suite in SUITES
            if gpu_skips(text[m.end():closing if closing >= 0 else end]) and not selected:
                missing.append(f"{path.name}: {suite}.{name} skips without a GPU but is not named *{NAME_PART}* "
                               f"(nor in {', '.join(SUITES)}): make test-gpu would not run it")
    for line in missing:
        print(line)
    return 1 if missing else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--ctest-regex"]:
        print("|".join((NAME_PART,) + SUITES))
    elif sys.argv[1:] == ["--gtest-filter"]:
        print(":".join([f"*{NAME_PART}*"] + [f"{suite}.*" for suite in SUITES]))
    else:
        sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent))
