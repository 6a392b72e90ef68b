"""LLaMA-2: hyperparameters, flavours, the model and parameter counting."""

from .args import LLAMA2_FLAVORS, LlamaArgs
from .model import Transformer, TransformerBlock, num_params

__all__ = ["LLAMA2_FLAVORS", "LlamaArgs", "Transformer", "TransformerBlock", "num_params"]
