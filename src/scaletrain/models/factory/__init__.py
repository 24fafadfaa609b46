"""A user's own nn.Module through the normal trainer: `model.factory = "package.module:function"` (importable on
the ranks' PYTHONPATH); every other `[model]` key is a keyword argument of the function, and `num_labels` is passed
too when the function takes it (the image-classification task gives the data's class count). Trained on the task
`[task] name` names. No presets: the factory key chooses this family."""

from scaletrain.models.factory.spec import FactoryArgs, FactorySpec

SPEC = FactorySpec
PRESETS: dict[str, FactoryArgs] = {}

__all__ = ["PRESETS", "SPEC", "FactoryArgs", "FactorySpec"]
