"""Tensor and expert parallelism: process groups (groups.py), which part of each weight a rank
holds (shard.py). The processes of the ranks, and how they follow rank 0's steps: ../ranks.py."""
