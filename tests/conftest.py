"""Shared pytest configuration."""

import os

# torch_npu, if ever present in a CPU environment, breaks `import torch` without this.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
