"""The vision spec's answers: transformers' own image classifier (AutoModelForImageClassification's class for the
config) built on meta, its blocks found by structure (a ViT's encoder layers, a ResNet's or ConvNeXt's stages),
weights filled by name or read from the folder's safetensors, and a transformers folder as its export."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from scaletrain.config.errors import FieldError
from scaletrain.models.spec import CONFIG_TP_WORDS, HFAdapter, ModelSpec, TPWords, check_tp_divides, init_by_name
from scaletrain.models.vision.args import VisionArgs

if TYPE_CHECKING:
    import torch
    from torch import nn

# where transformers' vision encoders keep their repeated blocks, below the base model
BLOCK_PATHS = ("encoder.layer", "encoder.layers", "encoder.stages", "stages", "layers")
# model types whose position embeddings fix the input size (a ViT): the task refuses another image size
FIXED_SIZE_TYPES = ("vit", "deit", "beit", "dinov2", "vit_msn")
# keys of a transformers config that are bookkeeping, not the model's shape
_NOT_SHAPE = ("transformers_version", "architectures", "auto_map", "_name_or_path")


def _logits_only(module, args, output):
    """Forward hook: the task wants logits, transformers returns an ImageClassifierOutput."""
    return output.logits if hasattr(output, "logits") else output


def image_classifier_types() -> dict[str, str]:
    """{model_type: class name} of the configs transformers builds as image classifiers (names only, no import of
    the modeling code)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES

    names = MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES.items()
    return {kind: cls if isinstance(cls, str) else cls[0] for kind, cls in names}


class VisionSpec(ModelSpec):
    family = "vision"
    args_type = VisionArgs
    selected_by = "hf"  # model.hf = FOLDER, when its config.json is an image classifier's (claims)

    args: VisionArgs

    # -- construction ---------------------------------------------------------------------------------------
    @classmethod
    def claims(cls, value: object) -> bool:
        """model.hf = FOLDER is this family's when the folder's config.json names an image classifier's type."""
        try:
            config = json.loads((Path(str(value)) / "config.json").read_text())
        except (OSError, ValueError):
            return False
        return isinstance(config, dict) and config.get("model_type") in image_classifier_types()

    @classmethod
    def from_section(cls, keys: dict[str, Any], preset: Any | None) -> VisionSpec:
        """model.hf = FOLDER (+ model.num_labels), or a preset whose transformers config fields are `[model]` keys
        (each of the type the preset gives it)."""
        keys = dict(keys)
        labels = keys.pop("num_labels", 0)
        if not isinstance(labels, int) or isinstance(labels, bool) or labels < 0:
            raise FieldError("model.num_labels", f"give a class count >= 1, or leave it unset (got {labels!r})")
        if preset is None:
            from scaletrain.models.hf.args import read_folder

            folder = keys.pop("hf")
            for key in keys:
                raise ValueError(f"model.{key}: the shape comes from model.hf's config.json; remove model.{key}")
            read = read_folder(folder)
            args = VisionArgs(config=read.config, path=read.path, num_labels=labels)
        else:
            config = preset.config_dict
            for key, value in keys.items():
                if key not in config or key == "model_type":
                    known = ", ".join(sorted(k for k in config if k != "model_type"))
                    raise ValueError(f"model.{key}: the vision family's preset has no such field; it has {known}, "
                                     f"num_labels")  # fmt: skip
                if type(value) is not type(config[key]):
                    raise ValueError(f"model.{key}: expected {type(config[key]).__name__} (got {value!r})")
                config[key] = value
            args = replace(preset, config=json.dumps(config, sort_keys=True), num_labels=labels or preset.num_labels)
        spec = cls(args)
        spec.check()
        return spec

    @classmethod
    def of_model(cls, model: nn.Module) -> VisionSpec:
        """The spec of a live transformers image classifier (`scaletrain.setup()` on a user's model): its own
        config, so job.save() records it and `ckpt export --format hf` writes its folder."""
        config = cast(Any, model).config
        fields = json.loads(config.to_json_string(use_diff=False))
        labels = int(config.num_labels)
        spec = cls(VisionArgs(config=json.dumps(fields, sort_keys=True), num_labels=labels))
        spec.__dict__["meta_model"] = model  # shape questions answered by the model as it is
        return spec

    def with_labels(self, names: list[str]) -> VisionSpec:
        """This model with a head of len(names) classes named `names` (written into the export's id2label)."""
        config = self.args.config_dict
        config["id2label"] = {str(i): name for i, name in enumerate(names)}
        config["label2id"] = {name: i for i, name in enumerate(names)}
        return type(self)(replace(self.args, config=json.dumps(config, sort_keys=True), num_labels=len(names)))

    @cached_property
    def config(self) -> Any:
        """The transformers config object, with the head's class count."""
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        d = {k: v for k, v in self.args.config_dict.items() if k not in _NOT_SHAPE}
        model_type = d.pop("model_type")
        if model_type not in CONFIG_MAPPING:
            raise FieldError("model.hf", f"model_type {model_type!r} is not known to transformers "
                                         f"{transformers.__version__}")  # fmt: skip
        id2label = d.pop("id2label", None)
        d.pop("label2id", None)
        d.pop("num_labels", None)
        labels = self.num_labels
        if id2label and len(id2label) != labels:
            id2label = None  # the classes of another head: the data's count decides
        if id2label:
            d["id2label"] = {int(k): v for k, v in id2label.items()}
            d["label2id"] = {v: int(k) for k, v in id2label.items()}
        else:
            d["num_labels"] = labels
        return CONFIG_MAPPING[model_type](**d)

    @property
    def num_labels(self) -> int:
        """Classes of the head: model.num_labels, else the folder's own id2label when it has weights, else 2
        (transformers' default) until the task binds the data's count (VisionSpec.with_labels)."""
        if self.args.num_labels:
            return self.args.num_labels
        id2label = self.args.config_dict.get("id2label")
        return len(id2label) if id2label else 2

    @property
    def labels_given(self) -> bool:
        """Whether the head's class count is fixed (model.num_labels, or a folder with weights for its head)."""
        if self.args.num_labels:
            return True
        from scaletrain.models.hf.weights import has_weights

        return bool(self.args.path) and has_weights(self.args.path)

    @property
    def architecture(self) -> str:
        return image_classifier_types()[self.config.model_type]

    @property
    def model_name(self) -> str:
        return self.architecture

    @property
    def image_size(self) -> int | None:
        """Side of the square images the model takes, in pixels; None when it takes any size (a CNN without
        image_size in its config)."""
        size = getattr(self.config, "image_size", None)
        return int(size[0] if isinstance(size, (list, tuple)) else size) if size else None

    @property
    def fixed_image_size(self) -> bool:
        """Its position embeddings fix the input size (a ViT)."""
        return self.config.model_type in FIXED_SIZE_TYPES

    @property
    def num_channels(self) -> int:
        return int(getattr(self.config, "num_channels", 3))

    def _model_class(self) -> Any:
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING

        from scaletrain.models.library_noise import quiet_imports

        try:
            with quiet_imports():
                return MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING[type(self.config)]
        except KeyError:
            raise FieldError(
                "model.hf", f"{self.config.model_type} is not an image classifier transformers can build"
            ) from None

    @cached_property
    def meta_model(self) -> nn.Module:
        return self.build("meta")

    def check(self) -> None:
        self._model_class()
        self.blocks(self.meta_model)

    def build(self, device: torch.device | str = "meta") -> nn.Module:
        import torch

        with torch.device(device):
            model = self._model_class()._from_config(self.config, dtype=torch.float32)
        model.train()
        model.register_forward_hook(_logits_only)
        return model

    def param_init_std(self, name: str) -> float | None:
        """Matrices and kernels: the config's initializer_range; biases: zeros; other vectors (norm and batch-norm
        weights, layer scales): ones."""
        p = self.meta_model.get_parameter(name)
        if p.dim() >= 2:
            return float(getattr(self.config, "initializer_range", None) or 0.02)
        return 0.0 if name.endswith("bias") else None

    def init_buffers(self, model: nn.Module) -> None:
        """Batch-norm running statistics start at mean 0, variance 1 (to_empty() leaves them garbage)."""
        from torch import nn

        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                m.reset_running_stats()

    def init_weights(self, model: nn.Module, seed: int) -> None:
        """The folder's safetensors weights when it has any, else filled by name from `seed`."""
        self.init_buffers(model)
        if self.args.path:
            from scaletrain.models.hf.weights import has_weights

            if has_weights(self.args.path):
                from scaletrain.models.full_state import copy_full_state

                copy_full_state(model, _read_folder_state(self.args.path))
                return
        init_by_name(model, seed, self.param_init_std)

    # -- structure ------------------------------------------------------------------------------------------
    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        from torch import nn

        prefix = getattr(model, "base_model_prefix", "")
        base = getattr(model, prefix, None) if prefix else None
        base = base if base is not None else model
        for path in BLOCK_PATHS:
            try:
                found = base.get_submodule(path)
            except AttributeError:
                continue
            if isinstance(found, (nn.ModuleList, nn.ModuleDict)) and len(found):
                return cast(nn.ModuleDict, found)
        raise FieldError("model.hf", f"no block list ({', '.join(BLOCK_PATHS)}) found in {type(model).__name__}")

    def stage(self, model: nn.Module, stage: int, n_stages: int, bounds: tuple[int, int]) -> nn.Module:
        raise ValueError("parallel.pp: the vision family has no pipeline cut; use parallel.pp=1")

    def check_pp(self, pp: int) -> None:
        if pp > 1:
            raise ValueError("parallel.pp: the vision family has no pipeline cut; use parallel.pp=1")

    def has_output(self, model: nn.Module) -> bool:
        return True

    # -- tensor parallelism ---------------------------------------------------------------------------------
    def check_tp(self, tp: int, words: TPWords = CONFIG_TP_WORDS) -> None:
        """A ViT splits its attention heads and MLP over tp ranks (Megatron's column-then-row pairs); other
        architectures (convolutions) have no plan."""
        if self.config.model_type != "vit":
            super().check_tp(tp, words)
        c = self.config
        words = words if words.config is not None else replace(words, config="model.")
        check_tp_divides(tp, words, num_attention_heads=int(c.num_attention_heads),
                         intermediate_size=int(c.intermediate_size))  # fmt: skip

    def tp_plan(self, model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
        """Per ViT layer: q/k/v and fc1 column-wise (each rank a share of the heads and of the MLP), o_proj and
        fc2 row-wise (their outputs summed over the ranks); embeddings, norms and the head replicated. The
        attention reshapes to (-1 heads, head_dim), so each rank runs its own heads unchanged."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        if sequence_parallel:
            raise ValueError("parallel.sequence_parallel: not built for vision models; set it false")
        from scaletrain.models.vision.tp import Replicated

        container = self.blocks(model)
        path = next(n for n, m in model.named_modules() if m is container)
        base = path.rpartition(".")[0]
        # every other parameter a replicated DTensor: the optimizer's foreach kernels cannot mix them with plain ones
        plan: dict = {f"{base}.embeddings": Replicated(), f"{base}.layernorm": Replicated(), "classifier": Replicated()}
        for key in container.keys() if hasattr(container, "keys") else map(str, range(len(container))):
            p = f"{path}.{key}."
            plan.update({p + "layernorm_before": Replicated(), p + "layernorm_after": Replicated()})
            plan.update({p + "attention.q_proj": ColwiseParallel(), p + "attention.k_proj": ColwiseParallel(),
                         p + "attention.v_proj": ColwiseParallel(), p + "attention.o_proj": RowwiseParallel(),
                         p + "mlp.fc1": ColwiseParallel(), p + "mlp.fc2": RowwiseParallel()})  # fmt: skip
        return plan

    # -- numbers --------------------------------------------------------------------------------------------
    def num_params(self) -> int:
        return sum(p.numel() for p in self.meta_model.parameters())

    def flops_per_image(self) -> float | None:
        """Training FLOPs per image of a ViT: 6·N per patch token (N: the non-embedding parameters) + 12·L·h·s per
        token for attention (s: patches + the class token), the convention of DecoderShape.flops_per_token; None
        for other architectures."""
        if not self.fixed_image_size:
            return None
        c = self.config
        tokens = (int(c.image_size) // int(c.patch_size)) ** 2 + 1
        embed = sum(p.numel() for n, p in self.meta_model.named_parameters() if ".embeddings." in f".{n}")
        matmul = self.num_params() - embed
        return tokens * (6.0 * matmul + 12.0 * c.num_hidden_layers * c.hidden_size * tokens)

    def describe(self) -> str:
        return (
            f"{self.architecture} ({self.args.path or 'preset'}): {self.num_params() / 1e6:.2f}M params, "
            f"{self.num_labels} classes, {self.image_size or 'any'} px"
        )

    # -- checkpoints ----------------------------------------------------------------------------------------
    @property
    def hf(self) -> HFAdapter:
        return VisionAdapter(self)


def _read_folder_state(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


class VisionAdapter(HFAdapter):
    """Our names are transformers' own (the model is transformers'): the export is its folder as save_pretrained
    writes it, config.json with the data's class names as id2label."""

    def __init__(self, spec: VisionSpec):
        self.spec = spec

    def config(self) -> dict:
        d = self.spec.config.to_dict()
        d["architectures"] = [self.spec.architecture]
        return d

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(state)

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(state)

    def check_config(self, hf_config: dict) -> None:
        if hf_config.get("model_type") != self.spec.config.model_type:
            raise ValueError(
                f"config.json: model_type {hf_config.get('model_type')!r}, the model is {self.spec.config.model_type!r}"
            )

    def causal_lm(self, state: dict[str, torch.Tensor]) -> Any:
        raise ValueError(f"{self.spec.architecture} is an image classifier; it does not generate text")
