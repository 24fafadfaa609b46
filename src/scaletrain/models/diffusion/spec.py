"""The diffusion spec's answers: diffusers' own denoiser (UNet2DModel, DiTTransformer2DModel) built on meta, its
weights those diffusers' constructor initialises (run once on the CPU from the job's seed, so every layout starts
equal) or the folder's safetensors, its blocks (a UNet's up blocks, a DiT's transformer blocks), the DDPM
scheduler the diffusion task draws its noise from, and a diffusers folder as its export."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from scaletrain.config.errors import FieldError
from scaletrain.models.diffusion.args import MODEL_FOLDERS, SCHEDULER_DEFAULTS, DiffusionArgs
from scaletrain.models.spec import CONFIG_TP_WORDS, FolderExport, ModelSpec, TPWords, check_tp_divides

if TYPE_CHECKING:
    import torch
    from torch import nn

FIELD = "model.diffusers"
WEIGHTS_NAME = "diffusion_pytorch_model"  # what diffusers' save_pretrained calls a model's weights
# the container of repeated blocks (the unit of FSDP, activation checkpointing and compile) per class
BLOCKS = {"UNet2DModel": "up_blocks", "DiTTransformer2DModel": "transformer_blocks"}
# the config key that holds a class-conditional model's class count per class (0 / None: unconditional)
CLASS_KEYS = {"UNet2DModel": "num_class_embeds", "DiTTransformer2DModel": "num_embeds_ada_norm"}


def _sample_only(module, args, output):
    """Forward hook: the task wants the prediction tensor, diffusers returns an output dataclass."""
    return output.sample if hasattr(output, "sample") else output


def _shape_config(config: dict) -> dict:
    """A diffusers config without its bookkeeping (`_class_name`, `_diffusers_version`, `_use_default_values`)."""
    return {k: v for k, v in config.items() if not k.startswith("_")}


def _read_json(path: Path) -> dict:
    try:
        body = json.loads(path.read_text())
    except OSError:
        raise FieldError(FIELD, f"{path} cannot be read") from None
    except ValueError as e:
        raise FieldError(FIELD, f"{path} is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise FieldError(FIELD, f"{path} is not a JSON object")
    return body


def read_diffusers_folder(path: str) -> DiffusionArgs:
    """DiffusionArgs of a pipeline folder (model_index.json + unet/ or transformer/ + scheduler/) or of one model's
    folder (config.json naming a class this family builds); FieldError (one line, model.diffusers) otherwise."""
    folder = Path(path)
    if not folder.is_dir():
        raise FieldError(FIELD, f"{path!r} is not a folder; point it at a diffusers pipeline or model folder")
    supported = ", ".join(MODEL_FOLDERS)
    scheduler: dict = {}
    if (folder / "model_index.json").is_file():
        index = _read_json(folder / "model_index.json")
        found = [(name, entry[1]) for name, entry in index.items()
                 if isinstance(entry, list) and len(entry) == 2 and entry[1] in MODEL_FOLDERS]  # fmt: skip
        if not found:
            raise FieldError(FIELD, f"{folder / 'model_index.json'} names no denoiser this family builds "
                                    f"({supported})")  # fmt: skip
        if "scheduler" not in index or not (folder / "scheduler" / "scheduler_config.json").is_file():
            raise FieldError(FIELD, f"{path} has no scheduler (scheduler/scheduler_config.json); the diffusion task "
                                    f"draws its noise from it: add one, e.g. DDPMScheduler().save_pretrained("
                                    f"'{path}/scheduler')")  # fmt: skip
        scheduler = _read_json(folder / "scheduler" / "scheduler_config.json")
        model_folder = folder / found[0][0]
    else:
        model_folder = folder
    if not (model_folder / "config.json").is_file():
        raise FieldError(FIELD, f"{model_folder} has no config.json; point it at a folder diffusers' save_pretrained "
                                f"wrote")  # fmt: skip
    config = _read_json(model_folder / "config.json")
    model_class = config.get("_class_name")
    if model_class not in MODEL_FOLDERS:
        raise FieldError(FIELD, f"{model_folder / 'config.json'} is a {model_class or 'model of no _class_name'}; "
                                f"this family builds {supported}")  # fmt: skip
    known = {k: v for k, v in scheduler.items() if not k.startswith("_") or k == "_class_name"}
    return DiffusionArgs(model_class=str(model_class), config=json.dumps(_shape_config(config), sort_keys=True),
                         scheduler=json.dumps(known, sort_keys=True), path=str(model_folder.resolve()))  # fmt: skip


def _has_weights(folder: str) -> bool:
    return bool(folder) and any(Path(folder).glob("*.safetensors"))


def _same_type(value: object, like: object) -> bool:
    if isinstance(like, float) and isinstance(value, int) and not isinstance(value, bool):
        return True  # 1 where 1.0 is meant
    return type(value) is type(like) or (like is None and not isinstance(value, (dict, list)))


class DiffusionSpec(ModelSpec):
    family = "diffusion"
    args_type = DiffusionArgs
    selected_by = "diffusers"  # model.diffusers = FOLDER

    args: DiffusionArgs

    # -- construction ---------------------------------------------------------------------------------------
    @classmethod
    def from_section(cls, keys: dict[str, Any], preset: Any | None) -> DiffusionSpec:
        """model.diffusers = FOLDER (+ the scheduler's keys), or a preset whose diffusers config fields and
        scheduler keys are `[model]` keys (each of the type the preset gives it)."""
        keys = dict(keys)
        if preset is None:
            args = read_diffusers_folder(str(keys.pop("diffusers")))
        else:
            args = preset
        config, scheduler = args.config_dict, json.loads(args.scheduler)
        for key, value in keys.items():
            if key in SCHEDULER_DEFAULTS:
                if not _same_type(value, SCHEDULER_DEFAULTS[key]):
                    raise FieldError(f"model.{key}", f"expected {type(SCHEDULER_DEFAULTS[key]).__name__} (got "
                                                     f"{value!r})")  # fmt: skip
                scheduler[key] = value
            elif preset is None:
                raise FieldError(f"model.{key}", f"the shape comes from model.diffusers' config.json; remove "
                                                 f"model.{key}")  # fmt: skip
            elif key not in config:
                known = ", ".join(sorted([*config, *SCHEDULER_DEFAULTS]))
                raise FieldError(f"model.{key}", f"the diffusion family's preset has no such field; it has {known}")
            elif not _same_type(value, config[key]):
                raise FieldError(f"model.{key}", f"expected {type(config[key]).__name__} (got {value!r})")
            else:
                config[key] = value
        args = replace(args, config=json.dumps(config, sort_keys=True), scheduler=json.dumps(scheduler, sort_keys=True))
        spec = cls(args)
        spec.check()
        return spec

    def with_classes(self, count: int) -> DiffusionSpec:
        """This model conditioned on `count` classes (a class embedding of that many rows)."""
        config = self.args.config_dict
        config[CLASS_KEYS[self.args.model_class]] = count
        return type(self)(replace(self.args, config=json.dumps(config, sort_keys=True)))

    def _model_class(self) -> Any:
        from scaletrain.models.library_noise import quiet_imports

        with quiet_imports():
            import diffusers

            return getattr(diffusers, self.args.model_class)

    @cached_property
    def meta_model(self) -> nn.Module:
        return self.build("meta")

    def check(self) -> None:
        if self.args.model_class not in MODEL_FOLDERS:
            raise FieldError("model.diffusers", f"{self.args.model_class} is not a denoiser this family builds")
        s = self.args.scheduler_dict
        if s["prediction_type"] not in ("epsilon", "v_prediction", "sample"):
            raise FieldError("model.prediction_type", f"give epsilon, v_prediction or sample (got "
                                                      f"{s['prediction_type']!r})")  # fmt: skip
        if not isinstance(s["num_train_timesteps"], int) or s["num_train_timesteps"] < 1:
            raise FieldError("model.num_train_timesteps", f"give a step count >= 1 (got {s['num_train_timesteps']!r})")
        try:
            self.meta_model  # noqa: B018 (builds: a config diffusers refuses is refused here, before launch)
            self.scheduler()
        except (TypeError, ValueError, NotImplementedError) as e:
            raise FieldError("model.diffusers" if self.args.path else "model.name",
                             f"diffusers cannot build this {self.args.model_class}: {e}") from None  # fmt: skip

    def build(self, device: torch.device | str = "meta") -> nn.Module:
        import torch

        with torch.device(device):
            model = cast("nn.Module", self._model_class()(**self.args.config_dict))
        for m in model.modules():
            # a DiT drops class labels at random for classifier-free guidance from torch's global generator, which
            # differs by rank: no layout could match one process; the label dropout is not trained here
            if type(m).__name__ == "LabelEmbedding":
                cast(Any, m).dropout_prob = 0.0
        model.train()
        model.register_forward_hook(_sample_only)
        return model

    def scheduler(self) -> Any:
        """diffusers' DDPMScheduler of this model (its forward process: the noise the task adds at each step)."""
        from scaletrain.models.library_noise import quiet_imports

        with quiet_imports():
            from diffusers import DDPMScheduler

        config = {k: v for k, v in self.args.scheduler_dict.items() if not k.startswith("_")}
        return DDPMScheduler.from_config(config)

    def param_init_std(self, name: str) -> float | None:
        raise NotImplementedError("the diffusion family initialises by running diffusers' constructor (init_weights)")

    def init_weights(self, model: nn.Module, seed: int) -> None:
        """The folder's safetensors weights when it has any, else diffusers' own initialisation run once on the
        CPU with torch seeded from `seed` (the global generator restored after); each rank keeps its shard.
        Non-persistent buffers (a DiT's position table), which to_empty() leaves garbage, come from that build."""
        import torch

        from scaletrain.models.full_state import copy_full_state
        from scaletrain.models.naming import plain_param_name

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            reference = self.build("cpu")
        state = reference.state_dict()
        if _has_weights(self.args.path):
            from safetensors.torch import load_file

            state = {}
            for f in sorted(Path(self.args.path).glob("*.safetensors")):
                state.update(load_file(str(f)))
        copy_full_state(model, state)
        buffers = dict(reference.named_buffers())
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                whole = buffers[plain_param_name(name)]
                local = buffer.to_local() if hasattr(buffer, "to_local") else buffer  # TP: a replicated DTensor
                local.copy_(whole)

    # -- structure ------------------------------------------------------------------------------------------
    def called_outside_their_block(self, model: nn.Module) -> list[nn.Module]:
        """A DiT's output layer takes its conditioning from the first block's timestep/class embedding
        (transformer_blocks[0].norm1.emb, called again after the last block)."""
        if self.args.model_class != "DiTTransformer2DModel":
            return []
        first = cast(Any, model).transformer_blocks[0]
        return [first.norm1.emb]

    # -- tensor parallelism ---------------------------------------------------------------------------------
    def check_tp(self, tp: int, words: TPWords = CONFIG_TP_WORDS) -> None:
        """A DiT splits its attention heads and MLP over tp ranks (Megatron's column-then-row pairs); a UNet
        (convolutions) has no plan."""
        if self.args.model_class != "DiTTransformer2DModel":
            super().check_tp(tp, words)
        config = cast(Any, self.meta_model).config
        words = words if words.config is not None else replace(words, config="model.")
        check_tp_divides(tp, words, num_attention_heads=int(config.num_attention_heads))

    def tp_plan(self, model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
        """Per DiT block: to_q/to_k/to_v and the MLP's first projection column-wise (each rank a share of the heads
        and of the MLP), to_out and the MLP's second row-wise (outputs summed over the ranks); every other module
        with weights (patch embedding, the adaLN-Zero conditioning, the output layers) replicated. diffusers'
        attention reshapes by its `heads` attribute, which becomes this rank's share of the heads."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from scaletrain.models.vision.tp import Replicated

        if sequence_parallel:
            raise ValueError("parallel.sequence_parallel: not built for diffusion models; set it false")
        if self.args.model_class != "DiTTransformer2DModel":
            return super().tp_plan(model, sequence_parallel, loss_parallel)
        plan: dict = {"pos_embed": Replicated(), "proj_out_1": Replicated(), "proj_out_2": Replicated()}
        for key, block in enumerate(cast(Any, model).transformer_blocks):
            p = f"transformer_blocks.{key}."
            for part in ("norm1.emb.timestep_embedder", "norm1.emb.class_embedder", "norm1.linear"):
                plan[p + part] = Replicated()
            for linear in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "ff.net.0.proj"):
                plan[p + linear] = ColwiseParallel()
            for linear in ("attn1.to_out.0", "ff.net.2"):
                plan[p + linear] = RowwiseParallel()
            head_dim = block.attn1.to_q.out_features // block.attn1.heads
            block.attn1.register_forward_pre_hook(partial(_local_heads, head_dim=head_dim))
        return plan

    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        return cast("nn.ModuleDict", model.get_submodule(BLOCKS[self.args.model_class]))

    def stage(self, model: nn.Module, stage: int, n_stages: int, bounds: tuple[int, int]) -> nn.Module:
        raise ValueError("parallel.pp: the diffusion family has no pipeline cut; use parallel.pp=1")

    def check_pp(self, pp: int) -> None:
        if pp > 1:
            raise ValueError("parallel.pp: the diffusion family has no pipeline cut; use parallel.pp=1")

    def has_output(self, model: nn.Module) -> bool:
        return True

    # -- what the diffusion task asks -----------------------------------------------------------------------
    @property
    def image_size(self) -> int:
        size = self.args.config_dict.get("sample_size") or 0
        return int(size[0] if isinstance(size, (list, tuple)) else size)

    @property
    def num_channels(self) -> int:
        return int(self.args.config_dict.get("in_channels") or 3)

    @property
    def out_channels(self) -> int:
        return int(self.args.config_dict.get("out_channels") or self.num_channels)

    @property
    def num_classes(self) -> int:
        """Classes the model is conditioned on; 0 for an unconditional model."""
        return int(self.args.config_dict.get(CLASS_KEYS[self.args.model_class]) or 0)

    def example_inputs(self, samples: int) -> tuple[tuple[torch.Tensor, ...], dict]:
        """One micro-batch as the diffusion task feeds the forward (tasks/diffusion.py inputs): x_t, the timesteps
        and, for a class-conditional model, the classes; what the planner traces (plan/trace.py)."""
        import torch

        size, channels = self.image_size, self.num_channels
        noisy = torch.zeros((samples, channels, size, size))
        timesteps = torch.zeros((samples,), dtype=torch.int64)
        if self.num_classes:
            return (noisy, timesteps, torch.zeros((samples,), dtype=torch.int64)), {}
        return (noisy, timesteps), {}

    # -- numbers --------------------------------------------------------------------------------------------
    def num_params(self) -> int:
        return sum(p.numel() for p in self.meta_model.parameters())

    @property
    def model_name(self) -> str:
        return self.args.model_class

    def describe(self) -> str:
        s = self.args.scheduler_dict
        classes = f", {self.num_classes} classes" if self.num_classes else ""
        return (f"{self.args.model_class} ({self.args.path or 'preset'}): {self.num_params() / 1e6:.2f}M params, "
                f"{self.image_size} px{classes}, DDPM {s['num_train_timesteps']} steps, {s['prediction_type']}")  # fmt: skip

    # -- checkpoints ----------------------------------------------------------------------------------------
    def export_folder(self, fmt: str) -> FolderExport | None:
        return DiffusersFolder(self) if fmt == "diffusers" else None


class DiffusersFolder(FolderExport):
    """A folder as diffusers' save_pretrained writes it. Our names are diffusers' own (the model is diffusers'),
    so the weights are written as they are, under unet/ (or transformer/), with the scheduler beside them; a UNet's
    folder is a DDPMPipeline (model_index.json), which `DiffusionPipeline.from_pretrained` loads. A pixel-space DiT
    has no diffusers pipeline (DiTPipeline decodes latents with a VAE): its folder holds the model and the
    scheduler, each loaded by its own class's from_pretrained."""

    weights_name = WEIGHTS_NAME

    def __init__(self, spec: DiffusionSpec):
        self.spec = spec
        self.weights_folder = MODEL_FOLDERS[spec.args.model_class]

    def convert(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(state)

    def write_config(self, out: Path) -> list[Path]:
        import diffusers

        version, args = diffusers.__version__, self.spec.args
        scheduler = {k: v for k, v in json.loads(args.scheduler).items() if k != "_class_name"}
        scheduler_class = json.loads(args.scheduler).get("_class_name", "DDPMScheduler")
        files = {
            out / self.weights_folder / "config.json": {"_class_name": args.model_class, "_diffusers_version": version,
                                                       **args.config_dict},
            out / "scheduler" / "scheduler_config.json": {"_class_name": scheduler_class,
                                                          "_diffusers_version": version,
                                                          **SCHEDULER_DEFAULTS, **scheduler},
        }  # fmt: skip
        if args.model_class == "UNet2DModel":
            files[out / "model_index.json"] = {"_class_name": "DDPMPipeline", "_diffusers_version": version,
                                               "scheduler": ["diffusers", scheduler_class],
                                               "unet": ["diffusers", "UNet2DModel"]}  # fmt: skip
        for path, body in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
        return list(files)


def _local_heads(attention: nn.Module, args: tuple, head_dim: int) -> None:
    """Forward pre-hook of a TP-split diffusers Attention: its `heads` (by which it reshapes q, k and v) becomes
    the heads of this rank's column share of to_q."""
    weight = cast(Any, attention).to_q.weight
    rows = weight.to_local().shape[0] if hasattr(weight, "to_local") else weight.shape[0]
    cast(Any, attention).heads = rows // head_dim
