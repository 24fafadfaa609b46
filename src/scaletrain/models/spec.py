"""The seam between a model family and everything else: a `ModelSpec` answers every question the trainer, the
parallel layouts, checkpoints and the planner ask of a model, so none of them names a model's modules.

A family is one folder under `models/` whose package exports `SPEC` (a ModelSpec subclass) and `PRESETS`
({name: args}); the registry finds it (models/registry.py). What a spec answers:

- build on the meta device (`build`), fill weights deterministically by parameter name (`init_weights`);
- the ordered container of its blocks (`blocks`): the one rule FSDP, activation checkpointing, compile and the
  pipeline split use; keys are the global block index, so a pipeline stage keeps the whole model's names;
- how to cut a pipeline stage (`stage`) and the training cost of each block (`layer_costs`) to balance the cut;
- its tensor-parallel plan (`tp_plan`) and what tensor parallelism needs to divide (`check_tp`);
- whether its attention can be split over a sequence (`supports_cp`) and the hook that does it (`context_parallel`);
- FLOPs per token, parameter count, the decoder shape the planner models (`shape`; None for a model the planner
  cannot model); a vocabulary and a context length only where the model has them (a task asks: tasks/);
- its `[model]` keys: the fields of its args dataclass, checked strictly (`from_section`); a family chosen by a key
  of its own rather than by a preset names that key (`selected_by`);
- its manifest entry (`manifest`), so a checkpoint rebuilds the model without the job config;
- a Hugging Face state adapter (`hf`), when the family has a transformers counterpart.
"""

from __future__ import annotations

import dataclasses
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, cast

from pydantic import Field

from scaletrain.config.schema import MAX_MODEL_DIM, MAX_TOKENS_PER_SEQUENCE
from scaletrain.models.naming import is_adapter_name, plain_param_name

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from torch import nn


LOSS_CHUNK_TOKENS = 1024  # tokens per cross-entropy chunk (models/loss.py); the planner counts one chunk

# a count of units (a `[model]` key: the family checks it strictly, config/fields.py)
ModelDim = Annotated[int, Field(gt=0, le=MAX_MODEL_DIM)]
SeqLen = Annotated[int, Field(gt=0, le=MAX_TOKENS_PER_SEQUENCE)]


@dataclass(frozen=True)
class DecoderShape:
    """The shape of a decoder-only transformer as the planner counts it (untied input and output embeddings)."""

    dim: ModelDim
    n_layers: ModelDim
    n_heads: ModelDim
    n_kv_heads: ModelDim
    ffn_dim: ModelDim
    vocab_size: ModelDim
    max_seq_len: SeqLen
    # "llama": RMSNorm, GQA attention (SDPA/flash), SwiGLU MLP, no biases (the built-in model);
    # "gpt": Megatron's GPT block (Korthikanti et al. 2022): LayerNorm, multi-head attention with the scores
    # materialised (softmax, dropout), GELU MLP, biases everywhere; the planner models it to check itself against
    # published Megatron-LM runs. Not a `[model]` key: a family builds its own block
    block: str = dataclasses.field(default="llama", metadata={"config": False})

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count: attention (GQA), SwiGLU MLP, two norms per block, final norm, output (+ embedding);
        the GPT block: attention and a 2-matrix GELU MLP with biases, LayerNorms with biases."""
        if self.block == "gpt":
            h, f = self.dim, self.ffn_dim
            per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
            emb = self.vocab_size * self.dim
            return self.n_layers * per_layer + 2 * h + emb + (emb if include_embedding else 0)
        attn = self.dim * self.dim * 2 + 2 * self.dim * self.n_kv_heads * self.head_dim
        mlp = 3 * self.dim * self.ffn_dim
        per_layer = attn + mlp + 2 * self.dim
        emb = self.vocab_size * self.dim
        return self.n_layers * per_layer + self.dim + emb + (emb if include_embedding else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N (non-embedding matmuls plus the output layer) + 12·L·h·s attention,
        the PaLM appendix B convention (also nanoGPT's estimate_mfu)."""
        n = self.num_params(include_embedding=False)
        return 6.0 * n + 12.0 * self.n_layers * self.dim * seq_len


class HFAdapter(ABC):
    """Mapping between a family's state dict and a Hugging Face transformers checkpoint of the same model."""

    @abstractmethod
    def config(self) -> dict:
        """transformers config.json for this model."""

    @abstractmethod
    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our names and layouts -> Hugging Face's, for any subset of the state (export converts a few tensors at a
        time, and plans on meta tensors: no data-dependent step)."""

    @abstractmethod
    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hugging Face names and layouts -> ours (KeyError names a parameter without a mapping)."""

    @abstractmethod
    def check_config(self, hf_config: dict) -> None:
        """ValueError (one line) when a Hugging Face config.json describes another model than this one."""

    def causal_lm(self, state: dict[str, torch.Tensor]) -> Any:
        """A transformers causal LM of this model holding `state` (our names), built in memory on the CPU with its
        KV cache on, for transformers' `generate`: no files written."""
        from transformers import AutoConfig, AutoModelForCausalLM

        fields = dict(self.config())
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        config.use_cache = True
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(self.to_hf(state), strict=True)
        return model.eval()

    def write_config(self, out: Path) -> list[Path]:
        """Write the non-weight files of a transformers folder into `out` (config.json); returns them. The weights
        are written by checkpoint/export.py, a bounded group of `to_hf` outputs at a time."""
        import json

        (out / "config.json").write_text(json.dumps(self.config(), indent=1))
        return [out / "config.json"]


class FolderExport(ABC):
    """A folder another library loads, written by `ckpt export --format <fmt>` for a family that adds that format
    (ModelSpec.export_folder): the weights go to `weights_folder` as `weights_name`.safetensors (sharded with its
    index as that library names them), converted tensor by tensor; `write_config` writes everything else."""

    weights_folder: str = ""  # subfolder of the export holding the weights ("": the export's top)
    weights_name: str = "model"  # file stem of the weights: <stem>.safetensors, <stem>-0000i-of-0000N.safetensors

    @abstractmethod
    def convert(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our names and layouts -> the library's, for any subset of the state (planned on meta tensors)."""

    @abstractmethod
    def write_config(self, out: Path) -> list[Path]:
        """Write the folder's non-weight files under `out`; returns them."""


@dataclass(frozen=True)
class TPWords:
    """What a front end calls the things a tensor-parallel refusal points at (check_tp's one-line errors): the
    trainer's config keys by default (CONFIG_TP_WORDS), setup()'s arguments there (api.py)."""

    tp: str = "parallel.tp"  # the degree
    tp_off: str = "parallel.tp=1"  # the setting that turns it off
    no_plan_fix: str = "use parallel.tp=1"  # the fix when no plan splits the model
    fsdp: str = "parallel.dp_shard=<ranks>, or data_parallel='fsdp' in scaletrain.setup()"  # shard instead
    config: str | None = None  # prefix of the model's config fields; None: the spec's own (model., config.json's)


CONFIG_TP_WORDS = TPWords()


class ModelSpec(ABC):
    """One model family's answers, bound to one shape (`args`, the family's own frozen dataclass)."""

    family: ClassVar[str]
    args_type: ClassVar[type]
    # the `[model]` key that chooses this family by itself, its value where the model comes from (e.g. "hf":
    # model.hf = FOLDER); None: the family is chosen by a preset's name (model.name)
    selected_by: ClassVar[str | None] = None
    # the model's forward takes `positions=` and `documents=` ((B, S) int64) and attends within each document:
    # rows that pack several documents (data.packing = "document") can train it
    packs_documents: ClassVar[bool] = False

    def __init__(self, args: Any):
        self.args = args

    # -- construction ---------------------------------------------------------------------------------------
    @classmethod
    def claims(cls, value: object) -> bool:
        """Whether `model.<selected_by> = value` is this family's, where several families share that key (model.hf
        holds a causal LM's or an image classifier's config.json); a family that overrides this is asked before
        one that keeps the default (it takes whatever is left)."""
        return True

    @classmethod
    def from_section(cls, keys: dict[str, Any], preset: Any | None) -> ModelSpec:
        """This family's spec from the `[model]` keys other than `name` (`preset`: the args model.name picked; None
        when the family was chosen by its `selected_by` key, which is in `keys`). By default every key is a field
        of the args dataclass, checked strictly; ValueError (one line) names the key."""
        if preset is None:
            raise NotImplementedError(f"the {cls.family} family is chosen by model.{cls.selected_by}: read it here")
        return cls.from_overrides(preset, keys)

    @classmethod
    def from_overrides(cls, args: Any, overrides: dict[str, Any]) -> ModelSpec:
        """This family's spec for `args` with `model.*` overrides applied; ValueError names a field the family
        does not have, a value of the wrong type or a shape it cannot build."""
        from scaletrain.config.fields import check_fields

        checked = check_fields("model", f"{cls.family} family", type(args), overrides)
        spec = cls(dataclasses.replace(args, **checked))
        spec.check()
        return spec

    def check(self) -> None:
        """ValueError naming the field when the shape cannot be built."""

    @abstractmethod
    def build(self, device: torch.device | str = "meta") -> nn.Module:
        """The whole model on `device` (default meta: no memory, no time); weights come from init_weights."""

    @abstractmethod
    def param_init_std(self, name: str) -> float | None:
        """Initial std of a parameter by its plain name; None: ones (norm weights); 0.0: zeros (biases)."""

    def init_buffers(self, model: nn.Module) -> None:
        """Recompute non-persistent buffers after `to_empty()` (e.g. rotary tables)."""

    def init_weights(self, model: nn.Module, seed: int) -> None:
        """Fill every parameter deterministically from (seed, plain parameter name), whatever the layout."""
        init_by_name(model, seed, self.param_init_std)
        self.init_buffers(model)

    # -- structure ------------------------------------------------------------------------------------------
    @abstractmethod
    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        """The container of the repeated blocks (keys: global block index as str), on the model or a stage."""

    @abstractmethod
    def stage(self, model: nn.Module, stage: int, n_stages: int, bounds: tuple[int, int]) -> nn.Module:
        """A pipeline stage: a copy of `model` (on meta, copying is free) keeping blocks [bounds) and what the
        first / last stage owns; parameter names stay those of the whole model."""

    @abstractmethod
    def has_output(self, model: nn.Module) -> bool:
        """Does this module (the model or a stage of it) compute the model's output (the logits of an LM)?"""

    def layer_costs(self, seq_len: int) -> list[float]:
        """Training FLOPs per token of each block, embedding on the first, head + loss on the last; without a
        decoder shape, equal costs (the pipeline cut then balances block counts)."""
        from scaletrain.models.stages import layer_costs

        shape = self.shape()
        return layer_costs(shape, seq_len) if shape is not None else [1.0] * self.n_blocks

    def check_pp(self, pp: int) -> None:
        """ValueError (one line) when this family cannot be cut into pipeline stages."""

    def shared_across_stages(self) -> tuple[str, ...]:
        """Plain names of parameters both the first and the last pipeline stage hold a copy of (a tied input
        embedding and output layer): their gradients are summed across the two after every backward."""
        return ()

    # -- tensor parallelism ---------------------------------------------------------------------------------
    def check_tp(self, tp: int, words: TPWords = CONFIG_TP_WORDS) -> None:
        """ValueError (one line, in `words`) when `tp` cannot split this model's heads or matmuls."""
        raise ValueError(f"{words.tp}: the {self.family} family has no tensor-parallel plan; {words.no_plan_fix}")

    def tp_plan(self, model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
        """{module path: ParallelStyle} for `model` (or a stage of it)."""
        raise ValueError(f"parallel.tp: the {self.family} family has no tensor-parallel plan; use parallel.tp=1")

    # -- LoRA -----------------------------------------------------------------------------------------------
    def lora_targets(self) -> list[str]:
        """Module-name suffixes LoRA adapts by default (lora.targets unset): the attention and MLP projections."""
        raise ValueError(f"lora.targets: the {self.family} family names no default LoRA targets; set lora.targets")

    # -- context parallelism --------------------------------------------------------------------------------
    supports_cp: ClassVar[bool] = False  # can each rank hold part of a sequence (causal attention, RoPE positions)?

    def context_parallel(
        self, model: nn.Module, make_core: Callable[[nn.Module], nn.Module], positions: torch.Tensor
    ) -> None:
        """Make `model` (or a stage of it) run on a part of each sequence: every attention core (q, k, v of
        shape (B, H, S, D) -> output) replaced by make_core(old core), positional encodings taken at `positions`
        (int64, the global position of each local token)."""
        raise ValueError(
            f"parallel.cp: the {self.family} family's attention cannot be split over ranks; use parallel.cp=1"
        )

    # -- embedding tables -----------------------------------------------------------------------------------
    def embedding_tables(self) -> str | None:
        """The path of the module (in the built model) holding its embedding tables (`names`, `rows`, `dim`, a `tables`
        ModuleDict of nn.Embedding, forward(ids (B, T)) -> (B, T, D)), which parallel.embedding_sharding splits over
        the data-parallel ranks (parallel/embedding.py); None: the model has none to split (a decoder's token
        embedding is data or tensor parallel like its other weights)."""
        return None

    # -- mixture of experts ---------------------------------------------------------------------------------
    @property
    def splits_experts(self) -> bool:
        """Whether expert parallelism splits this model's experts (expert_modules finds its MoE layers); a model
        with experts laid out otherwise (e.g. transposed, biased ones) is refused parallel.ep and planned as a
        dense model."""
        return False

    @property
    def n_experts(self) -> int | None:
        """Routed experts per MoE block; None for a dense model (expert parallelism refuses it)."""
        return None

    @property
    def experts_per_token(self) -> int | None:
        """Routed experts each token goes to (top-k); None for a dense model."""
        return None

    def called_outside_their_block(self, model: nn.Module) -> list[nn.Module]:
        """Modules of `model` (or a stage of it) that run outside the forward of the block holding them (diffusers'
        DiT computes its output layer's conditioning with its first block's embedding): FSDP2 makes each its own
        unit, gathered whenever it runs, instead of part of a block whose weights are sharded by then."""
        return []

    def expert_modules(self, model: nn.Module) -> list[nn.Module]:
        """The MoE layers of `model` (or a stage of it) expert parallelism lays out (parallel/expert.py): each
        has `experts` (stacked weights, dim 0 the expert), whose tokens use_dispatcher routes."""
        return []

    def use_dispatcher(self, layer: nn.Module, dispatcher: Any) -> None:
        """Make the MoE `layer` (one of expert_modules) run its experts through `dispatcher` (called with the
        (token, expert) rows sorted by expert, the rows per expert and the experts: parallel/expert.py)."""
        cast(Any, layer).dispatcher = dispatcher

    def after_optimizer_step(self, modules: list[nn.Module]) -> dict[str, float]:
        """Run on every rank after each optimizer step over this rank's model parts (e.g. an MoE router's bias
        update); returns metrics of the step for the log ({}: none)."""
        return {}

    # -- numbers --------------------------------------------------------------------------------------------
    # whether shape()'s formulas describe the whole model; False (a vision-language model: its vision tower is outside
    # them): `plan CONFIG` traces it instead (plan/trace.py), and --plan auto refuses it
    planner_formulas: ClassVar[bool] = True

    def shape(self) -> DecoderShape | None:
        """The decoder shape the planner models for this model; None for a model the planner cannot model (which
        then answers the numbers below itself, or leaves them unanswered)."""
        return None

    def _shape(self) -> DecoderShape:
        shape = self.shape()
        if shape is None:
            raise NotImplementedError(f"the {self.family} family has no decoder shape: it must answer this itself")
        return shape

    @property
    def n_blocks(self) -> int:
        """Repeated blocks (the unit of FSDP, activation checkpointing, compile and the pipeline cut)."""
        shape = self.shape()
        return shape.n_layers if shape is not None else len(self.blocks(self.build("meta")))

    @property
    def hidden_dim(self) -> int:
        """Width of the residual stream (what an MoE layer's all-to-all sends per (token, expert) row)."""
        return int(self._shape().dim)

    @property
    def vocab_size(self) -> int | None:
        """Token ids the model embeds; None for a model that takes no token ids (a task that feeds tokens asks)."""
        shape = self.shape()
        return shape.vocab_size if shape is not None else None

    @property
    def max_seq_len(self) -> int | None:
        """Longest sequence the model takes; None where it has no such bound or takes no sequences."""
        shape = self.shape()
        return shape.max_seq_len if shape is not None else None

    def num_params(self) -> int:
        shape = self.shape()
        if shape is not None:
            return shape.num_params()
        return sum(p.numel() for p in self.build("meta").parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (the MFU numerator)."""
        return self._shape().flops_per_token(seq_len)

    # -- checkpoints ----------------------------------------------------------------------------------------
    def manifest(self) -> dict:
        """What a checkpoint records to rebuild this model (registry.spec_from_manifest reads it back)."""
        return {"family": self.family, "args": dataclasses.asdict(self.args)}

    @property
    def hf(self) -> HFAdapter | None:
        """The Hugging Face adapter, or None when the family has no transformers counterpart."""
        return None

    def export_folder(self, fmt: str) -> FolderExport | None:
        """The writer of `ckpt export --format fmt` for a format this family adds beyond the common ones (e.g. a
        diffusion model's `diffusers` pipeline folder); None when the family has no such format."""
        return None

    @property
    def model_name(self) -> str:
        """What the planner and reports call this model: the family, or a more exact name a family knows (an HF
        folder's architecture)."""
        return self.family

    def describe(self) -> str:
        return f"{self.family} {self.args}"


def init_by_name(model: nn.Module, seed: int, std_of: Callable[[str], float | None]) -> None:
    """Fill every parameter of `model` from its own generator seeded by (seed, plain name); each rank keeps its
    shard of DTensors, so a model sharded by FSDP, TP or PP starts from the same numbers as the single-process
    one. Memory: one full parameter at a time."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            clean = plain_param_name(name)
            if is_adapter_name(clean):  # LoRA's own weights: models/lora.py init_adapters fills them
                continue
            std = std_of(clean)
            if std is None:
                full = torch.ones(p.shape, dtype=torch.float32)
            elif std == 0.0:
                full = torch.zeros(p.shape, dtype=torch.float32)
            else:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(clean.encode()))
                full = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            if isinstance(p, DTensor):
                local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(local)
            else:
                p.copy_(full)


def prune_stage(model: nn.Module, blocks: str, bounds: tuple[int, int], drop: tuple[str, ...]) -> nn.Module:
    """A deep copy of `model` keeping the entries [bounds) of its ModuleDict `blocks` and with the attributes in
    `drop` set to None (what another stage owns). The family's forward skips None parts."""
    import copy

    part = copy.deepcopy(model)
    container = getattr(part, blocks)
    start, end = bounds
    for key in list(container.keys()):
        if not start <= int(key) < end:
            del container[key]
    for name in drop:
        setattr(part, name, None)
    return part


def check_tp_divides(tp: int, words: TPWords = CONFIG_TP_WORDS, **sizes: int) -> None:
    """ValueError (one line, naming the field as `words` does; its config prefix defaults to `model.`) when tp does
    not divide one of the model's `sizes` (heads, matmul dims, vocabulary): each rank needs a whole share."""
    prefix = "model." if words.config is None else words.config
    for field, value in sizes.items():
        if value % tp:
            raise ValueError(
                f"{words.tp}: {tp} does not divide {prefix}{field}={value}; "
                f"pick a tp that divides it (each rank needs a whole share)"
            )
