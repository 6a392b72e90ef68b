"""float8/ used on its own: the example training loop runs, the config is frozen, recipes come
as names (ours or torchao's) or objects, and the public API is what `float8.__all__` declares."""

from __future__ import annotations

import dataclasses
import enum

import pytest

import float8
from float8 import RECIPES, Float8Config, Float8Linear, convert_to_float8_training, recipe_named
from float8.examples import train_loop
from float8.examples.train_loop import TENSORWISE_GW_HP, mlp


@pytest.mark.version_specific  # CPU float8 GEMMs (torch._scaled_mm) differ between torch versions
def test_the_example_training_loop_learns(capsys):
    train_loop.main()  # what `python -m float8.examples.train_loop` runs
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "rowwise: 2 converted (0, 2); 1 skipped: 4 (filtered by filter_fqns)"
    assert lines[2] == "tensorwise_gw_hp: 2 converted (0, 2); 1 skipped: 4 (filtered by filter_fqns)"
    for line in (lines[1], lines[3]):
        first, last = (float(v) for v in line.split()[1:4:2])
        assert last < first / 5, line


def test_the_config_is_frozen_and_a_change_is_a_new_config():
    config = Float8Config(filter_fqns=["output", "wq"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.emulate = True
    assert config.filter_fqns == ("output", "wq")  # a tuple: nothing in it changes either
    emulated = dataclasses.replace(config, emulate=True, scaling="rowwise")
    assert (emulated.emulate, emulated.recipe) == (True, RECIPES["rowwise"])
    assert (config.emulate, config.recipe) == (False, RECIPES["tensorwise"])
    model = mlp()
    convert_to_float8_training(model, config=config)
    assert all(m.config is config for m in model.modules() if isinstance(m, Float8Linear))


class TorchaoRecipeName(enum.Enum):  # the shape of torchao.float8.Float8LinearRecipeName
    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"


def test_a_recipe_is_a_name_ours_or_torchaos_or_an_object():
    assert Float8Config(scaling="rowwise").recipe is RECIPES["rowwise"]
    assert Float8Config(scaling=TorchaoRecipeName.ROWWISE).scaling == "rowwise"
    assert recipe_named(TorchaoRecipeName.TENSORWISE) is RECIPES["tensorwise"]
    custom = Float8Config(scaling=TENSORWISE_GW_HP)
    assert custom.recipe is TENSORWISE_GW_HP and TENSORWISE_GW_HP.name not in RECIPES
    model = mlp()
    convert_to_float8_training(model, config=custom)
    assert "scaling=tensorwise_gw_hp" in repr(model[0])
    # Recipes are equal by their casts, whatever their names.
    assert dataclasses.replace(RECIPES["rowwise"], name="mine") == RECIPES["rowwise"]


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ("rowwise_with_gw_hp", "Float8Config.scaling: torchao's rowwise_with_gw_hp is not a recipe of this package"),
        (TorchaoRecipeName.ROWWISE_WITH_GW_HP, "Float8Config.scaling: torchao's rowwise_with_gw_hp is not a recipe"),
        ("rowise", "Float8Config.scaling: no float8 recipe named 'rowise': one of tensorwise, rowwise, rowwise_gw_hp"),
        (3, "Float8Config.scaling must be a recipe name or a Float8Recipe, got 3"),
    ],
)
def test_a_recipe_this_package_lacks_is_refused_in_one_line(scaling, message):
    with pytest.raises(ValueError) as e:
        Float8Config(scaling=scaling)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_the_built_in_recipes_are_read_only():
    with pytest.raises(TypeError):
        RECIPES["mine"] = TENSORWISE_GW_HP  # type: ignore[index]
    assert all(name == recipe.name for name, recipe in RECIPES.items())


def test_the_public_api_is_declared():
    assert sorted(set(float8.__all__)) == sorted(float8.__all__)
    namespace: dict = {}
    exec("from float8 import *", namespace)
    assert set(float8.__all__) <= namespace.keys()
