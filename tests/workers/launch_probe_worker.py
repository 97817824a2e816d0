"""A worker for the launch tests (``tests/project/test_launch_server.py``): ``--sum`` all-reduces the ranks' numbers
over a gloo group and prints what each rank saw; ``--fail-rank R --code C`` makes rank R exit with C while the
others wait; ``--hang`` makes every rank wait."""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--sum", action="store_true")
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--code", type=int, default=3)
parser.add_argument("--hang", action="store_true")
args = parser.parse_args()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if args.sum:
    dist.init_process_group("gloo")
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(f"rank {rank}/{world} local {os.environ['LOCAL_RANK']} of {os.environ['LOCAL_WORLD_SIZE']} "
          f"sum {total.item():.0f} main {__name__} argv {sys.argv[1:]}", flush=True)
    dist.destroy_process_group()
if rank == args.fail_rank:
    print(f"rank {rank} exits {args.code}", flush=True)
    sys.exit(args.code)
if args.hang or args.fail_rank >= 0:
    time.sleep(600)
