"""Every whole-number field of the recipe reads and words a value the same way: ``num_experts``,
``experts_per_token``, ``batch_size`` and ``moe_layers: {every, start}`` (issue #39: ``num_experts: "4"`` was
accepted while ``{every: "2"}`` was refused, and 2.5 was worded two ways). The expected words are spelled out here."""

from __future__ import annotations

import pytest

from moe_upcycle.errors import ConfigError
from moe_upcycle.recipe.schema import load_config

# (field, its lower bound): where the value goes, and what "too small" says
FIELDS = [("num_experts", 1), ("experts_per_token", 1), ("batch_size", 1), ("moe_layers.every", 1),
          ("moe_layers.start", 0)]
BOOLEAN = "true is a boolean, not a number; write a number (YAML reads yes/no/on/off as true/false)"


def _recipe(field: str, value) -> dict:
    recipe = {"base_model": "org/base", "num_experts": 4, "gate_mode": "random", "experts_per_token": 1}
    if field.startswith("moe_layers."):
        key = field.split(".")[1]
        recipe["moe_layers"] = {"every": 2, key: value}
    else:
        recipe[field] = value
    return recipe


def _read(config, field: str):
    if field.startswith("moe_layers."):
        return getattr(config.moe_layers, field.split(".")[1])
    return getattr(config, field)


@pytest.mark.parametrize("field, low", FIELDS)
@pytest.mark.parametrize("value, read", [("3", 3), (" 3 ", 3), (3.0, 3), (3, 3)],
                         ids=["quoted", "quoted-spaces", "float-integral", "int"])
def test_whole_numbers_are_read_alike(field, low, value, read):
    assert _read(load_config(_recipe(field, value)), field) == read


@pytest.mark.parametrize("field, low", FIELDS)
@pytest.mark.parametrize("value, said", [
    (True, BOOLEAN),
    (2.5, "2.5 is not a whole number; write an integer such as 2"),
    (-3, "-3 is too small; write at least {low}"),
    ([3], "a list of 1 items is not a number; write an integer such as 2"),
    ("four", "'four' is not a number; write an integer such as 2"),
    (float("inf"), ".inf (not a number, or infinity) is not a finite number; write an ordinary number"),
], ids=["bool", "fraction", "negative", "list", "text", "inf"])
def test_wrong_whole_numbers_are_worded_alike(field, low, value, said):
    with pytest.raises(ConfigError) as err:
        load_config(_recipe(field, value))
    assert err.value.problems == [f"config: {field}: {said.format(low=low)}"]


@pytest.mark.parametrize("field", ["experts_per_token", "moe_layers.every"])
def test_an_empty_whole_number_is_named(field):
    with pytest.raises(ConfigError) as err:
        load_config(_recipe(field, None))
    key = field.split(".")[-1]
    assert err.value.problems == [f"config: {field}: empty (nothing after '{key}:'); write a value, or delete the line"]


def test_moe_layers_items_read_as_the_scalars_do():
    assert load_config({**_recipe("num_experts", 4), "moe_layers": ["1", 3.0, 0]}).moe_layers == [1, 3, 0]
    with pytest.raises(ConfigError) as err:
        load_config({**_recipe("num_experts", 4), "moe_layers": [1, 2.5]})
    assert err.value.problems == ["config: moe_layers: item 1: 2.5 is not a whole number; write an integer such as 2"]


def test_yaml_text_reads_as_the_mapping(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text('base_model: org/base\nnum_experts: "4"\ngate_mode: random\nmoe_layers: {every: "2", start: "0"}\n')
    config = load_config(path)
    assert (config.num_experts, config.moe_layers.every, config.moe_layers.start) == (4, 2, 0)
