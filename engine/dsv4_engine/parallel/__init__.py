"""Tensor and expert parallelism: process groups (groups.py), which part of each weight a rank
holds (shard.py), and the ranks that follow rank 0's steps (worker.py, launch.py)."""
