import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
# One intra-op thread: the tests' tensors are small, and on a busy 2-core machine a second OpenMP thread makes them
# slower, waiting at barriers. Tests that need several threads set them themselves.
torch.set_num_threads(1)
