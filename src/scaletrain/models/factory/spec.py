"""The factory spec's answers for a module scaletrain knows nothing of: built by the user's function on the meta
device, its blocks found by structure (its largest ModuleList / ModuleDict, as `scaletrain.setup()` finds them),
its weights those the function itself initialises (run once on the CPU from the job's seed, then each rank keeps
its shard), so every layout starts from the same numbers as one process."""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

from scaletrain.config.errors import FieldError
from scaletrain.models.spec import ModelSpec

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class FactoryArgs:
    factory: str  # "package.module:function"
    kwargs: str = "{}"  # the function's keyword arguments (the other `[model]` keys), canonical JSON
    num_labels: int = 0  # classes passed as num_labels= (when the function takes it); 0: from the data

    @property
    def kwargs_dict(self) -> dict[str, Any]:
        return json.loads(self.kwargs)


def import_factory(target: str) -> Callable[..., Any]:
    """The function `target` ("package.module:function") names; FieldError (one line, model.factory) otherwise."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise FieldError("model.factory", f'give "package.module:function" (got {target!r})')
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module may fail in any way while importing
        raise FieldError("model.factory", f"cannot import {module_name!r} ({type(e).__name__}: {e}); put its "
                                          f"folder on PYTHONPATH or fix the module") from None  # fmt: skip
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise FieldError("model.factory", f"module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise FieldError("model.factory", f"{target} is not callable; name a function returning an nn.Module")
    return cast(Callable[..., Any], fn)


class FactorySpec(ModelSpec):
    family = "factory"
    args_type = FactoryArgs
    selected_by = "factory"

    args: FactoryArgs

    @classmethod
    def from_section(cls, keys: dict[str, Any], preset: Any | None) -> FactorySpec:
        keys = dict(keys)
        target = keys.pop("factory")
        if not isinstance(target, str):
            raise FieldError("model.factory", f'give "package.module:function" (got {target!r})')
        labels = keys.pop("num_labels", 0)
        if not isinstance(labels, int) or isinstance(labels, bool) or labels < 0:
            raise FieldError("model.num_labels", f"give a class count >= 1, or leave it unset (got {labels!r})")
        spec = cls(FactoryArgs(target, json.dumps(keys, sort_keys=True), labels))
        spec.check()
        return spec

    @cached_property
    def function(self) -> Callable[..., Any]:
        return import_factory(self.args.factory)

    @property
    def takes_labels(self) -> bool:
        fn = self.function  # a bad factory string is its own error, not "takes no labels"
        try:
            return "num_labels" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return False

    # what the image-classification task asks
    @property
    def num_labels(self) -> int:
        return self.args.num_labels

    @property
    def labels_given(self) -> bool:
        """The head's classes are fixed: model.num_labels, or a function that does not take num_labels."""
        return bool(self.args.num_labels) or not self.takes_labels

    def with_labels(self, names: list[str]) -> FactorySpec:
        return type(self)(replace(self.args, num_labels=len(names)))

    image_size = property(lambda self: self.args.kwargs_dict.get("image_size"))
    num_channels = property(lambda self: self.args.kwargs_dict.get("num_channels", 3))

    # what the causal-lm task asks: the function's own vocab_size / max_seq_len arguments
    @property
    def vocab_size(self) -> int | None:
        return self.args.kwargs_dict.get("vocab_size")

    @property
    def max_seq_len(self) -> int | None:
        return self.args.kwargs_dict.get("max_seq_len")

    def _call(self) -> nn.Module:
        from torch import nn

        fn, kwargs = self.function, self.args.kwargs_dict
        if self.takes_labels:  # 2 (transformers' default) until the task binds the data's classes
            kwargs["num_labels"] = self.args.num_labels or 2
        try:
            model = fn(**kwargs)
        except Exception as e:  # the user's code: name it in one line
            raise FieldError("model.factory", f"{self.args.factory}({', '.join(kwargs)}) failed: "
                                              f"{type(e).__name__}: {e}") from None  # fmt: skip
        if not isinstance(model, nn.Module):
            raise FieldError("model.factory", f"{self.args.factory} returned {type(model).__name__}, not a torch "
                                              f"nn.Module")  # fmt: skip
        return model

    @cached_property
    def meta_model(self) -> nn.Module:
        return self.build("meta")

    def check(self) -> None:
        self.blocks(self.meta_model)

    def build(self, device: torch.device | str = "meta") -> nn.Module:
        import torch

        with torch.device(device):
            model = self._call()
        return model.train()

    def param_init_std(self, name: str) -> float | None:
        raise NotImplementedError("the factory family initialises by running the user's function (init_weights)")

    def init_weights(self, model: nn.Module, seed: int) -> None:
        """The function's own initialisation, run once on the CPU with torch seeded from `seed` (the global
        generator restored after), copied into `model` (each rank keeps its shard)."""
        import torch

        from scaletrain.models.full_state import copy_full_state

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            full = self.build("cpu")
        copy_full_state(model, full.state_dict())

    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        from torch import nn

        # the rule scaletrain.setup() follows for a model without a spec (parallel/blocks.py; models/ sits below
        # parallel/, so it is written here again): its largest ModuleList / ModuleDict
        found: nn.ModuleList | nn.ModuleDict | None = None
        for m in model.modules():
            if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) and (found is None or len(m) > len(found)):
                found = m
        if found is None:
            raise FieldError("model.factory", f"{type(model).__name__} holds no nn.ModuleList or nn.ModuleDict of "
                                              f"blocks (the unit of FSDP and activation checkpointing); keep its "
                                              f"repeated layers in one")  # fmt: skip
        return cast("nn.ModuleDict", found)

    def stage(self, model: nn.Module, stage: int, n_stages: int, bounds: tuple[int, int]) -> nn.Module:
        raise ValueError("parallel.pp: a model.factory module has no pipeline cut; use parallel.pp=1")

    def check_pp(self, pp: int) -> None:
        if pp > 1:
            raise ValueError("parallel.pp: a model.factory module has no pipeline cut; use parallel.pp=1")

    def has_output(self, model: nn.Module) -> bool:
        return True

    @property
    def model_name(self) -> str:
        return self.args.factory

    def describe(self) -> str:
        return f"{self.args.factory}({self.args.kwargs}): {self.num_params() / 1e6:.2f}M params"
