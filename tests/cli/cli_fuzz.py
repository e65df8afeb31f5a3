"""A bounded fuzz run of the `terrace` command line (scripts/cli_fuzz.sh runs it in CI).

Random argument vectors over every command and subcommand: each one's real flags with random and
edge values (negative, zero, huge, overflowing, malformed, empty) and paths to FIFOs, device nodes,
directories, symlinks, user folders and missing places. Each run has a timeout and runs in a sandbox
folder of its worker. A run fails the fuzz when it
  - crashes: killed by a signal or exits with a code >= 128 (counted as a crash),
  - hangs: does not exit within --timeout seconds (a hang),
  - changes a file it must not: the canary tree outside the sandboxes changes in any way, or a
    fixture inside the sandbox that Terrace did not create (a user folder, a user's regular file, a
    FIFO, a device node, a symlink) is changed, replaced or removed (an escape); a regular file the
    command line names may be replaced only with --force (or by the hidden model helpers, below),
  - exits with a code other than 0, 1, 2, or names an API field instead of a CLI flag on stderr
    (reported as "bad exits" / "api names").
The sequence of runs is fixed by --seed. Values that are valid but legitimately slow (hours of
decoding, terabytes of writes) are kept out of the pools; sizes that cannot work must be refused.
Prints `cli fuzz: N runs, C crashes, H hangs, E escapes`; exits 1 if any check failed.
"""
import argparse
import json
import os
import random
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time

from safetensors_file import write_safetensors

INTS = ["-1", "0", "1", "2", "3", "7", "64", "255", "256", "257", "4096", "65536", "65537", "2147483647",
        "2147483648", "4294967295", "4294967296", "9223372036854775807", "18446744073709551615",
        "18446744073709551616", "-9223372036854775809", "1e3", "0x10", "abc", "", " 1", "1.5", "+1", "--"]
SMALL_INTS = ["-1", "0", "1", "2", "3", "16", "4294967296", "18446744073709551615", "18446744073709551616",
              "x", ""]
SIZES = ["-1", "0", "1", "4095", "4096", "4KiB", "64KiB", "1MiB", "1GiB", "2GiB", "1TiB", "16EiB",
         "18446744073709551615", "18446744073709551616", "99999999999999999999", "17179869184TiB", "1ZB", "abc",
         "", "1.5MiB", "4kb", "-4KiB"]
BLOCK_SIZES = ["-1", "0", "4096", "4KiB", "64KiB", "1MiB", "1GiB", "2GiB", "1TiB", "18446744073709551616", "abc",
               ""]
TOTAL_SIZES = ["-1", "0", "1", "4KiB", "1MiB", "4MiB", "1TiB", "64TiB", "99999999999999999999", "x"]
FLOATS = ["0", "-0", "1", "1e-5", "1e300", "-1e300", "nan", "inf", "-inf", "abc", "", "1e-400", "4"]
TOKENS = ["1,2,3", "0", "", "-1", "99999999", "1,,2", "a", "1," * 40 + "1", "18446744073709551616", "1 2"]
# Paths, relative to the worker's sandbox (its working folder). See make_fixtures.
PATHS = ["new_file", "new_dir", "new_dir/x", "fifo", "fulldev", "nulldev", "zerodev", "userdir",
         "userdir/thesis.txt", "link_file", "link_dir", "dangling", ".", "", "model", "model/config.json",
         "model/model.safetensors", "regfile", "kda.safetensors", "mx.safetensors", "attnres.safetensors",
         "x.safetensors", "run.json",
         "store", "a" * 300, "nodir/x", "emptydir"]


FLAG = None  # a flag without a value


def opt(good, bad, required=False):
    """A flag's values: mostly `good` ones (valid and quick), else an edge or malformed one from `bad`."""
    return {"good": good, "bad": bad, "required": required}


def ints(*good, required=False):
    return opt([str(g) for g in good], INTS, required)


def sizes(*good, bad=SIZES, required=False):
    return opt(list(good), bad, required)


def paths(*good, required=False):
    return opt(list(good), PATHS, required)


OUT = paths("new_file", "out.safetensors", "regfile", required=True)
FLOAT = opt(["0.5", "1", "4"], FLOATS)

# command words -> {flag: opt(...) or FLAG}; "_pos" is a positional argument.
COMMANDS = {
    ("demo",): {"--dir": paths("new_dir", "store", "emptydir"), "--preset": opt(["k3-toy"], ["kimi-k3", ""], required=True),
                "--conversations": ints(1, 2), "--turns": ints(1, 2), "--system-tokens": ints(1, 8, 64),
                "--user-tokens": ints(1, 4), "--new-tokens": ints(1, 2), "--seed": ints(0, 1, 12345),
                "--kv-nvme-size": sizes("4MiB", "8MiB", required=True), "--state-nvme-size": sizes("4MiB", required=True),
                "--expert-cache": opt(["25%", "50%", "1MiB"], ["0%", "200%", "x", ""]), "--fresh": FLAG, "--json": FLAG},
    ("bench", "tiers"): {"--tier": opt(["host", "nvme", "hbm"], ["disk", ""]),
                         "--op": opt(["write", "read", "randread"], ["erase", ""]),
                         "--block-size": sizes("4KiB", "64KiB", "1MiB", bad=BLOCK_SIZES),
                         "--queue-depth": ints(1, 8, 32),
                         "--total-bytes": sizes("1MiB", "4MiB", bad=TOTAL_SIZES, required=True),
                         "--dir": paths("bench", "new_dir", "emptydir"), "--index-dir": paths("idx", "new_dir/idx"),
                         "--durability": opt(["async", "sync"], ["never"]), "--batch": ints(1, 8, 64),
                         "--threads": ints(1, 2, 4), "--keep": FLAG, "--json": FLAG},
    ("store", "fill"): {"--dir": paths("store2", "new_dir", required=True), "--index-dir": paths("idx2"),
                        "--count": opt(["1", "3", "16"], SMALL_INTS, True),
                        "--block-size": sizes("4KiB", "64KiB"), "--seed": ints(1, 2),
                        "--capacity": sizes("64MiB", "1GiB"), "--threads": opt(["1", "2"], SMALL_INTS + ["100000"])},
    ("store", "check"): {"--dir": paths("store2", "new_dir", required=True), "--index-dir": paths("idx2"),
                         "--seed": ints(1, 2), "--capacity": sizes("64MiB", "1GiB"),
                         "--block-size": sizes("4KiB", "64KiB"), "--expect": paths("regfile", "userdir/thesis.txt"),
                         "--count": opt(["1", "3"], SMALL_INTS)},
    ("store", "recover"): {"--dir": paths("store2", "new_dir", required=True), "--index-dir": paths("idx2")},
    ("store", "stats"): {"--dir": paths("store2", "new_dir", required=True), "--index-dir": paths("idx2"),
                         "--json": FLAG, "--prometheus": FLAG},
    ("store", "drill"): {"--dir": paths("drill", "new_dir", "emptydir", required=True),
                         "--kills": opt(["1"], ["-1", "0", "10001", "18446744073709551616", "x", ""]), "--faults": opt(["eio", "bitflip", "powercut", "short"],
                                                                           ["", "meteor", "eio,,", "all"]),
                         "--seed": ints(1, 2), "--block-size": sizes("4KiB", "16KiB"),
                         "--capacity": sizes("16MiB", "32MiB"), "--max-acks": opt(["2", "4"], ["-1", "0", "100001", "x", ""]),
                         "--json": FLAG},
    ("model", "init"): {"--preset": opt(["k3-toy"], ["k3-small", "no-such", ""], True),
                        "--config": paths("model/config.json"), "--out": paths("new_model", "emptydir", "model",
                                                                                required=True),
                        "--seed": ints(0, 3), "--shard-bytes": sizes("1MiB", "2GiB"), "--force": FLAG,
                        "--routing-tokens": opt(["0", "8"], ["-1", "65537", "4294967296", "x", ""])},
    ("model", "inspect"): {"_pos": paths("model", required=True), "--preset": opt(["k3-toy"], ["kimi-k3", "no", ""]),
                           "--json": FLAG, "--summary": FLAG, "--tensors": FLAG},
    ("model", "run"): {"--model": paths("model", required=True), "--tokens": opt(["1,2,3", "0", "5"], TOKENS, True),
                       "--max-new": opt(["0", "1", "3"], ["-1", "65537", "4294967296", "x", ""]), "--json": FLAG,
                       "--routing-stats": FLAG, "--dump-logits": paths("new_file", "logits.safetensors", "regfile"),
                       "--expert-cache": opt(["25%"], ["0%", "x"]),
                       "--expert-prometheus": paths("new_file", "experts.prom", "regfile", "model/config.json"),
                       "--threads": opt(["1", "2"], ["-1", "0", "257", "100000", "x"]), "--force": FLAG},
    ("model", "dequant-mxfp4"): {"--in": paths("mx.safetensors", required=True), "--out": OUT},
    ("model", "quantize-mxfp4"): {"--in": paths("mx.safetensors", required=True), "--out": OUT},
    ("model", "copy-tensors"): {"--in": paths("mx.safetensors", "model", "kda.safetensors", required=True),
                                "--out": OUT, "--f32": FLAG},
    ("ref", "kda"): {"--in": paths("kda.safetensors", required=True), "--out": OUT, "--scale": FLOAT,
                     "--chunked": FLAG, "--chunk-size": ints(1, 2, 64), "--force": FLAG},
    ("ref", "mla"): {"--in": paths("kda.safetensors", required=True), "--out": OUT, "--heads": ints(1, 2),
                     "--absorbed": FLAG, "--eps": opt(["1e-5"], FLOATS), "--force": FLAG},
    ("ref", "attnres"): {"--in": paths("attnres.safetensors", required=True), "--out": OUT, "--force": FLAG},
    ("ref", "moe"): {"--in": paths("mx.safetensors", required=True), "--out": OUT, "--config": paths("model/config.json"),
                     "--top-k": ints(1, 2), "--scaling": FLOAT, "--situ-beta": FLOAT, "--situ-linear-beta": FLOAT,
                     "--eps": opt(["1e-5"], FLOATS), "--force": FLAG},
    ("ref", "mxfp4"): {"--in": paths("mx.safetensors", required=True), "--out": OUT, "--force": FLAG},
    ("ref", "codec"): {"--codec": opt(["int8", "bf16", "fp8+zstd"], ["", "int3", "f32+"], True),
                       "--in": paths("x.safetensors", "mx.safetensors", required=True), "--out": OUT, "--force": FLAG},
    ("report",): {"_pos": paths("run.json", "regfile", required=True),
                  "-o": paths("new_file", "report.html", "regfile", "run.json", required=True), "--svg": FLAG,
                  "--force": FLAG},
    ("trace", "gen"): {"-o": paths("new_file", "trace.jsonl", "regfile"), "--requests": ints(1, 3, 5),
                       "--seed": ints(1, 2), "--force": FLAG},
}
# Hidden model helpers whose --out replaces any regular file without --force (src/cli/cmd_model.cpp).
REPLACE_WITHOUT_FORCE = {("model", "dequant-mxfp4"), ("model", "quantize-mxfp4"), ("model", "copy-tensors")}
JUNK = [["frobnicate"], ["model", "frob"], ["bench"], ["store"], ["ref"], [], ["--version"], ["--help"],
        ["demo", "extra"], ["model", "run", "--", "x"], ["--no-such-flag"]]
API_NAMES = ("capacity_bytes", "create_if_missing", "PutOptions", "options.index_dir", "chunk_bytes",
             "StoreOptions", "NvmeTierOptions", "HostTierOptions")


def argv_for(rng):
    if rng.random() < 0.04:
        return list(rng.choice(JUNK))
    words = rng.choice(sorted(COMMANDS))
    args = []
    for flag, spec in COMMANDS[words].items():
        if spec is FLAG:
            if rng.random() < 0.4:
                args.append([flag])
            continue
        if rng.random() >= (0.97 if spec["required"] else 0.45):
            continue
        value = rng.choice(spec["good"]) if rng.random() < 0.75 else rng.choice(spec["bad"])
        if flag == "_pos":
            args.append([value])
        elif rng.random() < 0.02:
            args.append([flag])  # value missing
        else:
            args.append([flag, value])
    if rng.random() < 0.04:
        args.append([rng.choice(["--bogus", "-x", "--dir=", "--seed=1"])])
    rng.shuffle(args)
    return list(words) + [a for group in args for a in group]


# ---- fixtures ------------------------------------------------------------------------------------

def f32(rng, n):
    return struct.pack(f"<{n}f", *[rng.uniform(-1, 1) for _ in range(n)])


def make_canary(root):
    os.makedirs(os.path.join(root, "sub"), exist_ok=True)
    for name, text in [("file", "canary\n"), ("sub/notes.txt", "do not touch\n"), ("config.json", "{}\n")]:
        with open(os.path.join(root, name), "w") as f:
            f.write(text)


def make_fixtures(sandbox, canary, model_src, can_mknod):
    """The paths of PATHS that exist, inside `sandbox`. Returns the protected ones (Terrace did not create them)."""
    rng = random.Random(7)
    os.makedirs(os.path.join(sandbox, "userdir", "photos"), exist_ok=True)
    with open(os.path.join(sandbox, "userdir", "thesis.txt"), "w") as f:
        f.write("years of work\n")
    with open(os.path.join(sandbox, "userdir", "photos", "cat.jpg"), "wb") as f:
        f.write(b"\xff\xd8 not a jpeg")
    os.makedirs(os.path.join(sandbox, "emptydir"), exist_ok=True)
    with open(os.path.join(sandbox, "regfile"), "w") as f:
        f.write("a regular file Terrace may replace when told to\n")
    for name, target in [("link_file", os.path.join(canary, "file")), ("link_dir", canary),
                         ("dangling", os.path.join(canary, "missing"))]:
        p = os.path.join(sandbox, name)
        if not os.path.lexists(p):
            os.symlink(target, p)
    if not os.path.lexists(os.path.join(sandbox, "fifo")):
        os.mkfifo(os.path.join(sandbox, "fifo"))
    # Device nodes live in the sandbox (never the system's /dev/*): a regression that replaced a device
    # target would then damage only the fuzzer's own copy.
    for name, minor in [("fulldev", 7), ("nulldev", 3), ("zerodev", 5)]:
        if can_mknod and not os.path.lexists(os.path.join(sandbox, name)):
            os.mknod(os.path.join(sandbox, name), stat.S_IFCHR | 0o666, os.makedev(1, minor))
    if not os.path.exists(os.path.join(sandbox, "model", "config.json")):
        shutil.rmtree(os.path.join(sandbox, "model"), ignore_errors=True)
        shutil.copytree(model_src, os.path.join(sandbox, "model"))
    write_safetensors(os.path.join(sandbox, "kda.safetensors"), {
        "q": ("F32", [1, 4, 2, 8], f32(rng, 64)), "k": ("F32", [1, 4, 2, 8], f32(rng, 64)),
        "g": ("F32", [1, 4, 2, 8], f32(rng, 64)), "v": ("F32", [1, 4, 2, 8], f32(rng, 64)),
        "beta": ("F32", [1, 4, 2], f32(rng, 8))})
    write_safetensors(os.path.join(sandbox, "mx.safetensors"), {
        "weight": ("F32", [2, 32], f32(rng, 64)), "weight_packed": ("U8", [2, 16], bytes(range(32))),
        "weight_scale": ("U8", [2, 1], bytes([127, 126]))})
    write_safetensors(os.path.join(sandbox, "attnres.safetensors"), {
        "sources": ("F32", [2, 3, 8], f32(rng, 48)), "proj": ("F32", [1, 8], f32(rng, 8)),
        "norm": ("F32", [8], f32(rng, 8))})
    write_safetensors(os.path.join(sandbox, "x.safetensors"), {"x": ("F32", [2, 32], f32(rng, 64))})
    with open(os.path.join(sandbox, "run.json"), "w") as f:
        json.dump({"requests": 3, "hit_rate": 0.5}, f)  # any JSON object makes a report (a table of values)
    protected = ["userdir", "regfile", "run.json", "link_file", "link_dir", "dangling", "fifo"] + (
        ["fulldev", "nulldev", "zerodev"] if can_mknod else [])
    return [os.path.join(sandbox, p) for p in protected]


def entry(p):
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode):
        return ("link", os.readlink(p))
    if stat.S_ISREG(st.st_mode):
        with open(p, "rb") as f:
            return ("file", f.read())
    return (stat.S_IFMT(st.st_mode), st.st_rdev if stat.S_ISCHR(st.st_mode) else None)


def snapshot(paths):
    """{path: entry} for each path and, for real directories, everything below it."""
    out = {}
    for top in paths:
        if not os.path.lexists(top):
            continue
        out[top] = entry(top)
        if os.path.isdir(top) and not os.path.islink(top):
            for dirpath, dirnames, filenames in os.walk(top):
                for n in dirnames + filenames:
                    out[os.path.join(dirpath, n)] = entry(os.path.join(dirpath, n))
    return out


def damaged(before, after, strict, named=()):
    """Paths of `before` that changed or vanished (and, if strict, paths that appeared). A regular file
    the command line names itself may be replaced (an output written over a regular file)."""
    bad = [p for p, e in before.items() if after.get(p) != e and not (e[0] == "file" and p in named)]
    if strict:
        bad += [p for p in after if p not in before]
    return bad


# ---- the run ---------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--terrace", required=True)
    ap.add_argument("--runs", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds one run may take")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds for all runs; later runs are skipped")
    ap.add_argument("--keep", action="store_true", help="keep the sandbox folder")
    ap.add_argument("--root", help="folder to make the sandbox in (default: the system temp folder)")
    ap.add_argument("--skip", action="append", default=[], help="leave out commands starting with these words")
    args = ap.parse_args()
    terrace = os.path.abspath(args.terrace)
    if not os.access(terrace, os.X_OK):
        print(f"cli fuzz: {terrace} is not an executable; build it first", file=sys.stderr)
        return 2

    if args.root:
        os.makedirs(args.root, exist_ok=True)
    root = tempfile.mkdtemp(prefix="terrace-cli-fuzz-", dir=args.root)
    canary = os.path.join(root, "canary")
    make_canary(canary)
    model_src = os.path.join(root, "model-src")
    r = subprocess.run([terrace, "model", "init", "--preset", "k3-toy", "--out", model_src, "--routing-tokens", "0"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        print(f"cli fuzz: cannot create the model fixture:\n{r.stderr}", file=sys.stderr)
        return 2
    can_mknod = True
    try:
        os.mknod(os.path.join(root, "probe"), stat.S_IFCHR | 0o600, os.makedev(1, 7))
        os.unlink(os.path.join(root, "probe"))
    except OSError as e:
        can_mknod = False
        print(f"cli fuzz: WARN: cannot create device nodes ({e}); device targets are not fuzzed (run as root)")

    for word in args.skip:
        for words in [w for w in COMMANDS if " ".join(w).startswith(word)]:
            del COMMANDS[words]
    rng = random.Random(args.seed)
    plans = [argv_for(rng) for _ in range(args.runs)]
    lock = threading.Lock()
    results = {"runs": 0, "crashes": [], "hangs": [], "escapes": [], "bad_exits": [], "api_names": [],
               "skipped": 0}
    deadline = time.monotonic() + args.budget
    canary_before = snapshot([canary])

    def worker(w):
        sandbox = os.path.join(root, f"sandbox-{w}")
        os.makedirs(sandbox)
        protected = make_fixtures(sandbox, canary, model_src, can_mknod)
        for i in range(w, len(plans), args.jobs):
            if time.monotonic() > deadline:
                with lock:
                    results["skipped"] += 1
                continue
            argv = plans[i]
            before = snapshot(protected)
            start = time.monotonic()
            p = subprocess.Popen([terrace, *argv], cwd=sandbox, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                _, err = p.communicate(timeout=args.timeout)
                hung = False
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                _, err = p.communicate()
                hung = True
            err = err.decode(errors="replace")
            secs = time.monotonic() - start
            rc = p.returncode
            where = f"run {i} ({secs:.1f} s, exit {rc}): terrace {' '.join(repr(a) if not a or ' ' in a else a for a in argv)}"
            tail = "\n      " + "\n      ".join(err.strip().splitlines()[-3:]) if err.strip() else ""
            replaces = "--force" in argv or tuple(argv[:2]) in REPLACE_WITHOUT_FORCE
            named = {os.path.join(sandbox, a) for a in argv if a} if replaces else set()
            after = snapshot(protected)
            hurt = damaged(before, after, strict=False, named=named)
            if not hurt and after != before:  # a file replaced as allowed now holds Terrace's output: make it the user's again
                make_fixtures(sandbox, canary, model_src, can_mknod)
            hurt += damaged(canary_before, snapshot([canary]), strict=True)
            with lock:
                results["runs"] += 1
                if hung:
                    results["hangs"].append(where + tail)
                elif rc < 0 or rc >= 128:
                    results["crashes"].append(where + tail)
                elif rc not in (0, 1, 2):
                    results["bad_exits"].append(where + tail)
                names = [n for n in API_NAMES if n in err]
                if names:
                    results["api_names"].append(f"{where}: names {', '.join(names)}{tail}")
                if hurt:
                    results["escapes"].append(f"{where}: changed {', '.join(sorted(set(hurt))[:5])}{tail}")
            if hurt:  # restore, so that later runs see the fixtures again
                shutil.rmtree(canary, ignore_errors=True)
                make_canary(canary)
                for p_ in protected:
                    if os.path.lexists(p_) and (os.path.islink(p_) or not os.path.isdir(p_)):
                        os.unlink(p_)
                make_fixtures(sandbox, canary, model_src, can_mknod)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(args.jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    for kind in ("crashes", "hangs", "escapes", "bad_exits", "api_names"):
        for line in results[kind]:
            print(f"cli fuzz: {kind[:-1] if kind.endswith('s') else kind}: {line}")
    if results["skipped"]:
        print(f"cli fuzz: the {args.budget:.0f} s budget ran out; {results['skipped']} planned runs were skipped")
    print(f"cli fuzz: {results['runs']} runs, {len(results['crashes'])} crashes, {len(results['hangs'])} hangs, "
          f"{len(results['escapes'])} escapes")
    if results["bad_exits"] or results["api_names"]:
        print(f"cli fuzz: also {len(results['bad_exits'])} exits outside 0/1/2 and {len(results['api_names'])} "
              f"messages naming API fields")
    if args.keep:
        print(f"cli fuzz: sandbox kept at {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    failed = any(results[k] for k in ("crashes", "hangs", "escapes", "bad_exits", "api_names"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
