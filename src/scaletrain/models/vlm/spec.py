"""The vision-language spec's answers: transformers' own LLaVA-style model (AutoModelForImageTextToText's class for
the config) built on meta; everything a causal LM answers (weights by name or from the folder's safetensors, the
language model's decoder layers as the sharding units, its `base_model_tp_plan` for tensor parallelism, the
export as a save_pretrained folder) from the HF family, the text config standing for the model's shape; the vision
tower and the projector join the root unit (FSDP) or are replicated (TP). The processor (AutoProcessor) comes from
the same folder and is checked against the vision tower before launch (`check_processor`)."""

from __future__ import annotations

import json
import shutil
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from scaletrain.config.errors import FieldError
from scaletrain.models.hf.spec import LAYER_LISTS, HFSpec
from scaletrain.models.hf.weights import HFFolderAdapter
from scaletrain.models.vlm.args import VLMArgs, freeze_parts

if TYPE_CHECKING:
    from torch import nn

    from scaletrain.models.spec import HFAdapter

SUPPORTED = ("LlavaForConditionalGeneration",)  # forwards taking (input_ids, pixel_values) of whole images
# what a vision tower computes after the hidden states LLaVA reads (vision_feature_layer): never in the loss
UNUSED_TOWER_MODULES = ("post_layernorm", "head", "vision_model.post_layernorm", "vision_model.head")
# what a save_pretrained processor writes beside config.json: copied into an export so it loads with AutoProcessor
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.json", "chat_template.jinja", "tokenizer.model")  # fmt: skip


def image_text_types() -> dict[str, str]:
    """{model_type: class name} of the configs transformers builds as image-text-to-text models (names only)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return {
        kind: cls if isinstance(cls, str) else cls[0]
        for kind, cls in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()
    }


class VLMSpec(HFSpec):
    family = "vlm"
    args_type = VLMArgs  # type: ignore[assignment]
    selected_by = "hf"  # model.hf = FOLDER, when its config.json composes a vision and a text config (claims)
    packs_documents = False

    args: VLMArgs  # type: ignore[assignment]

    @classmethod
    def claims(cls, value: object) -> bool:
        """model.hf = FOLDER is this family's when config.json is an image-text-to-text model's with a vision and a
        text config."""
        try:
            config = json.loads((Path(str(value)) / "config.json").read_text())
        except (OSError, ValueError):
            return False
        return (
            isinstance(config, dict)
            and config.get("model_type") in image_text_types()
            and "vision_config" in config
            and "text_config" in config
        )

    @classmethod
    def from_section(cls, keys: dict[str, Any], preset: Any | None) -> VLMSpec:
        """model.hf = FOLDER, and model.freeze = [parts]."""
        from scaletrain.config.extras import require
        from scaletrain.models.hf.args import read_folder

        require("transformers", "model.hf")
        keys = dict(keys)
        freeze = freeze_parts(keys.pop("freeze", []))
        folder = keys.pop("hf")
        for key in keys:
            raise ValueError(f"model.{key}: the shape comes from model.hf's config.json; keys are hf and freeze")
        if not isinstance(folder, str) or not folder:
            raise FieldError("model.hf", f"give a local Hugging Face model folder (got {folder!r})")
        read = read_folder(folder)
        return cast(VLMSpec, cls.checked(VLMArgs(config=read.config, path=read.path, freeze=freeze)))

    @classmethod
    def of_model(cls, model: nn.Module) -> VLMSpec:
        """The spec of a live LLaVA-style model (`scaletrain.setup()`): its own config, so job.save() records it
        and `ckpt export --format hf` writes its folder."""
        config = cast(Any, model).config
        fields = json.loads(config.to_json_string(use_diff=False))
        fields["architectures"] = [type(model).__name__]
        spec = cls(VLMArgs(config=json.dumps(fields, sort_keys=True)))
        spec.config_fields = f"{type(model).__name__}.config."
        spec.__dict__["config"] = config
        spec.__dict__["meta_model"] = model
        return spec

    @cached_property
    def config(self) -> Any:
        cfg = super().config
        cfg.get_text_config().use_cache = False
        return cfg

    @property
    def architecture(self) -> str:
        return image_text_types().get(self.config.model_type, self.config.model_type)

    @property
    def text_config(self) -> Any:
        return self.config.get_text_config()

    def _model_class(self) -> Any:
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

        from scaletrain.models.library_noise import quiet_imports

        try:
            with quiet_imports():
                cls: Any = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(self.config)]
        except KeyError:
            raise FieldError("model.hf", f"{self.config.model_type} is not an image-text model transformers can "
                                         f"build (AutoModelForImageTextToText)") from None  # fmt: skip
        if cls.__name__ not in SUPPORTED:
            raise FieldError("model.hf", f"{cls.__name__} is not supported yet: the vision-language task trains "
                                         f"LLaVA-style models ({', '.join(SUPPORTED)}: whole images through a "
                                         f"vision tower and a projector into a causal LM)")  # fmt: skip
        return cls

    def _dims(self) -> dict[str, int]:
        c = self.text_config
        hidden, heads = int(c.hidden_size), int(c.num_attention_heads)
        return {
            "hidden_size": hidden,
            "num_hidden_layers": int(c.num_hidden_layers),
            "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(c, "num_key_value_heads", None) or heads),
            "intermediate_size": int(getattr(c, "intermediate_size", None) or 4 * hidden),
            "vocab_size": int(c.vocab_size),
            "max_position_embeddings": int(getattr(c, "max_position_embeddings", None) or 2048),
        }

    @property
    def n_experts(self) -> int | None:
        c = self.text_config
        return int(getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or 0) or None

    @property
    def image_size(self) -> int:
        """Side of the square images the vision tower takes (its position embeddings fix it), in pixels."""
        size = self.config.vision_config.image_size
        return int(size[0] if isinstance(size, (list, tuple)) else size)

    @property
    def num_channels(self) -> int:
        """Colour channels of the images the vision tower takes."""
        return int(getattr(self.config.vision_config, "num_channels", 3))

    @property
    def image_token_id(self) -> int:
        return int(getattr(self.config, "image_token_id", None) or self.config.image_token_index)

    planner_formulas = False  # the decoder formulas would leave the vision tower out: the planner traces the model

    def image_features(self) -> int:
        """Image tokens one image becomes in the language model's input (the projector's outputs per image), from
        the model on meta."""
        import torch

        with torch.no_grad():
            feats = cast(Any, self.meta_model).model.get_image_features(
                pixel_values=torch.empty(1, self.num_channels, self.image_size, self.image_size, device="meta")
            )
        feats = getattr(feats, "pooler_output", feats)
        if isinstance(feats, (list, tuple)):
            feats = feats[0]
        return int(feats.shape[-2]) if feats.dim() >= 2 else 0

    def example_token_inputs(self, samples: int, seq_len: int) -> tuple[tuple[Any, ...], dict]:
        """A micro-batch as the vision-language task feeds it (the planner's trace): each row one image's tokens
        first, then text, and the pixels of one image per row."""
        import torch

        n = self.image_features()
        if n >= seq_len:
            raise ValueError(f"data.seq_len: {seq_len} tokens cannot hold an image's {n} image tokens and any text; "
                             f"raise data.seq_len")  # fmt: skip
        ids = torch.zeros((samples, seq_len), dtype=torch.int64)
        ids[:, :n] = self.image_token_id
        return (ids, torch.zeros((samples, self.num_channels, self.image_size, self.image_size))), {}

    def build_for_trace(self) -> nn.Module:
        """The model on meta for the planner's trace (fake tensors: no values): transformers' check that the image
        tokens match the image features reads a count (a value) and is left out; example_token_inputs makes them
        match."""
        model = self.build("meta")
        inner = cast(Any, model).model
        inner.get_placeholder_mask = lambda input_ids, inputs_embeds, image_features: (
            (input_ids == self.image_token_id).unsqueeze(-1).expand_as(inputs_embeds)
        )
        return model

    # -- construction ---------------------------------------------------------------------------------------
    def parts(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        """{part: its modules} of model.freeze's parts (LlavaForConditionalGeneration's names)."""
        m = cast(Any, model)
        return {"vision": [m.model.vision_tower], "projector": [m.model.multi_modal_projector],
                "language": [m.model.language_model, m.lm_head]}  # fmt: skip

    def build(self, device: Any = "meta") -> nn.Module:
        """transformers' model with the parts model.freeze names left out of training (requires_grad off), and the
        vision tower's modules after the layer LLaVA reads (CLIP's post_layernorm, SigLIP's pooling head) too: the
        model takes the tower's hidden states, so they never get a gradient (DDP would wait for one)."""
        model = super().build(device)
        tower = cast(Any, model).model.vision_tower
        for unused in UNUSED_TOWER_MODULES:
            try:
                tower.get_submodule(unused).requires_grad_(False)
            except AttributeError:
                continue
        parts = self.parts(model)
        for part in self.args.frozen:
            for module in parts[part]:
                module.requires_grad_(False)
        return model

    def param_init_std(self, name: str) -> float | None:
        """The HF family's, and a vision tower's class embedding (a learned vector) drawn like its matrices."""
        if name.rpartition(".")[2] == "class_embedding":
            return float(getattr(self.config.vision_config, "initializer_range", None) or 0.02)
        return super().param_init_std(name)

    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        """The language model's decoder layers (the sharding units; the vision tower joins the root's)."""
        from torch import nn

        decoder = cast(Any, model).get_decoder()
        for attr in LAYER_LISTS:
            found = getattr(decoder, attr, None)
            if isinstance(found, (nn.ModuleList, nn.ModuleDict)) and len(found):
                return cast(nn.ModuleDict, found)
        raise FieldError("model.hf", f"no decoder layer list in {type(model).__name__}'s language model")

    def check_pp(self, pp: int) -> None:
        if pp > 1:
            raise ValueError("parallel.pp: the vision-language family has no pipeline cut yet; use parallel.pp=1")

    def stage(self, model: nn.Module, stage: int, n_stages: int, bounds: tuple[int, int]) -> nn.Module:
        raise ValueError("parallel.pp: the vision-language family has no pipeline cut yet; use parallel.pp=1")

    def check_tp(self, tp: int, words: Any = None) -> None:
        """Refused: transformers' plan of the language model applies (tp.base_plan reads the text config's), but
        the vision tower's non-persistent buffers (init_buffers) are then copied from plain tensors into replicated
        DTensors, which torch 2.13 refuses (aten.copy_ with mixed tensors); not split yet."""
        if tp > 1:
            raise ValueError("parallel.tp: tensor parallelism of a vision-language model is not supported yet; use "
                             "parallel.tp=1 and FSDP (parallel.dp_shard) to spread it")  # fmt: skip

    def tp_plan(self, model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
        raise ValueError("parallel.tp: tensor parallelism of a vision-language model is not supported yet")

    def lora_targets(self) -> list[str]:
        raise ValueError("lora.targets: LoRA on a vision-language model is not built yet; use model.freeze")

    # -- the processor --------------------------------------------------------------------------------------
    def processor(self) -> Any:
        """transformers' AutoProcessor of the folder (its tokenizer and image processor; the PIL image processor,
        torchvision does not import beside the pinned torch); ValueError (one line) when the folder has none."""
        from transformers import AutoProcessor

        from scaletrain.models.library_noise import quiet_imports

        if not self.args.path:
            raise FieldError("model.hf", "the model was rebuilt from a checkpoint without its folder; its "
                                         "processor is unknown")  # fmt: skip
        try:
            with quiet_imports():
                processor = AutoProcessor.from_pretrained(self.args.path, backend="pil")
        except (OSError, ValueError, TypeError) as e:
            raise FieldError("model.hf", f"{self.args.path} has no processor AutoProcessor loads ({type(e).__name__}: "
                                         f"{str(e).splitlines()[0] if str(e) else ''}); save the model's processor "
                                         f"there (processor.save_pretrained)") from None  # fmt: skip
        if not hasattr(processor, "image_processor") or not hasattr(processor, "tokenizer"):
            raise FieldError("model.hf", f"{self.args.path}'s processor ({type(processor).__name__}) has no image "
                                         f"processor and tokenizer; save the VLM's own processor there")  # fmt: skip
        return processor

    def check_processor(self, processor: Any) -> None:
        """The processor makes images of the vision tower's size and as many image tokens per image as the model
        has image features; ValueError (one line naming model.hf) otherwise."""
        import numpy as np
        from PIL import Image

        image = Image.fromarray(np.zeros((37, 23, 3), dtype=np.uint8))
        pixels = processor.image_processor(images=image, return_tensors="pt")["pixel_values"]
        got, want = tuple(pixels.shape[-2:]), (self.image_size, self.image_size)
        if got != want:
            raise FieldError("model.hf", f"the processor makes {got[0]}x{got[1]} images, the vision tower takes "
                                         f"{want[0]}x{want[1]} (vision_config.image_size); make the image "
                                         f"processor's size / crop_size {want[0]}")  # fmt: skip
        text = cast(Any, processor).image_token if hasattr(processor, "image_token") else "<image>"
        ids = processor(text=text, images=image, return_tensors="pt")["input_ids"]
        tokens = int((ids == self.image_token_id).sum())
        n = self.image_features()
        if n and tokens != n:
            raise FieldError("model.hf", f"the processor expands an image into {tokens} image tokens, the model "
                                         f"makes {n} image features; match the processor's patch_size / "
                                         f"num_additional_image_tokens / vision_feature_select_strategy to "
                                         f"config.json's")  # fmt: skip

    def describe(self) -> str:
        v = self.config.vision_config
        frozen = f", frozen: {', '.join(self.args.frozen)}" if self.args.frozen else ""
        return (
            f"{self.architecture} from {self.args.path or 'a checkpoint'}: {self.num_params() / 1e6:.2f}M params, "
            f"{v.model_type} vision tower ({self.image_size} px), {self.text_config.model_type} language model "
            f"({self._dims()['num_hidden_layers']} layers, hidden {self._dims()['hidden_size']}){frozen}"
        )

    def flops_per_token(self, seq_len: int) -> float:
        raise NotImplementedError("no FLOP count for a vision-language model yet")

    @property
    def hf(self) -> HFAdapter:
        return VLMAdapter(self)


class VLMAdapter(HFFolderAdapter):
    """transformers' folder as save_pretrained writes it, with the model's processor files beside it (copied from
    model.hf's folder), so the export loads with AutoModelForImageTextToText and AutoProcessor."""

    def write_config(self, out: Path) -> list[Path]:
        written = super().write_config(out)
        if self.spec.args.path:
            for name in PROCESSOR_FILES:
                src = Path(self.spec.args.path) / name
                if src.is_file():
                    shutil.copyfile(src, out / name)
                    written.append(out / name)
        return written

    def causal_lm(self, state: dict) -> Any:
        raise ValueError(f"{self.spec.architecture} takes images: generate with transformers' own model from "
                         f"`ckpt export --format hf`")  # fmt: skip
