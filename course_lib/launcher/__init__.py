"""The kernel side of the process boundary: start ranks, follow them, end them, say what went wrong.

- `torchrun`: one-shot launches (`run_torchrun`, `TorchrunProcess`);
- `pool` + `pool_worker`: persistent ranks, the kernel's and the rank's halves;
- `messages`: what kernel and workers send each other (authenticated, plain pickle);
- `processes`: the process tree of a launch, killed by PID, never by name;
- `watchdog`: kills a launch whose kernel died;
- `diagnosis`: who is stuck where, from ledgers and stacks;
- `rank_output`: what ranks wrote (torchrun's log files) as rank-ordered text.

What the ranks must agree on with this side is in `course_lib.rank.contract`.
"""
