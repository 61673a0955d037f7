"""launch/train.py's flags and every check that needs no rank: parsed and judged without importing torch, so that
the launchers' `--check-only` question (local.sh, multinode.sh, slurm.sbatch ask it before torchrun starts a rank)
answers in a fraction of a second. train.py imports everything from here."""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import socket
import sys

from course_lib.llama_config import LLAMA_CONFIG

DESCRIPTION = "Train a tiny Llama (or a tiny Mixtral) on one machine or many: DDP, FSDP2, TP, PP, CP and EP by hand."
TOP_K = 2  # Mixtral's num_experts_per_tok in launch/moe.py: each token goes to two experts


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a mistyped or missing flag is one line (not the usage block), printed once under torchrun."""

    def error(self, message: str):
        fail(f"{message} (python launch/train.py --help lists the flags)")


def fail(problem: str):
    """Print `train.py: error: PROBLEM` once and exit 2: under torchrun only local rank 0 prints it.

    The other ranks leave quietly with 0: had one exited 2 first, torchrun would SIGTERM local rank 0, maybe
    before its line. The job still fails (torchrun: exit 1, its report's root cause local rank 0's exit 2).
    """
    if os.environ.get("LOCAL_RANK", "0") != "0":
        raise SystemExit(0)
    print(f"train.py: error: {problem}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=DESCRIPTION)
    p.add_argument("--parallel", choices=("ddp", "fsdp", "2d"), default="2d",
                   help="ddp: replicate; fsdp: FSDP2 over all ranks; 2d: FSDP2 over dp x TP over tp (default)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size for --parallel 2d (divides the world size)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages, the decoder layers split among them (with --parallel fsdp or 2d)")
    p.add_argument("--cp", type=int, default=1,
                   help="context parallelism: the sequence cut into this many slices, ring attention across them "
                        "(with --parallel fsdp or 2d, without --pp); divides --seq")
    p.add_argument("--moe-experts", type=int, default=0,
                   help="a mixture of experts: a tiny Mixtral with this many experts per layer, top-2 "
                        "(default 0: the dense tiny Llama); with --parallel ddp or fsdp")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallelism: each rank holds --moe-experts / EP experts, tokens exchanged by "
                        "all-to-all (with --parallel fsdp, without --pp or --cp); divides the world size")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel size (default: the world size / (pp x cp x tp)); pp x dp x cp x tp = world size")
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step and dp replica with --pp > 1 (default: pp); divides batch / dp")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="global batch (rows), divided among the dp ranks")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0, help="model weights; step s's tokens use seed 1000 + s")
    p.add_argument("--ckpt-dir", type=pathlib.Path, default=None,
                   help="DCP checkpoints go to CKPT_DIR/step_NNNNNN; a run resumes from the newest complete one")
    p.add_argument("--ckpt-every", type=int, default=2, help="save every N steps (and after the last)")
    p.add_argument("--keep", type=int, default=2, help="complete checkpoints to keep")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a collective may wait before failing (torch's default is 30 min for gloo)")
    p.add_argument("--crash-at-step", type=int, default=None,
                   help="rehearse a crash: on the first attempt the last rank SIGKILLs itself before this step")
    p.add_argument("--check-only", type=world_sizes, default=None, metavar="WORLD[,WORLD...]",
                   help="check the flags for these world sizes and that --ckpt-dir is writable, then exit: "
                        "0 if fine, else 2 after one line (the launchers run this before torchrun starts a rank)")
    args = p.parse_args(argv)
    if args.check_only is not None:  # a launcher asks, before it starts any rank
        for world in args.check_only:
            if problem := check(copy.copy(args), world):
                fail(problem)
        raise SystemExit(0)
    if "RANK" in os.environ:  # under torchrun by hand: the world size is known before any rank starts work
        if problem := check(args, int(os.environ["WORLD_SIZE"])):
            fail(problem)  # one line from the first rank of each node, which exits 2 before the group forms
    return args


def world_sizes(text: str) -> list[int]:
    """`--check-only 4` or `--check-only 2,4` (an elastic job: every world size it may run on)."""
    sizes = [int(part) for part in text.split(",")]
    if not sizes or min(sizes) < 1:
        raise ValueError(text)
    return sizes


def check(args: argparse.Namespace, world: int) -> str | None:
    """Everything that can be found wrong before a rank starts: the flags on `world` ranks, then --ckpt-dir."""
    return layout_problem(args, world) or folder_problem(args)


def size_problem(args: argparse.Namespace) -> str | None:
    """A size or count below 1 (a division by it later, or a run that does nothing), in one line; None if none."""
    for name in ("tp", "pp", "cp", "ep", "dp", "microbatches", "ckpt_every", "keep", "steps", "seq", "batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} {value}: must be at least 1"
    return None


def folder_problem(args: argparse.Namespace) -> str | None:
    """Can this process write into --ckpt-dir? Creates it (parents too), then writes and deletes a probe file.

    Found in the first second, not at the first save after minutes of training. The probe's name is this
    process's own (host and PID), so ranks probing the same folder at once never touch each other's file;
    nothing else in the folder is read or changed.
    """
    if args.ckpt_dir is None:
        return None
    probe = args.ckpt_dir / f".write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return f"--ckpt-dir {args.ckpt_dir}: cannot write there ({e.strerror or e}): checkpoints could not be saved"
    return None


def layout_problem(args: argparse.Namespace, world: int) -> str | None:
    """What is wrong with the flags on `world` ranks, in one line; None if nothing. Fills args.dp and args.microbatches."""
    if problem := size_problem(args) or moe_problem(args, world):
        return problem
    if args.pp > 1 and args.parallel == "ddp":
        return f"--pp {args.pp} needs --parallel fsdp or 2d (pipeline stages are sharded with FSDP2 here, not DDP)"
    if args.cp > 1 and args.parallel == "ddp":
        return (f"--cp {args.cp} needs --parallel fsdp or 2d (FSDP2 averages the slices' gradients over dp x cp "
                f"here, not DDP)")
    if args.cp > 1 and args.pp > 1:
        return f"--cp {args.cp} with --pp {args.pp}: not supported here (context parallelism runs without stages)"
    if args.seq % args.cp:
        return f"--seq {args.seq} does not divide into {args.cp} equal slices (--cp {args.cp})"
    if args.microbatches is not None and args.pp == 1:
        return f"--microbatches {args.microbatches} needs --pp > 1 (microbatches are the pipeline's)"
    layers = LLAMA_CONFIG["num_hidden_layers"]
    if args.pp > layers:
        return f"--pp {args.pp}: more stages than the model's {layers} decoder layers (each stage holds at least one)"
    tp = args.tp if args.parallel == "2d" else 1
    if tp > 1 and (LLAMA_CONFIG["num_attention_heads"] % tp or LLAMA_CONFIG["num_key_value_heads"] % tp):
        return (f"--tp {tp} must divide the heads ({LLAMA_CONFIG['num_attention_heads']}) and KV heads "
                f"({LLAMA_CONFIG['num_key_value_heads']})")
    if args.dp is not None:
        if args.pp * args.dp * args.cp * tp != world:
            sizes = f"--pp {args.pp} x --dp {args.dp}" + (f" x --cp {args.cp}" if args.cp > 1 else "")
            return f"{sizes} x tp {tp} = {args.pp * args.dp * args.cp * tp} ranks, not the world size {world}"
    elif world % (args.pp * args.cp * tp):
        if args.cp > 1:
            return f"--cp {args.cp} x tp {tp} = {args.cp * tp} does not divide the world size {world}"
        if args.pp == 1:
            return f"--tp {tp} does not divide the world size {world}"
        return f"--pp {args.pp} x tp {tp} = {args.pp * tp} does not divide the world size {world}"
    args.dp = args.dp or world // (args.pp * args.cp * tp)
    if args.pp == 1:
        if args.batch % args.dp:
            return f"--batch {args.batch} does not divide among {args.dp} dp ranks"
        return None
    args.microbatches = args.microbatches or args.pp
    if args.microbatches < args.pp:  # torch's Schedule1F1B refuses fewer (a ValueError on every rank)
        return f"--microbatches {args.microbatches}: Schedule1F1B needs at least one per stage ({args.pp})"
    if args.batch % (args.dp * args.microbatches):
        return (f"--batch {args.batch} does not divide into dp {args.dp} x {args.microbatches} microbatches "
                f"(set --batch or --microbatches)")
    return None


def moe_problem(args: argparse.Namespace, world: int) -> str | None:
    """What is wrong with --moe-experts / --ep, in one line; None if nothing."""
    experts, ep = args.moe_experts, args.ep
    if experts and experts < TOP_K:
        return f"--moe-experts {experts}: at least {TOP_K} (each token goes to its top {TOP_K} experts)"
    if experts and args.parallel == "2d":
        return (f"--moe-experts {experts} needs --parallel fsdp or ddp (the tensor-parallel plan here does not "
                f"split experts)")
    if experts and (args.pp > 1 or args.cp > 1):
        return f"--moe-experts {experts} with --pp or --cp: not supported here (experts run without stages or slices)"
    if ep == 1:
        return None
    if not experts:
        return f"--ep {ep} needs --moe-experts (the dense Llama has no experts to spread)"
    if args.parallel != "fsdp":
        return f"--ep {ep} needs --parallel fsdp (the non-expert parameters are sharded with FSDP2 here)"
    if experts % ep:
        return f"--moe-experts {experts} does not divide among --ep {ep} ranks (each holds the same number of experts)"
    if world % ep:
        return f"--ep {ep} does not divide the world size {world}"
    return None
