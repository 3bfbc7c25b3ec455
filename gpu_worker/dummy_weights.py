"""`--load-format dummy` (vLLM's name): random weights of the model's shapes instead of
a checkpoint's, so that a config.json alone can be run and benchmarked offline.

Each parameter is filled in place by torch's own generators, on its device and in its
dtype (no element loop in Python, no float32 copy): matrices N(0, 1/in_features), so
activations keep their scale layer after layer, as a trained model's do (and no
denormals: they would slow a CPU benchmark down); norms 1, biases 0. Seeded, so two
runs see the same weights.
"""

from __future__ import annotations

import torch
from torch import nn


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            generator = generators.get(param.device)
            if generator is None:
                generator = torch.Generator(param.device).manual_seed(seed)
                generators[param.device] = generator
            if param.dim() == 1:
                param.fill_(1.0 if "norm" in name else 0.0)
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
