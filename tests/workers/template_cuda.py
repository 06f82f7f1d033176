"""A module that initialises CUDA when imported: preloaded, it makes the worker template
refuse to fork (tests/test_template.py, where torch has CUDA)."""

import torch

torch.cuda.init()
