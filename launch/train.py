"""Capstone: train a tiny Llama (or Mixtral) with DDP, FSDP2, FSDP2 x TP, pipeline, context or expert parallelism; DCP.

Run (one machine):   NPROC=4 bash launch/local.sh launch/train.py --parallel 2d --tp 2
 or by hand:         torchrun --standalone --nproc-per-node 4 launch/train.py --parallel 2d --tp 2
Pipeline x FSDP2:    NPROC=4 bash launch/local.sh launch/train.py --parallel fsdp --pp 2
3-D (8 ranks):       NPROC=8 bash launch/local.sh launch/train.py --parallel 2d --pp 2 --tp 2
Context x FSDP2:     NPROC=4 bash launch/local.sh launch/train.py --parallel fsdp --cp 2 --seq 32
Experts x FSDP2:     NPROC=4 bash launch/local.sh launch/train.py --parallel fsdp --moe-experts 4 --ep 2
One process, the reference every distributed run must equal:
                     python launch/train.py
Other launchers (several nodes, SLURM, Kubernetes): launch/README.md.

Everything here is plain PyTorch from the lessons: `init_device_mesh` with ("dp", "tp"),
or ("pp", "dp", "tp") with --pp > 1 (lesson 06), `parallelize_module` with the model's own
tensor-parallel plan, `fully_shard` on mesh["dp"] (lesson 05), `DistributedDataParallel`
(lesson 02), `PipelineStage` and `Schedule1F1B` on mesh["pp"] (lesson 08), and
`torch.distributed.checkpoint` with a `Stateful` app state (lesson 07). With --cp > 1, a ("dp", "cp", "tp")
mesh: each cp rank holds a contiguous slice of the sequence, attention crosses the slices by ring attention
written by hand (ring_attention.py: `batch_isend_irecv` round mesh["cp"], registered with transformers), and
`fully_shard` runs on the flattened dp x cp mesh (torch's own `context_parallel` fails on CPU in torch 2.13 and 2.15).
With --moe-experts E the model is a tiny Mixtral (moe.py); with --ep N > 1 a ("dp_mod_ep", "ep") mesh: every
rank is a dp rank, each holds E/N experts and trades tokens with `all_to_all_single` on mesh["ep"] (written by
hand in moe.py), the experts are FSDP2-sharded over "dp_mod_ep", the rest over all ranks; the experts'
gradients are divided by N, so their average, like every other parameter's, runs over all ranks' losses.
`course_lib` only picks the backend and prints on rank 0.

The global batch is the same on every layout: dp rank r trains on rows
[r*B/dp, (r+1)*B/dp) of step s's batch, tp ranks of one dp group on the same rows;
with pipeline stages each dp replica's rows are cut into equal microbatches, with cp each
cp rank takes its slice of the sequence of those rows. The loss is a mean over equally sized shards
(and microbatches), or with cp a sum over each slice divided by the global number of targets,
so each step's loss (and the final one) equals one process's to float rounding, whatever the layout.
A pipeline stage keeps the full model's parameter names, so a checkpoint saved under
one layout loads under another.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import re
import shutil
import signal
import sys
import time
import warnings

# Run from a checkout without installing course_lib (`python launch/train.py`).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # train_flags.py, moe.py, ring_attention.py
from train_flags import (LLAMA_CONFIG, check, fail, folder_problem, layout_problem,  # noqa: E402, F401
                         parse_args, size_problem)

if __name__ == "__main__" and any(arg.startswith("--check-only") for arg in sys.argv[1:]):
    parse_args()  # a launcher's question before any rank starts: answered (and exited) before torch is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import course_lib as cl  # noqa: E402
import moe  # noqa: E402
import ring_attention  # noqa: E402
from course_lib.models import make_llama, make_tokens  # noqa: E402

# One process saves and loads DCP checkpoints without a group (torch warns that it assumes so, on every call).
warnings.filterwarnings("ignore", message=r"torch\.distributed is .*single process")
COMPLETE = "COMPLETE"  # written by rank 0 after dcp.save returned on every rank: this checkpoint is whole


def main(argv: list[str] | None = None) -> float:
    """`python launch/train.py` or a rank under torchrun; one process checks the sizes and --ckpt-dir first
    (its layout flags are ignored), as parse_args does for a rank under torchrun."""
    args = parse_args(argv)
    if "RANK" not in os.environ and (problem := size_problem(args) or folder_problem(args)):
        fail(problem)
    return train(args)


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


def expert_parallel_fsdp(model: torch.nn.Module, args: argparse.Namespace, info: cl.DistInfo):
    """EP x FSDP2 on a ("dp_mod_ep", "ep") mesh; returns (model, dp size, dp rank).

    torchtitan's layout: every rank is a data-parallel rank (its own rows, its own routing), and EP is folded
    out of those dp ranks. The ep ranks of one row of the mesh each hold E/ep of the experts and trade tokens
    with all-to-all on mesh["ep"]; the ranks holding the same experts (one column, "dp_mod_ep") shard them
    with FSDP2 (along dim 1: dim 0, the expert index, is EP's). Everything else (attention, norms, router,
    embeddings, head) is FSDP2-sharded over all the ranks, the flattened "dp" mesh.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh(info.device.type, (info.world_size // args.ep, args.ep),
                            mesh_dim_names=("dp_mod_ep", "ep"))
    moe.expert_parallel(model, mesh["ep"])
    dp = mesh["dp_mod_ep", "ep"]._flatten("dp")  # private in torch 2.13-2.15, as for --cp
    for layer in model.model.layers:
        fully_shard(layer.mlp.experts, mesh=mesh["dp_mod_ep"], shard_placement_fn=lambda param: Shard(1))
        fully_shard(layer, mesh=dp)  # the layer's other parameters; the experts are already their own unit
    fully_shard(model, mesh=dp)
    return model, dp.size(), dp.get_local_rank()


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


# ---------------------------------------------------------------- pipeline stages

class LlamaStage(torch.nn.Module):
    """Stage `index` of `stages`: a run of consecutive decoder layers of a LlamaForCausalLM.

    The first stage also embeds the tokens, the last applies the final norm and the head.
    The attributes mirror LlamaForCausalLM's (`model.embed_tokens`, `model.layers.<i>`,
    `model.norm`, `lm_head`), and the layers sit in a ModuleDict keyed by their index in the
    whole model, so every parameter keeps the whole model's name: a checkpoint saved under
    one layout (pipeline or not) loads under another.
    """

    def __init__(self, llama, index: int, stages: int):
        super().__init__()
        n = len(llama.model.layers)
        lo, hi = index * n // stages, (index + 1) * n // stages  # as even a split as the layers allow
        self.config, self.model = llama.config, llama.model
        self.causal_lm_loss = llama.loss_function  # LlamaForCausalLM's own loss (transformers' ForCausalLMLoss)
        self.model.layers = torch.nn.ModuleDict({str(i): llama.model.layers[i] for i in range(lo, hi)})
        if index > 0:
            self.model.embed_tokens = None
        self.lm_head = llama.lm_head if index == stages - 1 else None
        if self.lm_head is None:
            self.model.norm = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states, or logits (last stage), out.

        Each stage rebuilds the positions, the causal mask and the rotary embeddings from its input's
        shape, as LlamaModel.forward does (transformers 5; no cache in training).
        """
        from transformers.masking_utils import create_causal_mask

        model = self.model
        if model.embed_tokens is not None:
            h = model.embed_tokens(h)
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, cache=None,
                                  position_ids=position_ids)
        rotary = model.rotary_emb(h, position_ids=position_ids)
        for layer in model.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids)
        return self.lm_head(model.norm(h)) if self.lm_head is not None else h

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss per microbatch: the mean cross-entropy of each next token, as one process's."""
        return self.causal_lm_loss(logits=logits, labels=labels, vocab_size=self.config.vocab_size)


def pipeline(model: torch.nn.Module, args: argparse.Namespace, info: cl.DistInfo):
    """Cut the model into args.pp stages on a ("pp", "dp", "tp") mesh; returns (stage module, stage, schedule, dp rank).

    Ranks are numbered pp-major (torchtitan's order): the pp ranks of one (dp, tp) position form
    a pipeline, and the stage sends its activations to the next with P2P sends on mesh["pp"].
    Within a stage: TP on mesh["tp"] (--parallel 2d), then FSDP2 on mesh["dp"], as without stages.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    tp = args.tp if args.parallel == "2d" else 1
    mesh = init_device_mesh(info.device.type, (args.pp, args.dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    index = mesh["pp"].get_local_rank()
    stage_model = LlamaStage(model, index, args.pp)
    if args.parallel == "2d":
        apply_tp(stage_model, mesh["tp"])
    for layer in stage_model.model.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(stage_model, mesh=mesh["dp"])  # the stage's root: PipelineStage drives its gradient sync
    stage = PipelineStage(stage_model, index, args.pp, info.device, group=mesh["pp"].get_group())
    # 1F1B: the bubble of GPipe, but at most pp microbatches' activations alive at once instead of all of them.
    # loss_fn is each microbatch's mean; the schedule divides the gradients by the microbatches (scale_grads).
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=stage_model.loss)
    return stage_model, stage, schedule, mesh["dp"].get_local_rank()


# ---------------------------------------------------------------- context parallelism

def context_parallel(model: torch.nn.Module, args: argparse.Namespace, info: cl.DistInfo):
    """Sequence slices on mesh["cp"] of a ("dp", "cp", "tp") mesh; returns (model, dp rank, cp rank).

    torchtitan's order without stages. The cp ranks of one dp group train on the same rows, each on its own
    slice of the sequence, so their gradients are parts of one sum: FSDP2 shards (and averages the gradients)
    over dp AND cp, on the flattened "dp_cp" mesh (torchtitan shards over dp x cp too). TP (--parallel 2d) on
    mesh["tp"] first, as without cp. Attention crosses the slices by ring attention on mesh["cp"].
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    tp = args.tp if args.parallel == "2d" else 1
    mesh = init_device_mesh(info.device.type, (args.dp, args.cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    if args.parallel == "2d":
        apply_tp(model, mesh["tp"])
    model.set_attn_implementation(ring_attention.register(mesh["cp"].get_group()))
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")  # private in torch 2.13-2.15; torchtitan shards over dp x cp too
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_cp)
    fully_shard(model, mesh=dp_cp)
    return model, mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()


def context_parallel_loss(model, batch: torch.Tensor, rows: slice, cp_rank: int, args: argparse.Namespace,
                          device: torch.device) -> torch.Tensor:
    """This rank's share of the global mean loss: its slice's summed cross-entropy x (dp x cp) / all targets.

    The labels are shifted on the whole sequence before it is sliced (a slice's last token predicts the next
    slice's first); the last slice has one target fewer than the others, so the mean of the slices' means is
    not one process's mean: a sum over the slice, divided by the global count (known to every rank: each one
    builds the whole batch). FSDP2 divides the gradients by dp x cp, which the factor undoes.
    """
    targets = torch.cat([batch[:, 1:], torch.full_like(batch[:, :1], -100)], dim=1)  # -100: nothing to predict
    count = (targets != -100).sum()
    length = args.seq // args.cp
    cols = slice(cp_rank * length, (cp_rank + 1) * length)
    positions = torch.arange(cols.start, cols.stop, device=device).unsqueeze(0)  # global: the rotary angles
    logits = model(input_ids=batch[rows, cols].to(device), position_ids=positions, use_cache=False).logits
    total = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets[rows, cols].flatten().to(device),
                                              ignore_index=-100, reduction="sum")
    return total * (args.dp * args.cp) / count.to(device)


# ---------------------------------------------------------------- checkpoints

class AppState:
    """What a checkpoint holds: model, optimizer and the step, as DCP's `Stateful` protocol asks.

    `get_state_dict` gives DTensor shards under FSDP2/TP, so every rank writes only
    its own shards, and a load reshards to whatever layout the new run has.
    The optimizer's state is flattened to one key per parameter name (Adam's moments and
    its hyperparameters, `flatten_optimizer_state_dict`): nested, its single param group
    would list one stage's parameters only (DCP keeps one rank's copy of a non-tensor
    value), and a pipeline stage resumed under another layout would miss its hyperparameters.
    `flat` is False only while loading a checkpoint saved nested (by train.py before --pp).
    """

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.step, self.flat = model, optimizer, 0, True

    def options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=self.flat)

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options())
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, state_dict):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"], options=self.options())
        self.step = state_dict["step"]


STEP_DIR = re.compile(r"step_(\d{6})")  # a checkpoint folder; anything else in --ckpt-dir is left alone


def checkpoints(ckpt_dir: pathlib.Path) -> list[pathlib.Path]:
    """The step_NNNNNN folders in --ckpt-dir, oldest first."""
    return sorted(p for p in ckpt_dir.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir())


def incomplete(folder: pathlib.Path) -> str | None:
    """Why `folder` is not a whole checkpoint, or None if it is: COMPLETE (rank 0's marker, written after dcp.save
    returned on every rank) and .metadata (DCP's index of the shards, written last by dcp.save) both there."""
    if not (folder / COMPLETE).exists():
        return "no COMPLETE marker (a save that did not finish)"
    if not (folder / ".metadata").exists():
        return "COMPLETE but no .metadata (DCP's index of the shards)"
    return None


def newest_complete(ckpt_dir: pathlib.Path) -> pathlib.Path | None:
    """The newest step_* folder with its COMPLETE marker and .metadata; a crash mid-save leaves a folder without."""
    done = [p for p in checkpoints(ckpt_dir) if incomplete(p) is None]
    return done[-1] if done else None


def save(app: AppState, args: argparse.Namespace, info: cl.DistInfo, distributed: bool) -> None:
    """dcp.save into a new step_NNNNNN folder, COMPLETE by rank 0, then the older ones beyond --keep removed.

    A folder already at this step (a save that did not finish, or a newest checkpoint that did not load and that
    this run has now trained past) is renamed, not written into or deleted. Rotation removes only complete
    folders older than this step: a newer one (one that failed to load) stays as it is.
    """
    import torch.distributed.checkpoint as dcp

    path = args.ckpt_dir / f"step_{app.step:06d}"
    if info.rank == 0 and path.exists():
        kept = next(path.with_name(f"{path.name}.old{i}") for i in range(1, 10**6)
                    if not path.with_name(f"{path.name}.old{i}").exists())
        path.rename(kept)
        cl.print0(f"{path.name} was there from an earlier run: renamed {kept.name}, nothing deleted")
    if distributed:
        dist.barrier()  # nobody writes into the folder before rank 0 has moved an old one away
    dcp.save({"app": app}, checkpoint_id=path)  # returns on every rank after .metadata is written
    if info.rank == 0:
        (path / COMPLETE).write_text(f"step {app.step}\n")
        older = [p for p in checkpoints(args.ckpt_dir) if p.name < path.name and incomplete(p) is None]
        for old in older[:max(0, len(older) - (args.keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)


def load_failure(error: BaseException) -> str:
    """One line for why a load failed: DCP's CheckpointException holds each rank's exception; the first says it."""
    failures = getattr(error, "failures", None)
    if failures:
        rank, (error, _) = min(failures.items())
        where = f" on rank {rank}"
    else:
        where = ""
    text = " ".join(str(error).split()) or "(no message)"
    if isinstance(error, EOFError):  # torch.load's message is empty when a shard file ends before its data
        text = "a shard file ends before its data (truncated)"
    return f"{type(error).__name__}{where}: {text[:160]}"


def maybe_resume(app: AppState, args: argparse.Namespace, info: cl.DistInfo, distributed: bool) -> None:
    """Load the newest checkpoint that loads; one line for each newer folder skipped, and why. Deletes nothing.

    Rank 0 lists the candidates (COMPLETE and .metadata) and tells the others, so every rank tries the same
    folders in the same order even if a shared filesystem shows a new marker to one node before another. Every
    rank tries each one; all ranks then learn every rank's result (all_gather_object), so a folder counts as
    loaded only if it loaded everywhere, and all ranks move on to the older one together if it did not. A failed
    attempt may have written part of the model in place: the next load overwrites all of it, and if none loads
    the run stops rather than train from half-loaded weights.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    candidates: list = [None]
    if info.rank == 0:
        newest_first = checkpoints(args.ckpt_dir)[::-1]
        candidates[0] = [folder for folder in newest_first if incomplete(folder) is None]
        for folder in newest_first:  # the incomplete ones newer than every complete one, said once each
            if candidates[0] and folder == candidates[0][0]:
                break
            cl.print0(f"skipped {folder.name}: {incomplete(folder)}")
    if distributed:
        dist.broadcast_object_list(candidates, src=0)
    def everyones(error: str | None) -> str | None:
        """The first rank's error, or None if every rank succeeded: all ranks take the same branch after it."""
        errors = [error]
        if distributed:
            errors = [None] * info.world_size
            dist.all_gather_object(errors, error)
        return next((e for e in errors if e), None)

    for folder in candidates[0]:
        error = None
        try:  # the optimizer's format: flattened, or nested (saved by train.py before --pp existed)
            keys = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
            app.flat = "app.optim.param_groups.0.lr" not in keys
        except Exception as e:
            error = f"its .metadata does not read: {load_failure(e)}"
        if not (error := everyones(error)):  # dcp.load is collective: only if every rank read the index
            try:
                dcp.load({"app": app}, checkpoint_id=folder)
            except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
                error = load_failure(e)
            error = everyones(error)
        app.flat = True  # saves from here on are flattened
        if not error:
            cl.print0(f"resumed from {folder.name} (attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}): "
                      f"next step {app.step + 1}")
            return
        cl.print0(f"could not load {folder.name} ({error}): trying the one before it; nothing deleted")
    if candidates[0]:
        if info.rank == 0:
            print(f"train.py: error: no checkpoint in {args.ckpt_dir} loads (each one named above): move them "
                  f"away or give another --ckpt-dir", file=sys.stderr, flush=True)
        raise SystemExit(2)
    app.step = 0
    cl.print0(f"no complete checkpoint in {args.ckpt_dir}: starting at step 1")


# ---------------------------------------------------------------- training

def progress(step: int, steps: int, loss: float, started: float, first: int) -> str:
    """One line per step: where we are, the loss, and time per step."""
    done = step - first + 1
    per_step = (time.perf_counter() - started) / done
    bar = "#" * (20 * step // steps)
    return (f"step {step:>{len(str(steps))}}/{steps} [{bar:<20}] loss {loss:.6f}  "
            f"{per_step * 1e3:.0f} ms/step, ~{per_step * (steps - step):.0f} s left")


def train(args: argparse.Namespace, keep: dict | None = None) -> float:
    """Train; returns the final loss. `keep`, if given, receives the AppState ("app") at the end: the tests
    compare one process's model and optimizer state with a distributed run's checkpoint."""
    distributed = "RANK" in os.environ
    if distributed:
        info = init_distributed(args.timeout)
    else:
        print("one process (not under torchrun): the reference a distributed run must equal", flush=True)
        info = cl.DistInfo(0, 1, 0, "none", torch.device("cpu"))
    if args.moe_experts:
        model = moe.make_mixtral(args.moe_experts, args.seed, **LLAMA_CONFIG).to(info.device)
    else:
        model = make_llama(args.seed).to(info.device)  # same weights on every rank: seeded
    piped = distributed and args.pp > 1
    sliced = distributed and args.cp > 1
    experts = distributed and args.ep > 1
    if piped:
        model, stage, schedule, dp_rank = pipeline(model, args, info)  # model: this rank's stage
        dp_size = args.dp
    elif sliced:
        model, dp_rank, cp_rank = context_parallel(model, args, info)
        dp_size = args.dp
    elif experts:
        model, dp_size, dp_rank = expert_parallel_fsdp(model, args, info)
    elif distributed:
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
        maybe_resume(app, args, info, distributed)  # one process too: a checkpoint loads on any layout

    layout = {"ddp": "DDP", "fsdp": "FSDP2", "2d": f"FSDP2 x TP (dp={dp_size}, tp={args.tp})"}[args.parallel]
    if piped:
        layout = {"fsdp": f"PP x FSDP2 (pp={args.pp}, dp={dp_size})",
                  "2d": f"PP x FSDP2 x TP (pp={args.pp}, dp={dp_size}, tp={args.tp})"}[args.parallel]
    if sliced:
        layout = {"fsdp": f"CP x FSDP2 (dp={dp_size}, cp={args.cp})",
                  "2d": f"CP x FSDP2 x TP (dp={dp_size}, cp={args.cp}, tp={args.tp})"}[args.parallel]
    if experts:
        layout = f"EP x FSDP2 (ep={args.ep}, experts FSDP2 over {dp_size // args.ep}, the rest over {dp_size})"
    if distributed:
        ranks = f"{info.world_size} rank{'s' if info.world_size > 1 else ''}"
        split = f"; Schedule1F1B, {args.microbatches} microbatches of {rows // args.microbatches}" if piped else ""
        if sliced:
            split = f"; sequence {args.seq} = {args.cp} x {args.seq // args.cp} tokens, ring attention"
        if args.moe_experts:
            split = (f"; {args.moe_experts} experts per layer, top-{moe.TOP_K}"
                     + (f", {args.moe_experts // args.ep} per ep rank, all-to-all" if experts else ""))
        cl.print0(f"{layout} on {ranks}; global batch {args.batch} = {dp_size} x {rows} rows{split}")
    loss_value = float("nan")
    first, started = app.step + 1, time.perf_counter()
    for step in range(first, args.steps + 1):
        if args.crash_at_step == step and distributed and info.rank == info.world_size - 1 \
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            print(f"rank {info.rank}: --crash-at-step {step}: SIGKILL to myself", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        tokens = batch_for(step, args)[dp_rank * rows:(dp_rank + 1) * rows].to(info.device)
        if piped:
            optimizer.zero_grad(set_to_none=True)
            loss = pipeline_step(stage, schedule, tokens)
        elif sliced:
            loss = context_parallel_loss(model, batch_for(step, args), slice(dp_rank * rows, (dp_rank + 1) * rows),
                                         cp_rank, args, info.device)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # FSDP2 averages over dp x cp: the global mean's gradient
        else:
            loss = model(input_ids=tokens, labels=tokens).loss  # mean over this rank's tokens
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP/FSDP average the gradients over dp: the global mean's gradient
        optimizer.step()
        app.step = step
        # The global loss is the mean of the dp ranks' means (equal shards); tp ranks already agree.
        # With cp, each rank's loss is its share x (dp x cp): the same mean over the world.
        reported = loss.detach().clone()
        if distributed:
            dist.all_reduce(reported, op=dist.ReduceOp.SUM)
            # every rank contributed: dp groups x identical tp copies (with stages: the last stage's ranks only)
            reported /= info.world_size // args.pp if piped else info.world_size
        loss_value = reported.item()
        cl.print0(progress(step, args.steps, loss_value, started, first))
        if args.ckpt_dir is not None and (step % args.ckpt_every == 0 or step == args.steps):
            save(app, args, info, distributed)
    if args.steps < first:
        cl.print0(f"nothing to do: the checkpoint is at step {app.step} of {args.steps}")
    else:
        cl.print0(f"final loss {loss_value!r}")
    if keep is not None:
        keep["app"] = app
    if distributed:
        dist.destroy_process_group()
    return loss_value


def pipeline_step(stage, schedule, tokens: torch.Tensor) -> torch.Tensor:
    """One step of the pipeline (forwards and backwards of every microbatch); returns this rank's loss.

    The first stage feeds the tokens, the last gets them as labels and one loss per microbatch;
    the loss is their mean (equal microbatches: this replica's mean), 0 on the other stages.
    """
    losses: list[torch.Tensor] = []
    inputs = (tokens,) if stage.is_first else ()
    labels = tokens if stage.is_last else None  # the loss shifts them by one token, as one process's does
    schedule.step(*inputs, target=labels, losses=losses if stage.is_last else None, return_outputs=False)
    if not stage.is_last:
        return torch.zeros((), device=tokens.device)
    return torch.stack(losses).mean()


if __name__ == "__main__":
    main()
