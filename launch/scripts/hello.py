"""Every rank says hello; an all_reduce checks that the group works.

Run: torchrun --standalone --nproc-per-node 2 launch/scripts/hello.py
 or: NPROC=4 bash launch/run_local.sh launch/scripts/hello.py
"""

import torch
import torch.distributed as dist

import course_lib as cl

info = cl.init()  # prints "[torchrun] N ranks, backend ... (why)" on rank 0
print(f"hello from rank {info.rank} of {info.world_size} on {info.device}", flush=True)

# Each rank holds rank + 1; the sum over ranks is 1 + 2 + ... + N = N(N+1)/2.
value = torch.tensor([info.rank + 1.0], device=info.device)
dist.all_reduce(value, op=dist.ReduceOp.SUM)
expected = info.world_size * (info.world_size + 1) / 2
torch.testing.assert_close(value.cpu(), torch.tensor([expected]))
cl.print0(f"all_reduce(SUM) = {value.item():g}, expected {expected:g}: ok")

dist.destroy_process_group()
