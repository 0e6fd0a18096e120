import os
import sys

import torch

# Without a GPU, Triton kernels run on CPU tensors through Triton's interpreter.
# It must be chosen before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))
