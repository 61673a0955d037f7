"""The rank side of lesson 07: distributed checkpointing (DCP): how each exercise calls the learner's function.

Runs on the ranks, in the learner's process (see course_lib/grading/drivers.py for the rules every driver
follows: copy the inputs, return plain data). Every run's ranks share one working directory (the run's
`work` folder), so a checkpoint folder named here is the same folder on every rank; except 07.reshard_load's,
where each rank works in a folder of its own, as on a node's local disk.

The training run is lesson 07's (notebooks/07_checkpointing.ipynb, section 1): lessons 04-05's model,
Adam, 16 rows walked in the order a `DistributedSampler` shuffles each epoch, noise from the global RNG.
`train` also runs in the checker's process, without torch.distributed: one process's reference.
"""

from __future__ import annotations

import os
import types
from typing import Callable

import torch

__all__ = ["dcp_app_state", "dcp_crash_safe_save", "dcp_reshard_load", "full_state", "new_app_run", "new_run",
           "one_process_app", "train", "train_app"]

ROWS = 16  # an epoch: 2 steps of 8 rows (each rank its share)
BATCH = 8
LR = 0.01
FRESH_LR = 0.02  # a resumed run's Adam starts with another lr: only set_state_dict puts the saved param_groups back
DECAY_EVERY, DECAY = 2, 0.5  # the run's StepLR: lr halves every 2 steps
DROPOUT, EMA_DECAY = 0.25, 0.9  # 07.app_state's input dropout and its EMA's decay


def _sharded_model(mesh):
    """The lesson's model, FSDP2 bottom-up over `mesh` (each Block, then the root), or plain when `mesh` is None."""
    from ....models import make_model

    model = make_model()
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for block in (model[1], model[2]):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _dist():
    import torch.distributed as dist

    return dist if dist.is_initialized() else None


def _mesh(shape: tuple, names: tuple | None = None):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)  # the checker's ranks run gloo


def new_run(mesh=None, seed: int = 1234, lr: float = LR) -> types.SimpleNamespace:
    """A fresh run: `model` (FSDP2 bottom-up over `mesh`, if given), `optimizer` (Adam at `lr`), `scheduler`
    (StepLR), `sampler`, `step` 0; the global RNG seeded with `seed` on every rank."""
    from torch.utils.data import DistributedSampler

    model = _sharded_model(mesh)
    dist = _dist()
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist and mesh is not None else (1, 0)
    sampler = DistributedSampler(range(ROWS), num_replicas=world, rank=rank, shuffle=True, seed=0)
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=DECAY_EVERY, gamma=DECAY)
    return types.SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler, step=0)


def train(run, until: int) -> list[float]:
    """Steps run.step .. until-1 (the sampler's epoch set when an epoch starts); each step's loss over the
    whole batch of 8 rows (the ranks' mean)."""
    from ....models import make_batch

    inputs_all, targets_all = make_batch(ROWS)
    dist = _dist()
    losses = []
    while run.step < until:
        epoch, position = divmod(run.step, ROWS // BATCH)
        if position == 0:
            run.sampler.set_epoch(epoch)
        share = BATCH // run.sampler.num_replicas
        rows = list(run.sampler)[position * share:(position + 1) * share]
        noise = 0.01 * torch.randn(ROWS, inputs_all.shape[1])
        run.optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(run.model((inputs_all + noise)[rows]), targets_all[rows])
        loss.backward()
        run.optimizer.step()
        run.scheduler.step()
        loss = loss.detach()
        if dist is not None and run.sampler.num_replicas > 1:
            dist.all_reduce(loss)
            loss /= run.sampler.num_replicas
        losses.append(loss.item())
        run.step += 1
    return losses


def full_state(model, optimizer) -> dict:
    """{"model": {name: whole tensor}, "exp_avg": {...}, "exp_avg_sq": {...}}: what one process compares with
    (empty moments where the optimizer holds no state for a parameter)."""
    from torch.distributed.tensor import DTensor

    def whole(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()

    names = {id(p): n for n, p in model.named_parameters()}
    out: dict = {"model": {n: whole(p) for n, p in model.named_parameters()}, "exp_avg": {}, "exp_avg_sq": {},
                 "steps": {}}
    for p, state in optimizer.state.items():
        name = names.get(id(p))
        if name is None:
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                out[key][name] = whole(state[key])
        if "step" in state:
            out["steps"][name] = float(state["step"])
    return out


def _state_id(generator_or_state) -> str:
    """A short fingerprint of a torch.Generator's state (or of an RNG state tensor), to compare across ranks."""
    import hashlib

    state = generator_or_state.get_state() if isinstance(generator_or_state, torch.Generator) else generator_or_state
    return hashlib.sha1(state.numpy().tobytes()).hexdigest()[:16]


def new_app_run(mesh=None, seed: int = 1234, lr: float = LR, ema: bool = True) -> types.SimpleNamespace:
    """07.app_state's run: `model` (FSDP2 over `mesh`, if given), `optimizer` (Adam at `lr`), `generator` (a
    torch.Generator seeded `seed + rank`: this rank's rows and dropout masks), `ema` (on rank 0 only: {name: a
    whole plain tensor, the parameter's shadow}, updated after every step; None on the other ranks, and on every
    rank when `ema` is False: a new launch's, which the loop starts from the weights unless a load gave it one),
    `step` 0. The global RNG is seeded `seed + rank` too, and the training loop never draws from it."""
    model = _sharded_model(mesh)
    dist = _dist()
    rank = dist.get_rank() if dist and mesh is not None else 0
    torch.manual_seed(seed + rank)
    whole = _whole(dict(model.named_parameters()))  # every rank: full_tensor is an all-gather
    return types.SimpleNamespace(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=lr),
        generator=torch.Generator().manual_seed(seed + rank),
        ema=whole if ema and rank == 0 else None, step=0)


def _app_draw(generator: torch.Generator, share: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's draw for one step: `share` row indices (with replacement) and an input dropout mask."""
    rows = torch.randint(0, ROWS, (share,), generator=generator)
    keep = (torch.rand(share, 8, generator=generator) >= DROPOUT).float() / (1 - DROPOUT)
    return rows, keep


def train_app(run, until: int) -> list[float]:
    """07.app_state's loop: steps run.step .. until-1; each rank draws its rows and dropout from run.generator,
    Adam steps, then rank 0 moves every EMA shadow toward its whole parameter (or starts the EMA from the
    weights if it has none). Each step's loss (the ranks' mean:
    all_reduce)."""
    from ....models import make_batch

    inputs_all, targets_all = make_batch(ROWS)
    dist = _dist()
    world = dist.get_world_size() if dist is not None else 1
    losses = []
    while run.step < until:
        rows, keep = _app_draw(run.generator, BATCH // world)
        run.optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(run.model(inputs_all[rows] * keep), targets_all[rows])
        loss.backward()
        run.optimizer.step()
        whole = _whole(dict(run.model.named_parameters()))  # every rank: full_tensor is an all-gather
        if (dist.get_rank() if dist is not None else 0) == 0:
            if run.ema is None:  # a new launch that loaded no EMA starts it from the weights
                run.ema = whole
            else:
                with torch.no_grad():
                    for name, value in whole.items():
                        run.ema[name].lerp_(value, 1 - EMA_DECAY)
        loss = loss.detach()
        if dist is not None and world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
        run.step += 1
    return losses


def one_process_app(world: int, steps: int, seed: int = 1234) -> tuple[list[float], dict]:
    """One process replaying `world` ranks of train_app: each step every rank's draw from its own generator
    (seeded `seed + rank`), one forward over the 8 rows, one Adam step, the EMA. Losses and the final EMA."""
    from ....models import make_batch, make_model

    inputs_all, targets_all = make_batch(ROWS)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    ema = {name: p.detach().clone() for name, p in model.named_parameters()}
    streams = [torch.Generator().manual_seed(seed + r) for r in range(world)]
    losses = []
    for _ in range(steps):
        draws = [_app_draw(stream, BATCH // world) for stream in streams]
        inputs = torch.cat([inputs_all[rows] * keep for rows, keep in draws])
        targets = torch.cat([targets_all[rows] for rows, _ in draws])
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            for name, p in model.named_parameters():
                ema[name].lerp_(p.detach(), 1 - EMA_DECAY)
        losses.append(loss.item())
    return losses, ema


def _whole(tensors: dict) -> dict:
    from torch.distributed.tensor import DTensor

    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
            for name, t in tensors.items()}


def _ema_kind(loaded: dict, saved: dict, fresh: dict) -> dict:
    """{name: "saved", "fresh" (the loaded weights), or "other"}: what each of rank 0's shadows holds."""
    def kind(name):
        got = loaded.get(name)
        if got is None or got.shape != saved[name].shape:
            return "other"
        return "saved" if torch.equal(got, saved[name]) else "fresh" if torch.equal(got, fresh[name]) else "other"

    return {name: kind(name) for name in saved}


def _whole_tensors_saved(folder: str, weights: dict) -> dict:
    """What the checkpoint holds of an EMA: whole tensors (one chunk, written by one rank) of the parameters'
    shapes (FSDP2's parameters and Adam's moments come in one chunk per rank). {"all": one of every shape,
    "by_others": the ranks other than 0 whose data files hold any of them}."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    metadata = FileSystemReader(folder).read_metadata()
    shapes = [tuple(v.shape) for v in weights.values()]
    whole, writers = [], set()
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata) and len(md.chunks) == 1 and tuple(md.size) in shapes:
            whole.append(tuple(md.size))
            info = metadata.storage_data.get(MetadataIndex(fqn, md.chunks[0].offsets))
            if info is not None:  # FileSystemWriter names each rank's files __<rank>_<n>.distcp
                writers.add(int(str(info.relative_path).split("_")[2]))
    return {"all": all(whole.count(shape) >= shapes.count(shape) for shape in shapes),
            "by_others": sorted(writers - {0})}


def dcp_app_state(fn: Callable, stop_at: int, total: int, folder: str) -> dict:
    """07.app_state: train to `stop_at`, save {"app": fn(run)} with dcp.save, train on to `total` (the
    uninterrupted run); then a fresh run, as a new launch would start it (another seed, Adam at another lr, no
    EMA on any rank), loads {"app": fn(fresh)} with dcp.load and trains to `total` (the resumed run). Send back
    both runs' losses and rank 0's EMA, and what the load restored (fingerprints of the generators to tell whose
    state came back; what each of rank 0's shadows holds)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    dist = _dist()
    rank = dist.get_rank()
    mesh = _mesh((dist.get_world_size(),))
    run = new_app_run(mesh)
    train_app(run, stop_at)
    at_save = {"generator": _state_id(run.generator), "global": _state_id(torch.get_rng_state()),
               "step": run.step, "state": full_state(run.model, run.optimizer),
               "ema": _whole(run.ema) if run.ema is not None else None,
               "lr": run.optimizer.param_groups[0]["lr"]}
    dcp.save({"app": fn(run)}, checkpoint_id=folder)
    save_changed = _state_id(run.generator) != at_save["generator"]
    uninterrupted = train_app(run, total)
    uninterrupted_ema = _whole(run.ema) if rank == 0 else {}

    # A new process: another model state, generators and global RNG elsewhere, step 0, another lr, no EMA yet.
    fresh = new_app_run(mesh, seed=99, lr=FRESH_LR, ema=False)
    fresh_generator = _state_id(fresh.generator)
    load_error = None
    try:
        dcp.load({"app": fn(fresh)}, checkpoint_id=folder)
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        load_error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ''}"
    failed = torch.tensor([load_error is not None], dtype=torch.int32)
    dist.all_reduce(failed)  # every rank stops here if any rank's load failed: none waits alone in the loop
    if failed.item():
        return {"uninterrupted": uninterrupted, "uninterrupted_ema": uninterrupted_ema,
                "save_changed_generator": save_changed, "load_error": load_error}
    loaded = full_state(fresh.model, fresh.optimizer)
    ema = fresh.ema
    # What rank 0's run.ema holds after the load (plain whole tensors expected; a DTensor is not gathered here:
    # full_tensor on one rank alone would wait for the others).
    ema_type = ("none" if ema is None else "not a dict" if not isinstance(ema, dict) else
                "dtensor" if any(isinstance(v, DTensor) for v in ema.values()) else "tensors")
    loaded_ema = ({n: v.detach().clone() for n, v in ema.items() if isinstance(v, torch.Tensor)}
                  if ema_type == "tensors" else {})
    loaded_generator, global_loaded = _state_id(fresh.generator), _state_id(torch.get_rng_state()) == at_save["global"]
    kinds = _ema_kind(loaded_ema, at_save["ema"], loaded["model"]) if rank == 0 else {}
    ema_saved = _whole_tensors_saved(folder, at_save["state"]["model"]) if rank == 0 else None
    restored = {
        "step": fresh.step == at_save["step"],
        "generator": loaded_generator == at_save["generator"],
        "model": all(torch.equal(loaded["model"][n], v) for n, v in at_save["state"]["model"].items()),
        "optimizer": bool(loaded["exp_avg"]) and all(
            n in loaded["exp_avg"] and torch.equal(loaded["exp_avg"][n], v)
            for n, v in at_save["state"]["exp_avg"].items()) and loaded["steps"] == at_save["state"]["steps"],
        "lr": fresh.optimizer.param_groups[0]["lr"] == at_save["lr"],
        # rank 0: every shadow back as saved; another rank: still none (it never needs the EMA)
        "ema": all(k == "saved" for k in kinds.values()) if rank == 0 else ema is None,
    }
    resumed_at = fresh.step
    if rank or not restored["ema"]:
        fresh.ema = None  # judged above; a wrong one could break the loop on rank 0 alone (it starts one anew)
    resumed = train_app(fresh, total) if fresh.step < total else []
    return {"uninterrupted": uninterrupted, "uninterrupted_ema": uninterrupted_ema, "resumed": resumed,
            "resumed_ema": _whole(fresh.ema) if rank == 0 and ema_type == "tensors" else {},
            "resumed_at": resumed_at, "restored": restored,
            "save_changed_generator": save_changed,
            "generators": {"saved": at_save["generator"], "fresh": fresh_generator,
                           "loaded": loaded_generator},
            "global_rng_loaded": global_loaded, "ema_type": ema_type, "ema_kinds": kinds, "ema_saved": ema_saved,
            "load_error": None}


def _watch_rank0_disk(rank0_disk: str, read: list) -> Callable[[], None]:
    """On a rank other than 0: every open for reading of a file on rank 0's disk (its own folder) is recorded in
    `read`, and a relative name this rank's folder lacks but rank 0's holds is opened there, so that the run
    goes on and the judge can name the read. Wraps builtins.open (torch.load) and io.open (pathlib: DCP's
    readers). Returns the function that puts both back."""
    import builtins
    import io

    original = builtins.open
    disk = os.path.realpath(rank0_disk)

    def watched(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and not any(c in mode for c in "wax+"):
            name = os.fsdecode(file)
            full = os.path.realpath(name)
            if full.startswith(disk + os.sep):
                read.append(os.path.relpath(full, disk))
            elif not os.path.isabs(name) and not os.path.exists(full) and os.path.exists(os.path.join(disk, name)):
                read.append(os.path.normpath(name))
                file = os.path.join(disk, name)
        return original(file, mode, *args, **kwargs)

    builtins.open = io.open = watched

    def restore() -> None:
        builtins.open = io.open = original

    return restore


def dcp_reshard_load(fn: Callable, steps: int, layout: str, path: str) -> dict:
    """07.reshard_load: every rank works in a folder of its own (its "disk": `disk_rank<r>` in the run's
    folder); rank 0 trains one process's run (a plain model, no mesh) `steps` Adam steps and writes
    torch.save({"model": ..., "optim": ...}, path) on its disk, the two dicts get_state_dict gives one process
    (whole tensors keyed by parameter name); then every rank builds a fresh FSDP2 model and Adam at another
    lr in `layout` ("shards": a 1-D mesh over all ranks; "halves": a 2-D mesh (2, N/2), HSDP, each rank
    holding half of the rows) and calls fn(model, optimizer, path on rank 0, None on the others: the file
    lies on rank 0's disk only). Send back the loaded model and Adam state, the sizes of the objects this rank
    unpickled, and what it read of rank 0's disk."""
    import torch.distributed.checkpoint  # noqa: F401 - state_dict's import needs the package first
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = _dist().get_rank()
    run_folder = os.getcwd()
    disk = os.path.join(run_folder, f"disk_rank{rank}")
    os.makedirs(disk, exist_ok=True)
    os.chdir(disk)  # what this rank writes, rank 0's file among it, the other ranks cannot see
    try:
        return _reshard_load_on_own_disk(fn, steps, layout, path, os.path.join(run_folder, "disk_rank0"),
                                         get_state_dict)
    finally:
        os.chdir(run_folder)


def _reshard_load_on_own_disk(fn, steps, layout, path, rank0_disk, get_state_dict) -> dict:
    dist = _dist()
    world, rank = dist.get_world_size(), dist.get_rank()
    if rank == 0:
        one = new_run(None)
        train(one, steps)
        model_state, optim_state = get_state_dict(one.model, one.optimizer)
        torch.save({"model": model_state, "optim": optim_state}, path)
        del one, model_state, optim_state
    dist.barrier()  # the file is written before any rank is asked to load it

    if layout == "halves":
        mesh = _mesh((2, world // 2), ("replicate", "shard"))  # HSDP: shards over mesh["shard"], replicas over 2
    else:
        mesh = _mesh((world,))
    target = new_run(mesh, lr=FRESH_LR)
    # The bytes of each object this rank unpickles from an object collective (broadcast_object_list,
    # scatter_object_list, all_gather_object, ...: every one calls _tensor_to_object on a receiver): the ledger
    # sees their tensors only as the objects' list, not their size.
    from torch.distributed import distributed_c10d as c10d

    objects, unpickle = [], c10d._tensor_to_object

    def measured(tensor, size, *rest, **named):  # torch 2.15 passes one argument more than 2.13
        objects.append(int(size))
        return unpickle(tensor, size, *rest, **named)

    read: list = []
    restore = _watch_rank0_disk(rank0_disk, read) if rank else (lambda: None)
    c10d._tensor_to_object = measured
    try:
        result = fn(target.model, target.optimizer, path if rank == 0 else None)
    finally:
        c10d._tensor_to_object = unpickle
        restore()
    # A rank back while another still waits in the load: this barrier (recorded, unlike full_tensor's gathers)
    # lets a deadline's diagnosis say that this rank left the load and the other did not.
    dist.barrier()
    loaded = full_state(target.model, target.optimizer)
    loaded["lr"] = target.optimizer.param_groups[0]["lr"]
    return {"returned": None if result is None else type(result).__name__, "loaded": loaded, "objects": objects,
            "read": sorted(set(read))}


class _DiesAfterWriting(Exception):
    """Raised by rank 1's writer after it wrote its data: a rank lost in the middle of a save."""


GOOD_SAVES, FAILED_SAVE, LAST_SAVE = (8, 9, 10), 11, 12  # 9 -> 10 -> 11 -> 12: a name sort puts step_10 first


def _folders(root: str) -> dict[str, bool]:
    """{folder under root: whether it holds DCP's .metadata (a complete checkpoint)}."""
    if not os.path.isdir(root):
        return {}
    return {entry.name: os.path.exists(os.path.join(entry.path, ".metadata"))
            for entry in os.scandir(root) if entry.is_dir()}


def dcp_crash_safe_save(fn: Callable, root: str, keep: int) -> dict:
    """07.crash_safe_save: an FSDP2 run saves after steps 8, 9 and 10 with fn(state, root, step, keep); the save
    of step 11 fails on rank 1 after it has written its data (its FileSystemWriter raises); then every rank
    loads the folder `<root>/LATEST` names into a fresh model; then the run saves after step 12. Send back
    what LATEST named after each save, whether it was replaced, the folders under root, whether the failed save
    raised, and what the load gave."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dist = _dist()
    mesh = _mesh((dist.get_world_size(),))
    run = new_run(mesh)
    named, folders, replaced, under_root = {}, {}, {}, {}
    # LATEST as each save left it, held open: os.replace installs a new file, open(path, "w") rewrites the same
    # one. An open file's inode cannot be handed to another file (ext4 reuses a freed one at once), so
    # os.path.samestat against the previous save's tells the two apart.
    opened = []

    def after(step: int) -> None:
        dist.barrier()  # rank 0 may still be writing or deleting when another rank returns
        folders[step] = _folders(root)
        path = os.path.join(root, "LATEST")
        named[step] = None
        if os.path.exists(path):
            handle = open(path)
            if opened:
                replaced[step] = not os.path.samestat(os.fstat(opened[-1].fileno()), os.fstat(handle.fileno()))
            opened.append(handle)
            named[step] = handle.read().strip()
            under_root[step] = os.path.isdir(os.path.join(root, named[step]))  # relative to root, as a restart reads it
        dist.barrier()  # every rank has looked before the next save changes anything

    def save(step: int) -> None:
        train(run, step)
        model_state, optim_state = get_state_dict(run.model, run.optimizer)
        fn({"model": model_state, "optim": optim_state}, root, step, keep)

    for step in GOOD_SAVES:
        save(step)
        after(step)
    after_good = full_state(run.model, run.optimizer)
    original = FileSystemWriter.write_data

    def dies_after_writing(self, plan, planner):
        written = original(self, plan, planner)
        written.wait()
        if dist.get_rank() == 1:
            raise _DiesAfterWriting("rank 1 was lost in the middle of the save")
        return written

    FileSystemWriter.write_data = dies_after_writing
    raised = None
    try:
        save(FAILED_SAVE)
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raised = type(exc).__name__
    finally:
        FileSystemWriter.write_data = original
    after(FAILED_SAVE)
    after_failed = full_state(run.model, run.optimizer)

    fresh = new_run(mesh, seed=99)
    load_error = None
    if named[FAILED_SAVE] is not None:
        model_state, optim_state = get_state_dict(fresh.model, fresh.optimizer)
        state = {"model": model_state, "optim": optim_state}
        try:
            dcp.load(state, checkpoint_id=os.path.join(root, named[FAILED_SAVE]))
            set_state_dict(fresh.model, fresh.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        except BaseException as exc:  # noqa: BLE001 - CheckpointException
            load_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    loaded = full_state(fresh.model, fresh.optimizer)
    last_error = None
    try:
        save(LAST_SAVE)
        after(LAST_SAVE)
    except BaseException as exc:  # noqa: BLE001 - e.g. a folder deleted under a rank
        last_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    for handle in opened:
        handle.close()
    return {"named": named, "raised": raised, "replaced": replaced, "folders": folders, "under_root": under_root,
            "load_error": load_error,
            "last_error": last_error, "loaded": loaded, "after_good": after_good, "after_failed": after_failed}
