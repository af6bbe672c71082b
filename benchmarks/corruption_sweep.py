"""Corruption sweep of the read path: damage a converted checkpoint, a CheckpointManager step and
a HF model directory file by file, systematically and at random (fixed seed), and run
``mcore_to_hf.py merge`` / ``test`` and ``hf_to_mcore.py`` (on the damaged HF directory) on each
damaged copy in this process.

    python benchmarks/corruption_sweep.py [--cases 3000] [--seed 0] [--workdir DIR]

Every case must end in one of: exit 2 with exactly one ``error:`` line on stderr and nothing
written; or exit 0 with the merged tensors bit-identical to the undamaged merge (``test``: exit 0
only when the damaged reference still holds the same tensors, exit 1 only when it really holds
others; ``hf_to_mcore``: exit 0 only when the conversion, merged back, holds exactly the tensors
the safetensors library reads from the damaged directory — HF weights carry no checksums, so a
flipped bit in their data is converted faithfully, never refused or altered). ``warning:`` lines
may precede the outcome. Never an exception out of ``main()``, never exit 0 with other tensors, and the damaged
input tree is left exactly as it was (every path, link target and content hash). File kinds:
config.json, the HF index, safetensors header and data, ``.metadata``, shards, ``mcore_rl.json``,
``RECORD``, the step's ``COMPLETE`` marker and the tracker; damages: truncation, bit flips, byte
runs, JSON values of the wrong type, a deleted file, a directory or a symlink in its place.
``tests/test_corruption_sweep.py`` runs a few hundred of these cases in the suite.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script

STEP = "root/global_step_1/actor"  # the targets, relative to a case's tree
WRONG = [[], {}, "x", 7, None, True, [1, 2], {"a": 1}, -1, 2 ** 70]  # JSON values of the wrong type


@dataclass(frozen=True)
class Case:
    """Damage ``how`` (with ``arg``) of ``rel`` in a copy of the tree, then run ``command``."""

    command: str  # "merge_step" | "merge_conv" | "test_conv" | "test_hf" | "convert_hf"
    rel: str
    how: str
    arg: object = None

    def name(self) -> str:
        return f"{self.command}:{self.rel}:{self.how}:{self.arg}"


# ---- the pristine tree and its expected results --------------------------------------------------
def make_tree(fixtures: dict, base: str) -> str:
    """``base/tree``: the step's root (marker, tracker), the converter output, a HF dir with an index."""
    tree = os.path.join(base, "tree")
    shutil.copytree(os.path.dirname(os.path.dirname(fixtures["step"])), os.path.join(tree, "root"), symlinks=True)
    shutil.copytree(fixtures["conv"], os.path.join(tree, "conv"), symlinks=True)
    shutil.copytree(fixtures["hf"], os.path.join(tree, "hf"), symlinks=True)
    from safetensors import safe_open

    with safe_open(os.path.join(tree, "hf", "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    with open(os.path.join(tree, "hf", "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}, f)
    return tree


def run_cli(argv: list[str]) -> tuple[int | str, str, str]:
    """mcore_to_hf.main(argv) in this process (hf_to_mcore.main for an argv starting with
    ``--hf_model_path``): (exit code or the escaped exception, stdout, stderr)."""
    if argv[0] == "--hf_model_path":
        from converters.hf_to_mcore import main
    else:
        from converters.mcore_to_hf import main

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code: int | str = main(argv)
    except BaseException as e:  # noqa: BLE001 - what the sweep reports
        code = f"raised {type(e).__name__}: {' '.join(str(e).split())[:300]}"
    return code, out.getvalue(), err.getvalue()


def argv_of(command: str, tree: str, pristine: str, out: str) -> list[str]:
    """The CLI call of a case: its damaged tree ``tree`` (the other side from ``pristine``)."""
    if command == "merge_step":
        return ["merge", "--local_dir", os.path.join(tree, STEP), "--target_dir", out]
    if command == "merge_conv":
        return ["merge", "--local_dir", os.path.join(tree, "conv"), "--target_dir", out]
    if command == "test_conv":
        return ["test", "--local_dir", os.path.join(tree, "conv"), "--test_hf_dir", os.path.join(pristine, "hf")]
    if command == "convert_hf":
        return ["--hf_model_path", os.path.join(tree, "hf"), "--output_path", out]
    return ["test", "--local_dir", os.path.join(pristine, "conv"), "--test_hf_dir", os.path.join(tree, "hf")]


def load_dir(directory: str) -> dict:
    """name -> tensor of a HF directory, read with the safetensors library alone (not our reader)."""
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def expected(pristine: str, scratch: str, convert: bool = True) -> dict[str, dict]:
    """The undamaged merges' tensors (per merge command); the undamaged ``test`` runs must pass."""
    refs = {}
    for command in ("merge_step", "merge_conv"):
        out = os.path.join(scratch, f"expected_{command}")
        code, _, err = run_cli(argv_of(command, pristine, pristine, out))
        assert code == 0, (command, code, err)
        refs[command] = load_dir(out)
        shutil.rmtree(out)
    for command in ("test_conv", "test_hf"):
        code, out, err = run_cli(argv_of(command, pristine, pristine, ""))
        assert code == 0, (command, code, out, err)
    if not convert:  # hf_to_mcore sets up megatron's groups in this process: only where it is swept
        return refs
    out = os.path.join(scratch, "expected_convert")
    assert _judge(Case("convert_hf", "hf", "none"), *run_cli(argv_of("convert_hf", pristine, pristine, out)),
                  pristine, out, refs) is None
    shutil.rmtree(out)
    return refs


# ---- damages -------------------------------------------------------------------------------------
def files_of(tree: str) -> list[str]:
    """Every file of the tree (relative), sorted."""
    out = []
    for base, dirs, names in os.walk(tree):
        dirs.sort()
        out += [os.path.relpath(os.path.join(base, n), tree) for n in sorted(names)]
    return out


def command_for(rel: str) -> list[str]:
    """The commands that read ``rel`` (the step's marker and tracker: the step merge)."""
    if rel.startswith("root/"):
        return ["merge_step"]
    if rel.startswith("conv/"):
        return ["merge_conv", "test_conv"]
    return ["test_hf", "convert_hf"]


def systematic(tree: str) -> list[Case]:
    """Each file x each damage kind that applies to it (a fixed list: positions at both ends and
    the middle)."""
    cases = []
    for rel in files_of(tree):
        size = os.path.getsize(os.path.join(tree, rel))
        hows = [("truncate", 0), ("truncate", size // 2), ("truncate", max(size - 1, 0)), ("flip", 0),
                ("flip", size // 2), ("flip", max(size - 1, 0)), ("delete", None), ("dir", None),
                ("link_outside", None), ("link_dangling", None), ("append", 16)]
        if rel.endswith((".json", "COMPLETE", "RECORD")):
            hows += [("json_top", i) for i in range(len(WRONG))] + [("json_key", i) for i in range(len(WRONG))]
        if rel.endswith(".safetensors"):
            hows += [("st_len", v) for v in (0, 7, size, 2 ** 62, 100_000_001)]
            hows += [("st_entry", i) for i in range(len(WRONG))]
        for i, (how, arg) in enumerate(hows):
            commands = command_for(rel)
            cases.append(Case(commands[i % len(commands)], rel, how, arg))
    return cases


def randomised(tree: str, count: int, seed: int) -> list[Case]:
    """``count`` cases: a random file, a random damage at random positions."""
    rng = random.Random(seed)
    rels = files_of(tree)
    kinds = ["flip", "flip", "run", "truncate", "json_key", "st_entry", "swap", "zero"]
    cases = []
    for _ in range(count):
        rel = rng.choice(rels)
        size = os.path.getsize(os.path.join(tree, rel))
        how = rng.choice(kinds)
        arg: object = rng.randrange(max(size, 1))
        if how == "json_key":
            arg = (rng.randrange(1 << 30), rng.randrange(len(WRONG)))
        elif how == "st_entry":
            arg = rng.randrange(1 << 30)
        elif how in ("run", "swap", "zero"):
            arg = (rng.randrange(max(size, 1)), rng.randrange(1, 64), rng.randrange(1 << 30))
        cases.append(Case(rng.choice(command_for(rel)), rel, how, arg))
    return cases


def _json_paths(value, path=()):
    """Every (path) to a value inside a JSON document (dict keys and list indices)."""
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _json_paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _json_paths(v, path + (i,))


def _set(doc, path, new):
    if not path:
        return new
    target = doc
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = new
    return doc


def damage(tree: str, case: Case, outside: str) -> None:
    """Applies ``case``'s damage to ``tree/case.rel``; ``outside``: a directory beside the tree."""
    path = os.path.join(tree, case.rel)
    data = bytearray(open(path, "rb").read())
    how, arg = case.how, case.arg
    if how == "truncate":
        data = data[:arg]
    elif how == "flip" and data:
        data[arg % len(data)] ^= 1 << (arg % 8)
    elif how == "append":
        data += bytes(arg)
    elif how in ("run", "swap", "zero") and data:
        at, n, seed = arg
        at %= len(data)
        piece = random.Random(seed).randbytes(n) if how == "run" else bytes(n) if how == "zero" else \
            bytes(data[(at + n) % len(data):(at + n) % len(data) + n])
        data[at:at + len(piece)] = piece
    elif how == "delete":
        os.remove(path)
        return
    elif how == "dir":
        os.remove(path)
        os.mkdir(path)
        return
    elif how in ("link_outside", "link_dangling"):
        copy = os.path.join(outside, os.path.basename(path))
        shutil.copyfile(path, copy)
        os.remove(path)
        os.symlink(copy if how == "link_outside" else copy + ".gone", path)
        return
    elif how == "json_top":
        data = bytearray(json.dumps(WRONG[arg]).encode())
    elif how == "json_key":
        data = _json_damage(data, arg)
    elif how == "st_len":
        data[:8] = struct.pack("<Q", arg)
    elif how == "st_entry":
        data = _st_entry_damage(data, arg)
    with open(path, "wb") as f:
        f.write(data)


def _json_damage(data: bytearray, arg) -> bytearray:
    """One value somewhere in the document replaced by a value of another type."""
    try:
        doc = json.loads(bytes(data))
    except ValueError:
        return data[: len(data) // 2]
    pick, wrong = arg if isinstance(arg, tuple) else (arg, arg)
    paths = list(_json_paths(doc))[1:] or [()]
    path = paths[pick % len(paths)]
    return bytearray(json.dumps(_set(doc, path, WRONG[wrong % len(WRONG)])).encode())


def _st_entry_damage(data: bytearray, arg: int) -> bytearray:
    """A field of one safetensors header entry replaced (dtype, shape or offsets), header length kept."""
    n = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except ValueError:
        return data
    names = sorted(k for k in header if k != "__metadata__")
    if not names:
        return data
    entry = header[names[arg % len(names)]]
    field = ("dtype", "shape", "data_offsets")[arg // 7 % 3]
    choices = {"dtype": ["I32", "F16", "BF16", "F64", "XX", 3], "shape": [[1], [], [2, -1], "4", [10 ** 9, 10 ** 9]],
               "data_offsets": [[0, 4], [4, 0], [-1, 3], [0, 10 ** 12], "0"]}[field]
    entry[field] = choices[arg // 21 % len(choices)]
    text = json.dumps(header).encode()
    if len(text) > n:
        return data  # does not fit: the case leaves the file as it was
    return data[:8] + text.ljust(n) + data[8 + n:]


# ---- one case ------------------------------------------------------------------------------------
def tree_state(tree: str) -> dict[str, str]:
    """Path -> what is there (a link's target, a file's hash, 'dir')."""
    state = {}
    for base, dirs, names in os.walk(tree):
        for name in dirs + names:
            path = os.path.join(base, name)
            rel = os.path.relpath(path, tree)
            if os.path.islink(path):
                state[rel] = "link:" + os.readlink(path)
            elif os.path.isdir(path):
                state[rel] = "dir"
            else:
                state[rel] = hashlib.sha1(open(path, "rb").read()).hexdigest()
    return state


def run_case(case: Case, pristine: str, work: str, refs: dict) -> str | None:
    """Runs one case in ``work`` (emptied first); None when it ends as allowed, else the problem."""
    shutil.rmtree(work, ignore_errors=True)
    tree, outside, out = os.path.join(work, "tree"), os.path.join(work, "outside"), os.path.join(work, "out")
    os.makedirs(outside)
    top = case.rel.split("/")[0]  # only the damaged side is copied: the other one is read in place
    shutil.copytree(os.path.join(pristine, top), os.path.join(tree, top), symlinks=True)
    damage(tree, case, outside)
    before, listing = tree_state(tree), sorted(os.listdir(work))
    code, stdout, stderr = run_cli(argv_of(case.command, tree, pristine, out))
    problem = _judge(case, code, stdout, stderr, tree, out, refs)
    if problem is None and tree_state(tree) != before:
        problem = "the input tree changed"
    if problem is None and sorted(set(os.listdir(work)) - {"out", "out_merged"}) != listing:
        problem = f"left behind: {sorted(set(os.listdir(work)) - set(listing) - {'out', 'out_merged'})}"
    return problem


def _judge(case: Case, code, stdout: str, stderr: str, tree: str, out: str, refs: dict) -> str | None:
    if isinstance(code, str):
        return code
    lines = [line for line in stderr.splitlines() if not line.startswith("warning: ")]
    if code == 2:
        if len(lines) != 1 or not lines[0].startswith("error: ") or not stderr.endswith("\n"):
            return f"exit 2 without exactly one error line: {stderr[:300]!r}"
        return "exit 2 but an output was written" if os.path.exists(out) else None
    if lines:
        return f"exit {code} with stderr {stderr[:300]!r}"
    if case.command == "convert_hf":
        return _judge_conversion(code, tree, out)
    if case.command.startswith("merge"):
        if code != 0:
            return f"merge exit {code}"
        return _same(load_dir(out), refs[case.command], "merged")
    if case.command == "test_conv":
        return None if code == 0 else f"test exit {code} on a damaged checkpoint against the right reference"
    try:  # test_hf: the verdict must be what the reference really holds
        held = load_dir(os.path.join(tree, "hf"))
    except Exception as e:  # noqa: BLE001
        return f"test exit {code}, but safetensors itself cannot read the reference ({type(e).__name__})"
    same = _same(held, refs["merge_conv"], "reference") is None
    return None if (code == 0) == same and code in (0, 1) else f"test exit {code}, reference identical: {same}"


def _judge_conversion(code, tree: str, out: str) -> str | None:
    """An exit-0 conversion must hold what the safetensors library reads from the (damaged) input."""
    if code != 0:
        return f"hf_to_mcore exit {code}"
    try:
        held = load_dir(os.path.join(tree, "hf"))
    except Exception as e:  # noqa: BLE001
        return f"converted (exit 0) what safetensors itself cannot read ({type(e).__name__})"
    merged = os.path.join(os.path.dirname(out), "out_merged")
    code, _, err = run_cli(["merge", "--local_dir", out, "--target_dir", merged])
    if code != 0:
        return f"the conversion (exit 0) does not merge back: {code} {err[:200]!r}"
    problem = _same(load_dir(merged), held, "converted")
    shutil.rmtree(merged)
    return problem


def _same_bits(a, b) -> bool:
    """Bit-for-bit equal (a damaged input may hold NaN, which torch.equal never calls equal)."""
    import torch

    return a.contiguous().view(-1).view(torch.uint8).equal(b.contiguous().view(-1).view(torch.uint8))


def _same(got: dict, want: dict, what: str) -> str | None:
    import torch

    if sorted(got) != sorted(want):
        return f"{what} names differ"
    for name, t in want.items():
        if got[name].dtype != t.dtype or got[name].shape != t.shape or not _same_bits(got[name], t):
            return f"{what} tensor {name} differs"
    return None


def sweep(fixtures: dict, base: str, cases_random: int, seed: int, limit: int | None = None,
          commands: frozenset[str] | None = None) -> dict:
    """Builds the tree under ``base``, runs the systematic cases (at most ``limit``, a fixed random
    pick) and ``cases_random`` random ones, of ``commands`` only when given: {"cases",
    "failures": [(case, problem)], "seconds"}."""
    start = time.monotonic()
    pristine = make_tree(fixtures, base)
    refs = expected(pristine, base, commands is None or "convert_hf" in commands)
    keep = (lambda cases: [c for c in cases if c.command in commands]) if commands else (lambda cases: cases)
    cases = keep(systematic(pristine))
    if limit is not None and len(cases) > limit:
        cases = random.Random(seed).sample(cases, limit)
    cases += keep(randomised(pristine, cases_random * (8 if commands else 1), seed))[:cases_random]
    failures = []
    for case in cases:
        problem = run_case(case, pristine, os.path.join(base, "case"), refs)
        if problem is not None:
            failures.append((case.name(), problem))
    shutil.rmtree(os.path.join(base, "case"), ignore_errors=True)
    return {"cases": len(cases), "failures": failures, "seconds": time.monotonic() - start}


def scratch_dir() -> str:
    """A scratch directory in memory when there is one (the merges fsync)."""
    return tempfile.mkdtemp(prefix="mcore_rl_sweep_", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=3000, help="random cases (after every systematic one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="where the fixtures are built (default: a temp dir)")
    p.add_argument("--commands", default=None, help="only these commands, comma-separated (e.g. convert_hf)")
    p.add_argument("--limit", type=int, default=None, help="at most this many systematic cases (a fixed pick)")
    args = p.parse_args()
    from tests.read_fixtures import build

    fixtures = build(args.workdir or tempfile.mkdtemp(prefix="mcore_rl_sweep_fixtures_"))
    base = scratch_dir()
    try:
        commands = frozenset(args.commands.split(",")) if args.commands else None
        result = sweep(fixtures, base, args.cases, args.seed, args.limit, commands)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for name, problem in result["failures"]:
        print(f"FAIL {name}: {problem}")
    print(f"{result['cases']} cases, {len(result['failures'])} failures, {result['seconds']:.1f} s "
          f"({result['seconds'] / max(result['cases'], 1) * 1000:.0f} ms per case)")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
