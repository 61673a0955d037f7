"""Measuring what distributed training does, as plain data (never matplotlib: drawing is in course_lib.draw).

- `comm`: the collective ledger as bytes per op per step; CommDebugMode counts;
- `memory`: one training step per rank and phase, measured and predicted;
- `sharding`: which rank holds which slice of each parameter;
- `simulate` + `simulate_worker`: FSDP2 at sizes no machine here holds (fake process group, meta tensors).
"""
