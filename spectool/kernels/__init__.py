"""Triton kernels, each with a plain-torch reference beside it."""

from spectool.kernels.tree_indices import reconstruct_indices_from_tree_mask

__all__ = ["reconstruct_indices_from_tree_mask"]
