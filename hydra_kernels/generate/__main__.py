"""python -m hydra_kernels.generate --prompt "...": the CLI (hydra_kernels/cli.py)."""
import torch

from ..cli import main

torch.set_grad_enabled(False)
main()
