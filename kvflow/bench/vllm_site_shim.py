"""Installed as `sitecustomize.py` on the path of a vLLM server that serves a vision
model (kvflow/bench/vllm_server.py); not imported by kvflow.

vLLM's LLaVA module imports its Pixtral module, which imports transformers' Pixtral
image processor of the torchvision backend. A CPU peer environment may have no
torchvision (PyPI's wheel is the CUDA build and does not load next to a CPU torch), and
the import then fails although a LLaVA model never uses Pixtral's processor. Without
torchvision, that one module name resolves to the same file's PIL-backend sibling,
which defines the same helpers. With torchvision installed this does nothing.
"""

import importlib.util
import os
import sys

TARGET = "transformers.models.pixtral.image_processing_pixtral"
SIBLING = "image_processing_pil_pixtral.py"


class _PixtralPilFinder:
    def find_spec(self, name, path, target=None):
        if name != TARGET or path is None:
            return None
        for entry in path:
            candidate = os.path.join(entry, SIBLING)
            if os.path.exists(candidate):
                return importlib.util.spec_from_file_location(name, candidate)
        return None


if importlib.util.find_spec("torchvision") is None:
    sys.meta_path.insert(0, _PixtralPilFinder())
