"""Helpers ``slurm/ray_cluster.sbatch`` runs inside the allocation (``python -m raytrain.launch ...``).

Kept in Python so the batch script stays a short list of roles: choosing each node's address and
interface, claiming a per-job port block, supervising ``ray start --block`` on a node, and waiting until
every node has joined.
"""
