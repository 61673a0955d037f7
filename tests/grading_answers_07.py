"""Answer cells for lesson 07's grader tests: the solutions (as in solutions/07_checkpointing_solutions.ipynb)
and plausible wrong answers, each of which must lose exactly the points its mistake deserves."""

APP_SOLUTION = '''%%exercise 07.app_state
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful


class RunState(Stateful):
    def __init__(self, run):
        self.run = run

    def state_dict(self):
        model_state, optim_state = get_state_dict(self.run.model, self.run.optimizer)
        state = {"model": model_state, "optim": optim_state, "step": self.run.step,
                 f"generator_{dist.get_rank()}": self.run.generator.get_state()}
        if dist.get_rank() == 0:
            ema = self.run.ema
            if ema is None:
                ema = {n: torch.empty(p.shape) for n, p in self.run.model.named_parameters()}
            state["ema"] = ema
        return state

    def load_state_dict(self, state):
        set_state_dict(self.run.model, self.run.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.run.step = state["step"]
        if dist.get_rank() == 0:
            self.run.ema = state["ema"]
        self.run.generator.set_state(state[f"generator_{dist.get_rank()}"])


def app_state(run):
    return RunState(run)
'''
GENERATOR_SAVED = 'f"generator_{dist.get_rank()}": self.run.generator.get_state()'
GENERATOR_SET = '        self.run.generator.set_state(state[f"generator_{dist.get_rank()}"])\n'
assert GENERATOR_SAVED in APP_SOLUTION and GENERATOR_SET in APP_SOLUTION

# The optimizer left out: the model resumes, Adam starts again from zero moments.
APP_NO_OPTIMIZER = (APP_SOLUTION
                    .replace('''        model_state, optim_state = get_state_dict(self.run.model, self.run.optimizer)
        state = {"model": model_state, "optim": optim_state,''',
                             '''        state = {"model": self.run.model.state_dict(),''')
                    .replace('''        set_state_dict(self.run.model, self.run.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
''', '''        self.run.model.load_state_dict(state["model"])
'''))
assert APP_NO_OPTIMIZER.count("get_state_dict(") == 0

# The generator under one name, as if every rank's were alike: one rank's copy goes to every rank.
APP_GENERATOR_ONE_NAME = APP_SOLUTION.replace('f"generator_{dist.get_rank()}"', '"generator"')
assert APP_GENERATOR_ONE_NAME.count('"generator"') == 2

# The lesson's habit: the global RNG under a name per rank. The rows and dropout come from run.generator.
APP_GLOBAL_RNG = (APP_SOLUTION.replace(GENERATOR_SAVED, 'f"rng_{dist.get_rank()}": torch.get_rng_state()')
                  .replace(GENERATOR_SET, '        torch.set_rng_state(state[f"rng_{dist.get_rank()}"])\n'))
assert "generator" not in APP_GLOBAL_RNG.split("def load_state_dict")[1]

# The generator saved but never set back: the new run draws from its own.
APP_GENERATOR_NOT_SET = APP_SOLUTION.replace(GENERATOR_SET, "")
assert APP_GENERATOR_NOT_SET != APP_SOLUTION

EMA_SAVED = """        if dist.get_rank() == 0:
            ema = self.run.ema
            if ema is None:
                ema = {n: torch.empty(p.shape) for n, p in self.run.model.named_parameters()}
            state["ema"] = ema
"""
EMA_SET = """        if dist.get_rank() == 0:
            self.run.ema = state["ema"]
"""
assert EMA_SAVED in APP_SOLUTION and EMA_SET in APP_SOLUTION

# The EMA left out: the new run's rank 0 starts one from its weights.
APP_NO_EMA = APP_SOLUTION.replace(EMA_SAVED, "").replace(EMA_SET, "")
assert APP_NO_EMA != APP_SOLUTION

# The EMA rebuilt from the loaded weights instead of saved: it forgets the average of the steps before.
APP_EMA_FROM_WEIGHTS = APP_NO_EMA.replace('''        self.run.step = state["step"]
''', '''        self.run.step = state["step"]
        if dist.get_rank() == 0:
            self.run.ema = {n: p.full_tensor().clone() for n, p in self.run.model.named_parameters()}
        else:
            for p in self.run.model.parameters():
                p.full_tensor()
''')
assert APP_EMA_FROM_WEIGHTS != APP_NO_EMA

# The lesson's habit, every rank's state under the same names: rank 0's shadows, rank 1's None. The save works,
# but the new launch's rank 0 has no tensors for dcp.load to fill: it loads rank 1's None.
APP_EMA_AS_IS = (APP_SOLUTION.replace(EMA_SAVED, '        state["ema"] = self.run.ema\n')
                 .replace(EMA_SET, ""))
assert APP_EMA_AS_IS != APP_SOLUTION

# The EMA saved on rank 0 alone, but the new launch's rank 0 (which has none) hands dcp.load a None to fill.
APP_EMA_NOTHING_TO_FILL = APP_SOLUTION.replace('''            if ema is None:
                ema = {n: torch.empty(p.shape) for n, p in self.run.model.named_parameters()}
''', "")
assert APP_EMA_NOTHING_TO_FILL != APP_SOLUTION

# DTensor buffers like the parameters (empty_like): dcp.load reshards the whole shadows into rank 0's DTensors.
APP_EMA_DTENSOR_BUFFERS = APP_SOLUTION.replace("torch.empty(p.shape)", "torch.empty_like(p)")
assert APP_EMA_DTENSOR_BUFFERS != APP_SOLUTION

# "Every rank must pass the same names": rank 1 saves zeros in the EMA's shapes under the same names. DCP takes
# them for replicas of rank 0's and writes some shadows from rank 1's copy.
APP_EMA_PLACEHOLDER = APP_SOLUTION.replace('''        if dist.get_rank() == 0:
            ema = self.run.ema
            if ema is None:
                ema = {n: torch.empty(p.shape) for n, p in self.run.model.named_parameters()}''',
                                           '''        if True:
            ema = self.run.ema
            if ema is None:
                ema = {n: torch.zeros(p.shape) for n, p in self.run.model.named_parameters()}''')
assert APP_EMA_PLACEHOLDER != APP_SOLUTION

# The new launch has no EMA on any rank, so every rank hands dcp.load tensors to fill and keeps them: rank 1 now
# holds the whole EMA it must not need.
APP_EMA_LOADED_EVERYWHERE = (APP_SOLUTION
                             .replace("        if dist.get_rank() == 0:\n            ema = self.run.ema\n",
                                      "        if dist.get_rank() == 0 or self.run.step == 0:\n"
                                      "            ema = self.run.ema\n")
                             .replace(EMA_SET, '''        if "ema" in state:
            self.run.ema = state["ema"]
'''))
assert APP_EMA_LOADED_EVERYWHERE.count("self.run.step == 0") == 1

# No set_state_dict: dcp.load filled the tensors in place, but Adam's lr stays the new run's.
APP_NO_SET_STATE_DICT = APP_SOLUTION.replace('''        set_state_dict(self.run.model, self.run.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
''', "")
assert APP_NO_SET_STATE_DICT != APP_SOLUTION

# The step left out: the new run starts again at step 0.
APP_NO_STEP = APP_SOLUTION.replace('        self.run.step = state["step"]\n', "")
assert APP_NO_STEP != APP_SOLUTION

RESHARD_SOLUTION = '''%%exercise 07.reshard_load
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict


def load_resharded(model, optimizer, path):
    if path is not None:
        saved = torch.load(path, weights_only=True)
        model_state, optim_state = saved["model"], saved["optim"]
    else:
        model_state, optim_state = model.state_dict(), {}
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
'''

# Lesson 05's habit, {} on the ranks without the file: set_state_dict reads it as "the optimizer only", so
# those ranks skip the model's broadcasts and rank 0 waits in them.
RESHARD_EMPTY_MODEL_DICT = RESHARD_SOLUTION.replace("model.state_dict(), {}", "{}, {}")
assert RESHARD_EMPTY_MODEL_DICT != RESHARD_SOLUTION

# The model only: the parameters load, Adam's state stays the fresh one's.
RESHARD_MODEL_ONLY = '''%%exercise 07.reshard_load
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict


def load_resharded(model, optimizer, path):
    state = torch.load(path, weights_only=True)["model"] if path is not None else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
'''

# Whole tensors without broadcast_from_rank0: the ranks without the file have nothing to load.
RESHARD_NO_BROADCAST = RESHARD_SOLUTION.replace(", broadcast_from_rank0=True", "")
assert RESHARD_NO_BROADCAST != RESHARD_SOLUTION

# Rank 0 alone loads the file, into its own shards: the other ranks keep their fresh rows.
RESHARD_RANK0_ALONE = '''%%exercise 07.reshard_load
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict


def load_resharded(model, optimizer, path):
    if path is None:
        return
    saved = torch.load(path, weights_only=True)
    set_state_dict(model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optim"],
                   options=StateDictOptions(full_state_dict=True))
'''

# Rank 0 reads the file and sends all of it to every rank in one object; each rank then holds the whole state
# (what sharding keeps off it) and loads it as if it had read the file.
RESHARD_BROADCAST_WHOLE = '''%%exercise 07.reshard_load
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict


def load_resharded(model, optimizer, path):
    box = [torch.load(path, weights_only=True) if path is not None else None]
    dist.broadcast_object_list(box, src=0)
    set_state_dict(model, optimizer, model_state_dict=box[0]["model"], optim_state_dict=box[0]["optim"],
                   options=StateDictOptions(full_state_dict=True))
'''

# Every rank loads the file itself (the name broadcast from rank 0): the file lies on rank 0's disk only, and
# every rank would hold the whole state at once.
RESHARD_EVERY_RANK_READS = '''%%exercise 07.reshard_load
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict


def load_resharded(model, optimizer, path):
    box = [path]
    dist.broadcast_object_list(box, src=0)
    saved = torch.load(box[0], weights_only=True)
    set_state_dict(model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optim"],
                   options=StateDictOptions(full_state_dict=True))
'''

# The lesson's section 9 route: rank 0 converts the file to a DCP folder, every rank dcp.loads its pieces from
# it. Right on a shared disk; here the folder is on rank 0's disk, which the other ranks cannot read.
RESHARD_CONVERTED_BY_RANK0 = '''%%exercise 07.reshard_load
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import torch_save_to_dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def load_resharded(model, optimizer, path):
    if path is not None:
        torch_save_to_dcp(path, "converted")
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id="converted")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
'''

CRASH_SOLUTION = '''%%exercise 07.crash_safe_save
import os
import shutil
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def prune(root, keep, newest):
    folders = [entry for entry in os.scandir(root) if entry.is_dir()]
    complete = sorted((int(entry.name.split("_")[1]), entry.name) for entry in folders
                      if os.path.exists(os.path.join(entry.path, ".metadata")))
    kept = {folder for _, folder in complete[-keep:]} | {newest}
    for entry in folders:
        if entry.name not in kept:
            shutil.rmtree(entry.path)


def save_checkpoint(state, root, step, keep):
    name = f"step_{step}"
    dcp.save(state, checkpoint_id=os.path.join(root, name))
    if dist.get_rank() == 0:
        with open(os.path.join(root, "LATEST.tmp"), "w") as handle:
            handle.write(name)
        os.replace(os.path.join(root, "LATEST.tmp"), os.path.join(root, "LATEST"))
        prune(root, keep, name)
'''
ATOMIC_LATEST = '''        with open(os.path.join(root, "LATEST.tmp"), "w") as handle:
            handle.write(name)
        os.replace(os.path.join(root, "LATEST.tmp"), os.path.join(root, "LATEST"))
'''
assert ATOMIC_LATEST in CRASH_SOLUTION

# One folder for every save: the failed save writes over the last good checkpoint.
CRASH_OVERWRITE = CRASH_SOLUTION.replace('name = f"step_{step}"', 'name = "step_0"')

# LATEST moved before the save, in place: after a failed save it names a folder without .metadata.
CRASH_MARK_FIRST = CRASH_SOLUTION.replace('''    dcp.save(state, checkpoint_id=os.path.join(root, name))
    if dist.get_rank() == 0:
''' + ATOMIC_LATEST, '''    os.makedirs(root, exist_ok=True)
    if dist.get_rank() == 0:
        with open(os.path.join(root, "LATEST"), "w") as handle:
            handle.write(name)
    dcp.save(state, checkpoint_id=os.path.join(root, name))
    if dist.get_rank() == 0:
''')
assert CRASH_MARK_FIRST != CRASH_SOLUTION

# LATEST rewritten in place (not atomic): a crash while it is written leaves it empty or half written.
CRASH_IN_PLACE = CRASH_SOLUTION.replace(ATOMIC_LATEST, '''        with open(os.path.join(root, "LATEST"), "w") as handle:
            handle.write(name)
''')
assert CRASH_IN_PLACE != CRASH_SOLUTION

# The failure swallowed: the caller thinks step 11 was saved.
CRASH_SWALLOWS = CRASH_SOLUTION.replace(
    "    dcp.save(state, checkpoint_id=os.path.join(root, name))\n",
    "    try:\n        dcp.save(state, checkpoint_id=os.path.join(root, name))\n    except BaseException:\n        return\n")
assert CRASH_SWALLOWS != CRASH_SOLUTION

# Every rank installs LATEST itself, each through a temporary name of its own, after dcp.save returned: each
# os.replace is atomic and names a complete checkpoint, so it is right (the freed inodes of the ranks' files
# may be reused at once: the grader must not take "the same inode number" for "rewritten in place").
CRASH_EVERY_RANK_REPLACES = CRASH_SOLUTION.replace('''    if dist.get_rank() == 0:
''' + ATOMIC_LATEST + '''        prune(root, keep, name)
''', '''    pending = os.path.join(root, f"LATEST.tmp{dist.get_rank()}")
    with open(pending, "w") as handle:
        handle.write(name)
    os.replace(pending, os.path.join(root, "LATEST"))
    dist.barrier()  # every rank's LATEST in place before rank 0 deletes
    if dist.get_rank() == 0:
        prune(root, keep, name)
''')
assert CRASH_EVERY_RANK_REPLACES != CRASH_SOLUTION

# Newest by name: as text "step_10" sorts before "step_9", so the save of step 10 deletes its own folder.
CRASH_SORTED_BY_NAME = CRASH_SOLUTION.replace('(int(entry.name.split("_")[1]), entry.name)', "(entry.name, entry.name)")
assert CRASH_SORTED_BY_NAME != CRASH_SOLUTION

# Every folder counted as a checkpoint: the failed save's (no .metadata) pushes out a complete one.
CRASH_COUNTS_INCOMPLETE = CRASH_SOLUTION.replace('''
                      if os.path.exists(os.path.join(entry.path, ".metadata")))''', ")")
assert CRASH_COUNTS_INCOMPLETE != CRASH_SOLUTION

# Room made before the save: the old ones beyond keep - 1 deleted first, so a failed save leaves one too few.
CRASH_PRUNE_FIRST = CRASH_SOLUTION.replace('''    name = f"step_{step}"
    dcp.save(''', '''    name = f"step_{step}"
    if dist.get_rank() == 0 and os.path.isdir(root):
        prune(root, keep - 1, "")
    dist.barrier()
    dcp.save(''').replace("        prune(root, keep, name)\n", "")
assert CRASH_PRUNE_FIRST != CRASH_SOLUTION

# LATEST holds the path passed to dcp.save ("checkpoints/step_10"), not the folder's name under root: a restart
# reads it relative to root and finds nothing; the pruning itself is right.
CRASH_LATEST_WITH_ROOT = CRASH_SOLUTION.replace("            handle.write(name)\n",
                                                "            handle.write(os.path.join(root, name))\n")
assert CRASH_LATEST_WITH_ROOT != CRASH_SOLUTION
