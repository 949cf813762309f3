"""lit3d 0.3's module names still lead to their modules after the move into folders (`lit3d.moved`): a user's import, a
YAML ``class_path`` and a pickle that names a class by its old module."""

import importlib
import pickle

import pytest

from lit3d.moved import MOVED


@pytest.mark.parametrize("old", ["lit3d.gpt", "lit3d.config", "lit3d.lora_settings", "lit3d.strategies.checkpoint"])
def test_an_old_name_is_the_new_module_itself(old):
    module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    assert module.__name__ == module.__spec__.name == MOVED[old]  # its own name and spec, not the old name's


def test_a_pickle_that_names_a_class_by_its_old_module_loads_the_class():
    from lit3d.models.lora_settings import LoRA

    old_pickle = b"\x80\x02clit3d.lora_settings\nLoRA\nq\x00."  # GLOBAL 'lit3d.lora_settings LoRA', as 0.3 wrote it
    assert pickle.loads(old_pickle) is LoRA


def test_a_yaml_class_path_of_the_old_layout_builds_the_model():
    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningModule

    from lit3d.models.gpt import GPT

    parser = ArgumentParser()
    parser.add_subclass_arguments(LightningModule, "model", required=True)
    config = parser.parse_args(["--model=lit3d.gpt.GPT", "--model.init_args.config=tiny"])
    assert type(parser.instantiate_classes(config).model) is GPT


def test_every_old_name_points_at_a_module_that_exists():
    missing = [new for new in MOVED.values() if importlib.util.find_spec(new) is None]
    assert not missing
