"""Capstone: train a tiny Llama with DDP, FSDP2 or FSDP2 x TP, checkpoint with DCP, resume after a crash.

Run (one machine):   NPROC=4 bash launch/local.sh launch/train.py --parallel 2d --tp 2
 or by hand:         torchrun --standalone --nproc-per-node 4 launch/train.py --parallel 2d --tp 2
One process, the reference every distributed run must equal:
                     python launch/train.py
Other launchers (several nodes, SLURM, Kubernetes): launch/README.md.

Everything here is plain PyTorch from the lessons: `init_device_mesh` with ("dp", "tp")
(lesson 06), `parallelize_module` with the model's own tensor-parallel plan, `fully_shard`
on mesh["dp"] (lesson 05), `DistributedDataParallel` (lesson 02), and
`torch.distributed.checkpoint` with a `Stateful` app state (lesson 07).
`course_lib` only picks the backend and prints on rank 0.

The global batch is the same on every layout: dp rank r trains on rows
[r*B/dp, (r+1)*B/dp) of step s's batch, tp ranks of one dp group on the same rows.
The loss is a mean over equally sized shards, so each step's loss (and the
final one) equals one process's to float rounding, whatever the layout.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import shutil
import signal
import sys
import time

import torch
import torch.distributed as dist

# Run from a checkout without installing course_lib (`python launch/train.py`).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import course_lib as cl  # noqa: E402
from course_lib.models import LLAMA_CONFIG, make_llama, make_tokens  # noqa: E402

COMPLETE = "COMPLETE"  # written by rank 0 after dcp.save returned on every rank: this checkpoint is whole


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parallel", choices=("ddp", "fsdp", "2d"), default="2d",
                   help="ddp: replicate; fsdp: FSDP2 over all ranks; 2d: FSDP2 over dp x TP over tp (default)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size for --parallel 2d (divides the world size)")
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
    return p.parse_args(argv)


def batch_for(step: int, args: argparse.Namespace) -> torch.Tensor:
    """Step `step`'s global batch (batch, seq): the same in every process, on every attempt.

    Counting sequences (t, t+1, t+2, ... mod vocab) from random starts: a pattern the
    model can learn, so the loss falls within a few steps (random tokens would keep
    it near ln(vocab) = 4.85).
    """
    starts = make_tokens(args.batch, 1, seed=1000 + step)
    return (starts + torch.arange(args.seq)) % LLAMA_CONFIG["vocab_size"]


# ---------------------------------------------------------------- process group

def init_distributed(timeout_s: float) -> cl.DistInfo:
    """The default group, with a store prefix per torchrun attempt, then `cl.init()` for the device and header.

    NOTE: on gloo, a group that torchrun restarted (`--max-restarts`) after a crash failed
    ("Gloo connectFullMesh failed ... Connection refused") or hung in 3 of 7 measured runs
    on torch 2.13 as shipped. The new attempt's workers use the same agent store as the
    dead ones, so (the likely cause) they can find the old attempt's keys there.
    A `PrefixStore` per attempt (TORCHELASTIC_RESTART_COUNT) keeps each attempt's keys apart;
    with it tests/test_launch_restart.py passed 10 runs out of 10. The count is each agent's own:
    with several nodes, an agent restarted only because another node failed keeps its count
    (a membership change, not a retry), so there the prefixes can differ: untested across nodes.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"attempt_{attempt}", store)
    device = cl.device()  # cuda:LOCAL_RANK with a GPU per rank, else cpu
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(cl.backend(), store=store, rank=rank, world_size=world_size, timeout=timeout)
    return cl.init(timeout_s=timeout_s)  # the group exists: this prints the backend line on rank 0


# ---------------------------------------------------------------- parallelism

def parallelize(model: torch.nn.Module, args: argparse.Namespace, info: cl.DistInfo):
    """Apply the chosen layout; returns (model, dp_size, dp_rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    world = info.world_size
    if args.parallel == "ddp":
        # device_ids only for a GPU: DDP on CPU takes none.
        ids = [info.device.index] if info.device.type == "cuda" else None
        return DDP(model, device_ids=ids), world, info.rank
    if args.parallel == "fsdp":
        mesh = init_device_mesh(info.device.type, (world,), mesh_dim_names=("dp",))
        dp_mesh = mesh["dp"]
    else:
        if world % args.tp:
            raise SystemExit(f"--tp {args.tp} does not divide the world size {world}")
        mesh = init_device_mesh(info.device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        apply_tp(model, mesh["tp"])
        dp_mesh = mesh["dp"]
    # FSDP2 after TP (torchtitan's order): each decoder layer is one all-gather unit, the root takes the rest.
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model, dp_mesh.size(), dp_mesh.get_local_rank()


def apply_tp(model: torch.nn.Module, tp_mesh) -> None:
    """Megatron-style TP from the model's own plan (`config.base_model_tp_plan`).

    q/k/v and gate/up are split by output features (ColwiseParallel, no communication),
    o_proj and down_proj by input features (RowwiseParallel: one all_reduce each in forward).
    Each tp rank then holds heads/tp attention heads, so the head counts must divide by tp.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cfg = model.config
    tp = tp_mesh.size()
    if cfg.num_attention_heads % tp or cfg.num_key_value_heads % tp:
        raise SystemExit(f"--tp {tp} must divide the heads ({cfg.num_attention_heads}) and KV heads "
                         f"({cfg.num_key_value_heads})")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[style]() for name, style in cfg.base_model_tp_plan.items()}
    parallelize_module(model.model, tp_mesh, plan)


# ---------------------------------------------------------------- checkpoints

class AppState:
    """What a checkpoint holds: model, optimizer and the step, as DCP's `Stateful` protocol asks.

    `get_state_dict` gives DTensor shards under FSDP2/TP, so every rank writes only
    its own shards, and a load reshards to whatever layout the new run has.
    """

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.step = model, optimizer, 0

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, state_dict):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])
        self.step = state_dict["step"]


def newest_complete(ckpt_dir: pathlib.Path) -> pathlib.Path | None:
    """The newest step_* folder with its COMPLETE marker; a crash mid-save leaves a folder without one."""
    done = sorted(p for p in ckpt_dir.glob("step_*") if (p / COMPLETE).exists())
    return done[-1] if done else None


def save(app: AppState, args: argparse.Namespace, info: cl.DistInfo) -> None:
    import torch.distributed.checkpoint as dcp

    path = args.ckpt_dir / f"step_{app.step:06d}"
    dcp.save({"app": app}, checkpoint_id=path)  # returns on every rank after .metadata is written
    if info.rank == 0:
        (path / COMPLETE).write_text(f"step {app.step}\n")
        for old in sorted(p for p in args.ckpt_dir.glob("step_*") if (p / COMPLETE).exists())[:-args.keep]:
            shutil.rmtree(old, ignore_errors=True)


def maybe_resume(app: AppState, args: argparse.Namespace, info: cl.DistInfo) -> None:
    import torch.distributed.checkpoint as dcp

    # Rank 0 chooses and tells the others, so every rank loads the same step even if
    # a shared filesystem shows a new marker to one node a moment before another.
    found = [newest_complete(args.ckpt_dir) if info.rank == 0 else None]
    dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        cl.print0(f"no complete checkpoint in {args.ckpt_dir}: starting at step 1")
        return
    dcp.load({"app": app}, checkpoint_id=found[0])
    cl.print0(f"resumed from {found[0].name} (attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}): "
              f"next step {app.step + 1}")


# ---------------------------------------------------------------- training

def progress(step: int, steps: int, loss: float, started: float, first: int) -> str:
    """One line per step: where we are, the loss, and time per step."""
    done = step - first + 1
    per_step = (time.perf_counter() - started) / done
    bar = "#" * (20 * step // steps)
    return (f"step {step:>{len(str(steps))}}/{steps} [{bar:<20}] loss {loss:.6f}  "
            f"{per_step * 1e3:.0f} ms/step, ~{per_step * (steps - step):.0f} s left")


def train(args: argparse.Namespace) -> float:
    distributed = "RANK" in os.environ
    if distributed:
        info = init_distributed(args.timeout)
    else:
        print("one process (not under torchrun): the reference a distributed run must equal", flush=True)
        info = cl.DistInfo(0, 1, 0, "none", torch.device("cpu"))
    model = make_llama(args.seed).to(info.device)  # same weights on every rank: seeded
    if distributed:
        model, dp_size, dp_rank = parallelize(model, args, info)
    else:
        dp_size, dp_rank = 1, 0
    if args.batch % dp_size:
        raise SystemExit(f"--batch {args.batch} does not divide among {dp_size} dp ranks")
    rows = args.batch // dp_size
    # foreach=False: one update path whatever the layout, so losses match one process closely.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    app = AppState(model, optimizer)
    if args.ckpt_dir is not None:
        if info.rank == 0:
            args.ckpt_dir.mkdir(parents=True, exist_ok=True)
        if distributed:
            maybe_resume(app, args, info)

    layout = {"ddp": "DDP", "fsdp": "FSDP2", "2d": f"FSDP2 x TP (dp={dp_size}, tp={args.tp})"}[args.parallel]
    if distributed:
        ranks = f"{info.world_size} rank{'s' if info.world_size > 1 else ''}"
        cl.print0(f"{layout} on {ranks}; global batch {args.batch} = {dp_size} x {rows} rows")
    loss_value = float("nan")
    first, started = app.step + 1, time.perf_counter()
    for step in range(first, args.steps + 1):
        if args.crash_at_step == step and distributed and info.rank == info.world_size - 1 \
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            print(f"rank {info.rank}: --crash-at-step {step}: SIGKILL to myself", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        tokens = batch_for(step, args)[dp_rank * rows:(dp_rank + 1) * rows].to(info.device)
        loss = model(input_ids=tokens, labels=tokens).loss  # mean over this rank's tokens
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP/FSDP average the gradients over dp: the global mean's gradient
        optimizer.step()
        app.step = step
        # The global loss is the mean of the dp ranks' means (equal shards); tp ranks already agree.
        reported = loss.detach().clone()
        if distributed:
            dist.all_reduce(reported, op=dist.ReduceOp.SUM)
            reported /= info.world_size  # every rank contributed: dp groups x identical tp copies
        loss_value = reported.item()
        cl.print0(progress(step, args.steps, loss_value, started, first))
        if args.ckpt_dir is not None and distributed and (step % args.ckpt_every == 0 or step == args.steps):
            save(app, args, info)
    if args.steps < first:
        cl.print0(f"nothing to do: the checkpoint is at step {app.step} of {args.steps}")
    else:
        cl.print0(f"final loss {loss_value!r}")
    if distributed:
        dist.destroy_process_group()
    return loss_value


if __name__ == "__main__":
    train(parse_args())
