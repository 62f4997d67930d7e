"""How fast gloo moves bulk data between two nodes, by how the connections are used.

Run as 2 nodes x 2 ranks on the simulated cluster; rank (node, l) talks to (other node, l):

    OMP_NUM_THREADS=1 bash ../shared/sim2node.sh 10mbit 2 benchmarks/link_directions.py --mib 8 --reps 3

    one connection, both ways     local rank 0 of each node sends --mib to the other and receives
                                  as much, over the one TCP connection gloo keeps for a pair of
                                  ranks (what the cross-node hops of two nodes did before
                                  `burst.topology.cross_node_links` split them)
    a connection per direction    the same, sending on one process group and receiving on another
    one-way pairs                 0 -> 2 and 3 -> 1, as the flat ring crosses between two nodes

Prints the slowest rank's seconds and MiB/s per direction for each pattern and repetition.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

NODE_SIZE = 2


def timed(transfers: list) -> float:
    """Post (function, tensor, peer, group) transfers, wait for all; the slowest rank's seconds."""
    dist.barrier()
    start = time.perf_counter()
    works = [post(tensor, peer, group) for post, tensor, peer, group in transfers]
    for work in works:
        work.wait()
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=8.0, help="MiB sent each way")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != 2 * NODE_SIZE:
        raise SystemExit(f"run as 2 nodes x {NODE_SIZE} ranks (world 4), not a world of {world_size}")
    node, local = divmod(rank, NODE_SIZE)
    counterpart = (rank + NODE_SIZE) % world_size
    # every rank creates every group, in one order: two groups per cross-node pair
    pair_groups = {i: (dist.new_group([i, i + NODE_SIZE]), dist.new_group([i, i + NODE_SIZE]))
                   for i in range(NODE_SIZE)}
    size = int(args.mib * 2**20)

    def both_ways(split: bool) -> list:
        if local != 0:
            return []
        first, second = pair_groups[0]
        send_group, receive_group = ((first, second) if node == 0 else (second, first)) if split else (first, first)
        return [(dist.isend, torch.ones(size, dtype=torch.uint8), counterpart, send_group),
                (dist.irecv, torch.empty(size, dtype=torch.uint8), counterpart, receive_group)]

    def one_way_pairs() -> list:
        sender, receiver = {0: 2, 3: 1}, {2: 0, 1: 3}
        if rank in sender:
            return [(dist.isend, torch.ones(size, dtype=torch.uint8), sender[rank], None)]
        return [(dist.irecv, torch.empty(size, dtype=torch.uint8), receiver[rank], None)]

    patterns = {"one connection, both ways": lambda: both_ways(split=False),
                "a connection per direction": lambda: both_ways(split=True),
                "one-way pairs": one_way_pairs}
    for rep in range(args.reps):
        for name, transfers in patterns.items():
            seconds = timed(transfers())
            if rank == 0:
                print(f"rep {rep}  {name:28s} {seconds:6.2f} s  {args.mib / seconds:5.2f} MiB/s per direction",
                      flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
