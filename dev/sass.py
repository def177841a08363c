"""The kernels' machine code, read without a GPU.

    python3 dev/sass.py [--arch sm_90] [--kernels REGEX] [--against REV] [--loop KERNEL]

Compiles kernels/flashdecode.cu, with the kernel list of core's table (go
run core/cuda/gen_instances.go, as go generate does), into a cubin with nvcc
and disassembles it with cuobjdump, then prints, for each kernel whose name matches --kernels
(default: the stage-1 kernels at fp16): its registers and spill bytes, and
its tile loop, the backward branch around the most HMMAs (tensor-core mmas):
its instructions, how many of them one pass through it executes on each way
its branches allow, code the compiler placed after the loop included (up to
four counts, else the range: a tile whose copies are skipped, a whole tile,
a sequence's last tile...; "uncounted" for a loop with an inner loop), and
the HMMAs, LDGSTS (cp.async copies) and branches in it; and how far in
program order the first tile copy (a 16-byte LDGSTS) lies after the PDL
wait (ACQBULK): the code every call runs before its first tile is on its way.
For the kernels without a tile loop (the combines, merge_states) it counts the
wide global loads (LDG .64/.128) issued after the PDL wait before the first
instruction that reads one's result: a fold step meant to cost one round trip
to L2 shows all of its loads there (`--kernels '^fd_(combine|merge)'`), and
ptxas sinking them towards their uses, to save registers, shows fewer.

With --against REV (a git revision) the kernels/ of that revision are built
the same way and shown alongside, with whether each kernel's SASS is the
same instruction for instruction: a change whose SASS is unchanged needs no
new GPU run. --loop KERNEL prints that kernel's tile loop.

nvcc: $CUDA_HOME/bin, PATH, or the CUDA 13 wheels CI installs under
_build/ci/cuda. cuobjdump and the nvdisasm it runs: beside nvcc, or from
`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm` (their
nvidia/cu13/bin on sys.path).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CI_CUDA = os.path.join(ROOT, "_build", "ci", "cuda", "nvidia", "cu13")

_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;")
_FUNCTION = re.compile(r"^\s*Function : (\S+)")
_BRANCH = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")
_REGISTER = re.compile(r"\bR(\d+)\b")


def find_tool(name, cuda_home):
    """The path of a CUDA tool: under cuda_home, on PATH, in CI's wheels, or
    in a pip wheel's nvidia/cu13/bin on sys.path; None if nowhere."""
    dirs = [os.path.join(cuda_home, "bin")] if cuda_home else []
    found = shutil.which(name)
    if found:
        dirs.append(os.path.dirname(found))
    dirs.append(os.path.join(CI_CUDA, "bin"))
    dirs += [os.path.join(p, "nvidia", "cu13", "bin") for p in sys.path if p]
    for d in dirs:
        path = os.path.join(d, name)
        if os.access(path, os.X_OK):
            return path
    return None


def parse_resources(ptxas_output):
    """{kernel: (registers, spill store bytes, spill load bytes)} from nvcc's
    --resource-usage output."""
    usage, kernel = {}, None
    for line in ptxas_output.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line) or re.search(r"Function properties for (\w+)", line)
        if m:
            kernel = m.group(1)
            usage.setdefault(kernel, [0, 0, 0])
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and kernel:
            usage[kernel][1:] = [int(m.group(1)), int(m.group(2))]
        m = re.search(r"Used (\d+) registers", line)
        if m and kernel:
            usage[kernel][0] = int(m.group(1))
    return {k: tuple(v) for k, v in usage.items()}


def parse_sass(text):
    """{kernel: [(address, instruction)]} from `cuobjdump -sass` output."""
    kernels, current = {}, None
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            current = kernels.setdefault(m.group(1), [])
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            current.append((int(m.group(1), 16), m.group(2)))
    return kernels


def tile_loop(instructions):
    """The instructions of the loop that holds the most HMMAs (the shortest
    such loop on a tie): those from a backward branch's target to the branch.
    Empty where no loop holds an HMMA."""
    best = []
    for i, (addr, text) in enumerate(instructions):
        m = _BRANCH.search(text)
        if not m or int(m.group(1), 16) >= addr:
            continue
        target = int(m.group(1), 16)
        body = [ins for ins in instructions[:i + 1] if ins[0] >= target]
        key = (count(body, "HMMA"), -len(body))
        if key[0] and (not best or key > (count(best, "HMMA"), -len(best))):
            best = body
    return best


def loop_paths(instructions, loop):
    """The instruction counts of one pass through loop (tile_loop's list,
    within the function's instructions), from its first instruction to its
    back branch, over every way the branches allow, smallest first: a pass
    that issues no copies, one that copies a whole tile, one that copies a
    sequence's last tile... A pass may leave the loop's addresses for code
    the compiler placed after it and jump back in. Past 64 counts at one
    instruction only the smallest and largest are kept: then the second value
    returned is True. An inner loop (a cycle that avoids the back branch)
    gives no counts: ([], False)."""
    index = {addr: i for i, (addr, _) in enumerate(instructions)}
    head, tail = index[loop[0][0]], index[loop[-1][0]]

    def successors(i):
        if i == tail:  # the pass ends at the back branch
            return []
        text = instructions[i][1]
        words = text.split()
        predicated = words[0].startswith("@") and words[0] != "@PT"
        out = []
        if opcode(text) == "BRA":
            m = _BRANCH.search(text)
            if m and int(m.group(1), 16) in index:
                out.append(index[int(m.group(1), 16)])
            if predicated:
                out.append(i + 1)
        elif opcode(text) not in ("EXIT", "RET") or predicated:
            out.append(i + 1)
        return [j for j in out if j != head and j < len(instructions)]

    # Depth-first order of what a pass can reach; a node met again while it
    # is still open closes a cycle.
    order, state, stack = [], {head: 1}, [(head, iter(successors(head)))]
    while stack:
        node, it = stack[-1]
        nxt = next(it, None)
        if nxt is None:
            state[node] = 2
            order.append(node)
            stack.pop()
        elif state.get(nxt) == 1:
            return [], False
        elif nxt not in state:
            state[nxt] = 1
            stack.append((nxt, iter(successors(nxt))))
    lengths = {i: set() for i in order}
    lengths[head].add(1)
    pruned = False
    for i in reversed(order):  # a topological order
        for j in successors(i):
            lengths[j] |= {n + 1 for n in lengths[i]}
            if len(lengths[j]) > 64:  # many branches: keep the spread, not every count
                lengths[j], pruned = {min(lengths[j]), max(lengths[j])}, True
    return sorted(lengths.get(tail, ())), pruned


def first_copy(instructions):
    """How many instructions after the PDL wait (ACQBULK, griddepcontrol.wait)
    the first 16-byte LDGSTS (a tile's cp.async) lies, in program order; None
    where the kernel has no such pair. Every call runs that code, or the
    branch-free most of it, between its release and its first copy."""
    names = [mnemonic(text) for _, text in instructions]
    wait = next((i for i, n in enumerate(names) if n == "ACQBULK"), None)
    if wait is None:
        return None
    return next((i - wait for i, n in enumerate(names) if i > wait and n.startswith("LDGSTS.") and n.endswith(".128")),
                None)


def loads_in_flight(instructions):
    """(issued, total): of the wide global loads (LDG .64 or .128) after the
    PDL wait (ACQBULK, else the kernel's start), how many are issued before
    the first instruction that reads a register one of them writes, in program
    order, and how many there are. issued == total: they all wait on one round
    trip; fewer: the first use waits before the rest are on their way."""
    names = [mnemonic(text) for _, text in instructions]
    start = next((i + 1 for i, n in enumerate(names) if n == "ACQBULK"), 0)
    wide = {i for i in range(start, len(names))
            if names[i].startswith("LDG.") and names[i].split(".")[-1] in ("64", "128")}
    pending, issued = set(), None
    for i in range(start, len(instructions)):
        operands = instructions[i][1].split(None, 2 if instructions[i][1].startswith("@") else 1)[-1]
        if i in wide:
            dest = _REGISTER.search(operands)
            first = int(dest.group(1))
            pending |= set(range(first, first + int(names[i].split(".")[-1]) // 32))
            continue
        # A store's first operand is its address; anything else's is what it writes.
        sources = operands if opcode(instructions[i][1]).startswith("ST") else operands.partition(",")[2]
        if pending & {int(r) for r in _REGISTER.findall(sources)}:
            issued = sum(1 for j in wide if j < i)
            break
    return (len(wide) if issued is None else issued), len(wide)


def mnemonic(text):
    """An instruction's opcode with its modifiers, without its predicate:
    LDGSTS.E.BYPASS.128 for "@P2 LDGSTS.E.BYPASS.128 [R15], ..."."""
    words = text.split()
    return words[1] if words[0].startswith("@") else words[0]


def opcode(text):
    """An instruction's opcode without its modifiers or predicate: HMMA for
    "@P0 HMMA.16816.F32 R4, ...", BRA for "@!P1 BRA 0x55d0"."""
    return mnemonic(text).split(".")[0]


def count(instructions, name):
    """How many instructions have the opcode name (HMMA, LDGSTS, BRA)."""
    return sum(1 for _, text in instructions if opcode(text) == name)


def kernel_list(tree, work):
    """Write the kernel list of tree's kernel table into work, as go generate
    does (tree/core/cuda/gen_instances.go); False for a tree whose
    kernels/flashdecode.cu still holds its list itself."""
    gen = os.path.join(tree, "core", "cuda")
    if not os.path.isfile(os.path.join(gen, "gen_instances.go")):
        return False
    done = subprocess.run(["go", "run", "gen_instances.go", os.path.join(work, "_instances.inc")], cwd=gen,
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the kernel list (go run gen_instances.go in {gen}) failed:\n{done.stderr[-4000:]}")
    return True


def build(tree, arch, nvcc, cuobjdump, work):
    """Compile tree/kernels/flashdecode.cu for arch: (resources, sass) as parsed above."""
    cubin = os.path.join(work, "flashdecode.cubin")
    include = os.path.join(os.path.dirname(os.path.dirname(nvcc)), "include")
    listed = [f"-I{work}"] if kernel_list(tree, work) else []
    done = subprocess.run([nvcc, "-cubin", "-O3", "-std=c++17", f"-arch={arch}", f"-I{include}", *listed,
                           "--resource-usage", "-o", cubin, os.path.join(tree, "kernels", "flashdecode.cu")],
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"nvcc failed:\n{done.stderr[-4000:]}")
    # cuobjdump runs nvdisasm for -sass: it looks beside itself and on PATH.
    env = dict(os.environ, PATH=os.path.dirname(cuobjdump) + os.pathsep + os.environ.get("PATH", ""))
    sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, env=env)
    if sass.returncode != 0:
        sys.exit(f"cuobjdump -sass failed (it needs nvdisasm: pip install nvidia-cuda-nvdisasm):\n"
                 f"{sass.stderr[-2000:]}")
    return parse_resources(done.stdout + done.stderr), parse_sass(sass.stdout)


def export_kernels(rev, work):
    """kernels/ and the kernel table (core/, go.mod) at git revision rev,
    written under work; returns work."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "kernels", "core", "go.mod", "go.sum"],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.12, and 3.11.4 on
            tar.extractall(work, filter="data")
        else:
            tar.extractall(work)
    return work


def summary(name, resources, sass):
    regs, spill_st, spill_ld = resources.get(name, (0, 0, 0))
    instructions = sass.get(name, [])
    loop = tile_loop(instructions)
    spill = f", spills {spill_st}/{spill_ld} B" if spill_st or spill_ld else ""
    start = first_copy(instructions)
    start = f", first tile copy {start} after the PDL wait" if start is not None else ""
    if not loop:
        issued, total = loads_in_flight(instructions)
        loads = f", {issued} of {total} wide loads issued before the first use" if total else ""
        return f"{regs} regs{spill}, {len(instructions)} instructions, no mma loop{start}{loads}"
    paths, pruned = loop_paths(instructions, loop)
    if not paths:  # an inner loop: loop_paths counts no pass
        passes = "uncounted"
    elif len(paths) <= 4 and not pruned:
        passes = "/".join(map(str, paths))
    else:
        passes = f"{paths[0]}-{paths[-1]}"
    return (f"{regs} regs{spill}, loop {len(loop)} instructions ({passes} a pass): "
            f"{count(loop, 'HMMA')} HMMA, {count(loop, 'LDGSTS')} LDGSTS, {count(loop, 'BRA')} BRA{start}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="sm_90", help="the GPU architecture to compile for (default sm_90)")
    p.add_argument("--kernels", default=r"^fd_split_kv_(\w+_)?f16_", help="regex of the kernels to show")
    p.add_argument("--against", metavar="REV", help="also build kernels/ at this git revision and compare")
    p.add_argument("--loop", metavar="KERNEL", help="print this kernel's tile loop")
    args = p.parse_args()

    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc, cuobjdump = find_tool("nvcc", cuda_home), find_tool("cuobjdump", cuda_home)
    if not nvcc or not cuobjdump:
        sys.exit("needs nvcc (CUDA_HOME, PATH or bash .ci/run's wheels) and cuobjdump "
                 "(pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    with tempfile.TemporaryDirectory() as work:
        os.makedirs(os.path.join(work, "new"))
        new = build(ROOT, args.arch, nvcc, cuobjdump, os.path.join(work, "new"))
        old = None
        if args.against:
            os.makedirs(os.path.join(work, "old"))
            old = build(export_kernels(args.against, os.path.join(work, "old")), args.arch, nvcc, cuobjdump,
                        os.path.join(work, "old"))
    names = sorted(n for n in new[1] if re.search(args.kernels, n))
    for name in names:
        line = f"{name}: {summary(name, *new)}"
        if old:
            same = [t for _, t in old[1].get(name, [])] == [t for _, t in new[1][name]]
            line += f"\n    at {args.against}: {summary(name, *old)}; SASS {'same' if same else 'differs'}"
        print(line)
    if args.loop:
        for addr, text in tile_loop(new[1].get(args.loop, [])):
            print(f"{addr:06x}  {text}")


if __name__ == "__main__":
    main()
