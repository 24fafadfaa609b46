"""The HF spec's answers: transformers' own causal LM built from config.json, read by structure where transformers
does not say (which ModuleList holds the decoder layers), by transformers' own answers where it does (the
`base_model_tp_plan`, `_init_weights` for norms and rotary tables, the input/output embeddings, tying)."""

from __future__ import annotations

from scaletrain.config.errors import FieldError

import copy
import dataclasses
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

from scaletrain.models.hf.args import HFArgs, read_folder
from scaletrain.models.hf.packing import take_packed_rows
from scaletrain.models.spec import (
    CONFIG_TP_WORDS,
    DecoderShape,
    HFAdapter,
    ModelSpec,
    TPWords,
    check_tp_divides,
    init_by_name,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

LAYER_LISTS = ("layers", "h", "blocks", "layer")  # where transformers' decoders keep their layers, in that order


def _logits_only(module, args, output):
    """Forward hook: the trainer wants logits, transformers returns a CausalLMOutput (use_cache is off); a
    pipeline stage returns its tensor itself."""
    return output.logits if hasattr(output, "logits") else output


HF_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class HFSpec(ModelSpec):
    family = "hf"
    args_type = HFArgs
    selected_by = "hf"  # model.hf = FOLDER
    packs_documents = True  # through position_ids (models/hf/packing.py)

    args: HFArgs
    # what the user calls the config's fields, for messages: the folder's config.json, or setup()'s model.config
    config_fields = "model.hf config.json's "

    @classmethod
    def from_section(cls, keys: dict[str, Any], preset: Any | None) -> HFSpec:
        """model.hf = FOLDER and nothing else: the shape comes from the folder's config.json."""
        from scaletrain.config.extras import require

        require("transformers", "model.hf")  # a plain install has no transformers: the hf extra brings it
        for key in keys:
            if key != cls.selected_by:
                raise ValueError(f"model.{key}: the shape comes from model.hf's config.json; remove model.{key}")
        folder = keys[cls.selected_by]
        if not isinstance(folder, str) or not folder:
            raise FieldError("model.hf", f"give a local Hugging Face model folder (got {folder!r})")
        return cls.from_folder(folder)

    @property
    def model_name(self) -> str:
        return self.architecture

    @classmethod
    def from_folder(cls, path: str) -> HFSpec:
        """The spec of a local Hugging Face folder, every check done (config, architecture, weights' names and
        shapes); ValueError (one line naming model.hf) otherwise."""
        return cls.checked(read_folder(path))

    @classmethod
    def checked(cls, args: Any) -> HFSpec:
        """The spec of `args` (a folder's config and path) after every check: the config and architecture, and
        the folder's weights' names and shapes when it has weights."""
        spec = cls(args)
        spec.check()
        if spec.args.path:
            from scaletrain.models.hf.weights import check_weights

            check_weights(spec, spec.args.path)
        return spec

    @classmethod
    def of_model(cls, model: nn.Module) -> HFSpec:
        """The spec of a live transformers model (`scaletrain.setup()` on a user's model): its own config object,
        the model itself answering the shape questions (TP plan, blocks); no folder, no weights."""
        import json

        config = cast(Any, model).config
        fields = json.loads(config.to_json_string(use_diff=False))
        fields["architectures"] = fields.get("architectures") or [type(model).__name__]  # what messages name
        spec = cls(HFArgs(config=json.dumps(fields, sort_keys=True)))
        spec.config_fields = f"{type(model).__name__}.config."
        spec.__dict__["config"] = config  # the cached properties, answered by the model as it is
        spec.__dict__["meta_model"] = model
        return spec

    # -- transformers' view -----------------------------------------------------------------------------------
    @cached_property
    def config(self) -> Any:
        """The transformers config object (attention through torch's scaled_dot_product_attention where the
        model supports it, else transformers' eager attention, e.g. Gemma 2's soft-capping)."""
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        d = dict(self.args.config_dict)
        model_type = d.pop("model_type")
        if model_type not in CONFIG_MAPPING:
            raise FieldError(
                "model.hf",
                f"model_type {model_type!r} is not known to transformers {transformers.__version__}; "
                f"upgrade transformers or pick a supported model",
            )
        for key in ("transformers_version", "architectures", "auto_map"):
            d.pop(key, None)
        cfg = CONFIG_MAPPING[model_type](**d)
        cfg.use_cache = False
        return cfg

    @property
    def architecture(self) -> str:
        archs = self.args.config_dict.get("architectures") or []
        return archs[0] if archs else self.args.config_dict["model_type"]

    def _model_class(self) -> Any:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        from scaletrain.models.library_noise import quiet_imports

        try:
            with quiet_imports():  # the lookup imports the modeling code, and through it torchao
                return MODEL_FOR_CAUSAL_LM_MAPPING[type(self.config)]
        except KeyError:
            raise FieldError(
                "model.hf",
                f"{self.architecture} ({self.config.model_type}) is not a causal language model "
                f"transformers can build (AutoModelForCausalLM); scaletrain trains decoder-only causal LMs",
            ) from None

    @cached_property
    def meta_model(self) -> nn.Module:
        """One instance on the meta device, kept to answer shape questions (free)."""
        return self.build("meta")

    def _dims(self) -> dict[str, int]:
        c = self.config
        hidden, heads = int(c.hidden_size), int(c.num_attention_heads)
        ffn = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden
        return {
            "hidden_size": hidden,
            "num_hidden_layers": int(c.num_hidden_layers),
            "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(c, "num_key_value_heads", None) or heads),
            "intermediate_size": int(ffn),
            "vocab_size": int(c.vocab_size),
            "max_position_embeddings": int(getattr(c, "max_position_embeddings", None) or 2048),
        }

    @property
    def tied(self) -> bool:
        return bool(getattr(self.config.get_text_config(), "tie_word_embeddings", False))

    @property
    def n_experts(self) -> int | None:
        c = self.config
        return int(getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or 0) or None

    @property
    def experts_per_token(self) -> int | None:
        return int(getattr(self.config, "num_experts_per_tok", 0) or 0) or None if self.n_experts else None

    @property
    def splits_experts(self) -> bool:
        """transformers' packed experts in the layout models/hf/experts.py runs, in every MoE layer."""
        from scaletrain.models.hf.experts import splittable

        if not self.n_experts:
            return False
        layers = [m for m in self.meta_model.modules() if hasattr(m, "experts")]
        return bool(layers) and all(splittable(m.experts) for m in layers)

    def expert_modules(self, model: nn.Module) -> list[nn.Module]:
        from scaletrain.models.hf.experts import splittable

        return [m for m in model.modules() if splittable(getattr(m, "experts", None))]

    def use_dispatcher(self, layer: nn.Module, dispatcher: Any) -> None:
        from scaletrain.models.hf.experts import use_dispatcher

        use_dispatcher(cast(Any, layer).experts, dispatcher)

    def after_optimizer_step(self, modules: list[nn.Module]) -> dict[str, float]:
        """The expert-load metrics of packed experts (models/hf/experts.py counts them while training)."""
        if not self.n_experts or not self.splits_experts:
            return {}
        from scaletrain.models.hf.experts import take_load

        return take_load(self, modules)

    # -- construction ---------------------------------------------------------------------------------------
    def check(self) -> None:
        cls = self._model_class()
        if getattr(self.config, "is_encoder_decoder", False):
            raise FieldError(
                "model.hf", f"{self.architecture} is an encoder-decoder; scaletrain trains decoder-only LMs"
            )
        try:
            self._dims()
        except AttributeError as e:
            raise FieldError("model.hf", f"{cls.__name__}'s config lacks a decoder shape field ({e})") from None
        self.blocks(self.meta_model)  # refuses a model whose layers cannot be found

    def build(self, device: torch.device | str = "meta") -> nn.Module:
        import torch

        cls = self._model_class()
        with torch.device(device):
            model = cls._from_config(self.config, dtype=torch.float32)
        model.train()
        model.register_forward_hook(_logits_only)
        take_packed_rows(model)
        if self.n_experts:
            from scaletrain.models.hf.experts import count_load

            for layer in self.expert_modules(model):  # the load metrics of after_optimizer_step
                count_load(cast(Any, layer).experts)
        return model

    def build_for_inference(self, config: Any) -> nn.Module:
        """transformers' model class of this folder from `config`, on the CPU, returning its own outputs (no
        logits-only hook): what `generate` runs."""
        import torch

        return self._model_class()._from_config(config, dtype=torch.float32)

    def param_init_std(self, name: str) -> float | None:
        """Matrices (linears, embeddings, packed experts): transformers' initializer_range; biases: zeros; other
        vectors (norm weights): the constant transformers' own _init_weights gives them (ones, or zeros for
        Gemma's 1-centred norms)."""
        owner, _, leaf = name.rpartition(".")
        p = self.meta_model.get_parameter(name)
        if p.dim() >= 2:
            return float(getattr(self.config, "initializer_range", None) or 0.02)
        if leaf == "bias":
            return 0.0
        return self._vector_init(owner, leaf)

    def _vector_init(self, owner: str, leaf: str) -> float | None:
        import torch

        module = self.meta_model.get_submodule(owner)
        key = (type(module).__name__, leaf)
        cache = self.__dict__.setdefault("_vector_cache", {})
        if key not in cache:
            clone = copy.deepcopy(module).to_empty(device="cpu")
            cast(Any, self.meta_model)._init_weights(clone)
            value = clone.get_parameter(leaf).detach()
            if torch.all(value == 1):
                cache[key] = None
            elif torch.all(value == 0):
                cache[key] = 0.0
            else:
                raise FieldError("model.hf", f"no deterministic init for {type(module).__name__}.{leaf}")
        return cache[key]

    def lora_targets(self) -> list[str]:
        """The Llama-style projection names this model has (q/k/v/o, gate/up/down; Qwen, Mistral, Gemma, ...)."""
        names = {name.rpartition(".")[2] for name, _ in self.meta_model.named_modules()}
        found = [n for n in HF_PROJECTIONS if n in names]
        if not found:
            raise ValueError(
                f"lora.targets: {self.architecture} has none of the usual projections ({', '.join(HF_PROJECTIONS)}); "
                f"set lora.targets to its linear layers' names"
            )
        return found

    def init_buffers(self, model: nn.Module) -> None:
        """Non-persistent buffers (rotary tables, Gemma's embedding scale) are garbage after to_empty():
        transformers' own _init_weights computes them, here on a meta copy whose buffers alone are real."""
        import torch

        for name, module in model.named_modules():
            own = [b for b, _ in module.named_buffers(recurse=False) if b in module._non_persistent_buffers_set]
            if not own:
                continue
            from scaletrain.models.naming import plain_param_name

            clone = copy.deepcopy(self.meta_model.get_submodule(plain_param_name(name)))
            for b in own:
                clone._buffers[b] = torch.zeros_like(cast(torch.Tensor, clone._buffers[b]), device="cpu")
            cast(Any, self.meta_model)._init_weights(clone)
            with torch.no_grad():
                for b in own:
                    cast(torch.Tensor, module._buffers[b]).copy_(cast(torch.Tensor, clone._buffers[b]))

    def tie(self, model: nn.Module) -> None:
        """Make the output layer share the input embedding's weight again (to_empty() and tensor parallelism
        each give a module its own new parameter)."""
        if not self.tied:
            return
        m = cast(Any, model)
        inp, out = m.get_input_embeddings(), m.get_output_embeddings()
        if inp is not None and out is not None and out.weight is not inp.weight:
            out.weight = inp.weight

    def init_weights(self, model: nn.Module, seed: int) -> None:
        """The folder's safetensors weights when it has any (each rank reads only its shards), else filled by
        name from `seed` as every family."""
        self.tie(model)
        self.init_buffers(model)
        if self.args.path:
            from scaletrain.models.hf.weights import has_weights, load_weights

            if has_weights(self.args.path):
                load_weights(model, self.args.path, self)
                return
        init_by_name(model, seed, self.param_init_std)

    # -- structure ------------------------------------------------------------------------------------------
    def _base(self, model: nn.Module) -> tuple[str, nn.Module]:
        prefix = getattr(model, "base_model_prefix", "")
        base = getattr(model, prefix, None) if prefix else None
        return (prefix, base) if base is not None else ("", model)

    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        from torch import nn

        _, base = self._base(model)
        for attr in LAYER_LISTS:
            found = getattr(base, attr, None)
            if isinstance(found, (nn.ModuleList, nn.ModuleDict)) and len(found):
                return cast(nn.ModuleDict, found)  # a ModuleList: parallel/blocks.py reads both
        raise FieldError(
            "model.hf",
            f"no decoder layer list ({', '.join(LAYER_LISTS)}) found in {type(model).__name__}; "
            f"this architecture is not supported",
        )

    def stage(self, model: nn.Module, stage: int, n_stages: int, bounds: tuple[int, int]) -> nn.Module:
        from scaletrain.models.hf.stages import cut_stage

        return cut_stage(self, model, stage, n_stages, bounds)

    def check_pp(self, pp: int) -> None:
        if pp > 1:
            from scaletrain.models.hf.stages import check_stages

            check_stages(self)

    def shared_across_stages(self) -> tuple[str, ...]:
        if not self.tied:
            return ()
        emb = cast(Any, self.meta_model).get_input_embeddings()
        return (next(n for n, m in self.meta_model.named_modules() if m is emb) + ".weight",)

    def has_output(self, model: nn.Module) -> bool:
        return cast(Any, model).get_output_embeddings() is not None

    def layer_costs(self, seq_len: int) -> list[float]:
        from scaletrain.models.stages import layer_costs

        return layer_costs(self._shape(), seq_len)

    # -- tensor parallelism ---------------------------------------------------------------------------------
    def check_tp(self, tp: int, words: TPWords = CONFIG_TP_WORDS) -> None:
        from scaletrain.models.hf.tp import check_plan

        check_plan(self, tp, words)
        d = self._dims()
        sizes = {
            "num_attention_heads": d["num_attention_heads"],
            "num_key_value_heads": d["num_key_value_heads"],
            "intermediate_size": d["intermediate_size"],
            "hidden_size": d["hidden_size"],
            "vocab_size": d["vocab_size"],
        }
        if self.n_experts:
            sizes["num_experts"] = self.n_experts
        if words.config is None:  # the fields are config.json's, not model.*
            words = dataclasses.replace(words, config=self.config_fields)
        check_tp_divides(tp, words, **sizes)

    def tp_plan(self, model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
        from scaletrain.models.hf.tp import hf_tp_plan

        return hf_tp_plan(self, model, sequence_parallel, loss_parallel)

    # -- numbers --------------------------------------------------------------------------------------------
    def shape(self) -> DecoderShape:
        d = self._dims()
        return DecoderShape(
            dim=d["hidden_size"],
            n_layers=d["num_hidden_layers"],
            n_heads=d["num_attention_heads"],
            n_kv_heads=d["num_key_value_heads"],
            ffn_dim=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            max_seq_len=d["max_position_embeddings"],
        )

    def num_params(self) -> int:
        """Exact: counted on the meta model, a tied embedding once."""
        return sum(p.numel() for p in self.meta_model.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """6 x the parameters every token multiplies with (all but an untied input embedding; every expert of a
        mixture counts, an upper bound) + 12·L·h·s attention, the convention of DecoderShape.flops_per_token."""
        m = cast(Any, self.meta_model)
        matmul = self.num_params() - (0 if self.tied else m.get_input_embeddings().weight.numel())
        d = self._dims()
        return 6.0 * matmul + 12.0 * d["num_hidden_layers"] * d["hidden_size"] * seq_len

    def describe(self) -> str:
        d = self._dims()
        extra = f", {self.n_experts} experts" if self.n_experts else ""
        return (
            f"{self.architecture} from {self.args.path or 'a checkpoint'}: {self.num_params() / 1e6:.2f}M params, "
            f"{d['num_hidden_layers']} layers, hidden {d['hidden_size']}, {d['num_attention_heads']} heads "
            f"({d['num_key_value_heads']} KV), FFN {d['intermediate_size']}, vocab {d['vocab_size']}, "
            f"{'tied' if self.tied else 'untied'} embeddings{extra}"
        )

    # -- checkpoints ----------------------------------------------------------------------------------------
    @property
    def hf(self) -> HFAdapter:
        from scaletrain.models.hf.weights import HFFolderAdapter

        return HFFolderAdapter(self)
