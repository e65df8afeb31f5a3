#!/usr/bin/env python3
"""Compiles each library's sources, and each test executable's, as ONE translation unit
(g++ -fsyntax-only), so that a name two files of one target both define at namespace scope (an
anonymous-namespace helper, a `using` alias, a test fixture) fails now rather than later: unity
builds (CMAKE_UNITY_BUILD, scripts/test.sh) batch a target's files several to a translation unit,
and which files share one changes whenever a file is added. CUDA sources are left out (nvcc
compiles them file by file). About a minute.

  scripts/one_tu_check.py
"""
import glob
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CXX = os.environ.get("CXX", "g++")
FLAGS = ["-std=c++20", "-fsyntax-only", "-Wno-subobject-linkage", "-Wno-psabi", "-DFMT_SHARED",
         "-I" + os.path.join(ROOT, "include"), "-I" + ROOT]


def check(name, sources, extra):
    """True when `sources` compile as one translation unit."""
    with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as tu:
        tu.write("".join('#include "%s"\n' % s for s in sources))
    try:
        r = subprocess.run([CXX] + FLAGS + extra + [tu.name], capture_output=True, text=True)
    finally:
        os.unlink(tu.name)
    if r.returncode != 0:
        sys.stderr.write(r.stderr)
        sys.stderr.write("scripts/one_tu_check.py: %s: its %d sources do not compile as one translation unit (a name "
                         "defined in two of them clashes; rename one, or fold them into one shared helper)\n"
                         % (name, len(sources)))
    return r.returncode == 0


def library_targets():
    """Every folder of src/, tiers/ and adapters/ with more than one .cpp (a library each)."""
    for d in sorted(glob.glob(os.path.join(ROOT, "src", "*")) + glob.glob(os.path.join(ROOT, "tiers", "*")) +
                    glob.glob(os.path.join(ROOT, "adapters", "*"))):
        srcs = sorted(s for s in glob.glob(os.path.join(d, "*.cpp")) if "cuda" not in os.path.basename(s))
        if len(srcs) > 1:
            yield os.path.relpath(d, ROOT), srcs, []


def test_targets():
    """Every terrace_add_test(NAME SOURCES ...) with more than one source, with the macros its folder's
    target_compile_definitions name (any value will do for a syntax check)."""
    for cm in sorted(glob.glob(os.path.join(ROOT, "tests", "*", "CMakeLists.txt"))):
        d = os.path.dirname(cm)
        text = open(cm).read()
        defines = ["-D%s=\"x\"" % n for block in re.findall(r"target_compile_definitions\(\s*\w+\s+PRIVATE\s+([^)]*)\)", text)
                   for n in re.findall(r"(\w+)=", block)]
        for m in re.finditer(r"terrace_add_test\(\s*(\w+)\s+SOURCES\s+(.*?)\s+(?:LIBS|LABELS|TIMEOUT)\b", text, re.S):
            srcs = []
            for s in m.group(2).split():
                s = s.replace("${PROJECT_SOURCE_DIR}", ROOT).replace("${CMAKE_CURRENT_SOURCE_DIR}", d)
                if s.endswith(".cpp"):
                    srcs.append(s if os.path.isabs(s) else os.path.join(d, s))
            if len(srcs) > 1:
                yield "test %s" % m.group(1), srcs, ["-I" + d, "-I" + os.path.join(ROOT, "tests")] + defines


def main():
    targets = list(library_targets()) + list(test_targets())
    failed = [name for name, srcs, extra in targets if not check(name, srcs, extra)]
    if failed:
        sys.stderr.write("scripts/one_tu_check.py: %d of %d targets failed: %s\n" % (len(failed), len(targets), ", ".join(failed)))
        return 1
    print("scripts/one_tu_check.py: all %d libraries and test executables compile as one translation unit" % len(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
