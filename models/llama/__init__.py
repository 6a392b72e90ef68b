"""LLaMA-2: hyperparameters, flavours, the model and parameter counting."""

from .args import LLAMA2_FLAVORS, LlamaArgs
from .model import Transformer, TransformerBlock, initialized_model, num_params, seeded_init

__all__ = [
    "LLAMA2_FLAVORS", "LlamaArgs", "Transformer", "TransformerBlock", "initialized_model", "num_params", "seeded_init",
]
