"""Triton kernels, each with a plain-torch reference beside it.

The references are the CPU path, so a CPU install needs no triton (the modules import it through
``triton_import``); on CUDA the kernels need it, and the CUDA build of torch brings it.
"""

from spectool.kernels.tree_indices import reconstruct_indices_from_tree_mask

__all__ = ["reconstruct_indices_from_tree_mask"]
