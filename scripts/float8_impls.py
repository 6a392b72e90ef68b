"""The float8 implementations a benchmark can compare: this repository's `float8` package
and the reference library, torchao's `torchao.float8` (optional: pip install -e ".[reference]").

Both convert the same modules in place with the same recipe:

    ours            torchao
    tensorwise      Float8LinearConfig()                                  (its default)
    rowwise         Float8LinearConfig.from_recipe_name("rowwise")
    rowwise_gw_hp   Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")
"""

from __future__ import annotations

import logging

from torch import nn

from float8 import Float8Config, convert_to_float8_training, raise_dynamo_recompile_limit

IMPLS = ("ours", "torchao")
TORCHAO_RECIPES = {"tensorwise": None, "rowwise": "rowwise", "rowwise_gw_hp": "rowwise_with_gw_hp"}
INSTALL_HINT = 'pip install -e ".[reference]"'


class ReferenceMissing(Exception):
    """torchao is not installed (or not importable with this torch)."""


def torchao_version() -> str:
    """The installed torchao's version; raises ReferenceMissing with the install command."""
    # torchao logs a warning per CUDA extension it cannot load (none of them is float8
    # training's); on a CPU build that is every one of them.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    try:
        import torchao
        import torchao.float8
    except ImportError as e:
        raise ReferenceMissing(f"--impl torchao needs the reference library torchao ({e}): {INSTALL_HINT}") from None
    return torchao.__version__


def convert(module: nn.Module, scaling: str, impl: str) -> nn.Module:
    """Convert `module`'s linears to float8 training linears of `impl` with recipe `scaling`."""
    if impl == "ours":
        config = Float8Config(scaling=scaling, filter_fqns=[])
        # What the trainer does: the self-compiled eager casts need more variants than
        # dynamo's default allows per function.
        raise_dynamo_recompile_limit(config.dynamo_recompile_limit)
        convert_to_float8_training(module, config=config)
        return module
    torchao_version()
    from torchao.float8 import Float8LinearConfig
    from torchao.float8 import convert_to_float8_training as torchao_convert

    recipe = TORCHAO_RECIPES[scaling]
    config = Float8LinearConfig() if recipe is None else Float8LinearConfig.from_recipe_name(recipe)
    torchao_convert(module, config=config)
    return module
