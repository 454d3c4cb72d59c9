"""The stock pattern's driver for the boot benchmark: when could it start, and when had every node joined."""

import os
import time

import ray

start = float(os.environ["STOCK_JOB_START"])
expected = int(os.environ["SLURM_JOB_NUM_NODES"])
print(f"stock: driver started {time.time() - start:.1f} s after the job started", flush=True)
ray.init(address=os.environ["STOCK_HEAD"], log_to_driver=False)
alive = sum(n["Alive"] for n in ray.nodes())
print(f"stock: {alive}/{expected} nodes alive when the driver connected", flush=True)
while sum(n["Alive"] for n in ray.nodes()) < expected:
    time.sleep(0.2)
print(f"stock: all {expected} nodes joined, {time.time() - start:.1f} s after the job started", flush=True)
