"""Every tensor the library creates goes on the platform's device (NCCL refuses CPU buffers; CPU
noise for CUDA logits is a device mismatch). A static scan of mcore_rl/ finds torch factory calls
without ``device=``; deliberate host allocations (offload copies, checkpoint snapshots, converters,
seeded host generators) carry a trailing ``# host`` comment saying why."""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "mcore_rl"
# torch functions that allocate on the default (CPU) device unless told otherwise
FACTORIES = {
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "range", "linspace",
    "logspace", "eye", "rand", "randn", "randint", "randperm", "empty_strided", "scalar_tensor",
    "Generator",
}


def host_allocations(source: str) -> list[tuple[int, str]]:
    """(line, text) of torch factory calls without device= and without a ``# host: <why>`` mark."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if node.func.attr not in FACTORIES or not (isinstance(owner, ast.Name) and owner.id == "torch"):
            continue
        if any(k.arg == "device" for k in node.keywords):
            continue
        # the mark may sit on any line of a call that spans several
        span = lines[node.lineno - 1 : (node.end_lineno or node.lineno)]
        if not any("# host:" in line for line in span):
            found.append((node.lineno, lines[node.lineno - 1].strip()))
    return found


def test_scan_finds_an_unmarked_host_allocation():
    bad = "import torch\nx = torch.zeros(3)\ny = torch.zeros(3, device=d)\nz = torch.ones(2)  # host: why\nw = torch.ones(2)  # host\n"
    assert host_allocations(bad) == [(2, "x = torch.zeros(3)"), (5, "w = torch.ones(2)  # host")]


def test_library_allocates_on_the_platform_device():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, text in host_allocations(path.read_text())
    ]
    assert not offenders, (
        "torch allocations without device= (pass the platform's device, or mark a deliberate "
        "host tensor with a trailing '# host: <why>' comment):\n" + "\n".join(offenders)
    )
