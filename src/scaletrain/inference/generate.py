"""Completions from a trained model through transformers' `generate` (its KV cache, greedy search and sampling):
the model is the family's transformers counterpart built in memory from the weights (models/*: the HF adapter's
`causal_lm`; the built-in Llama becomes a LlamaForCausalLM), so no sampling loop is written here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from scaletrain.models.spec import ModelSpec


@dataclass(frozen=True)
class GenerationOptions:
    max_new_tokens: int = 64  # tokens generated at most (the stop tokens end a completion earlier)
    temperature: float = 0.0  # 0: greedy; > 0: sampling at this temperature
    top_p: float = 1.0  # sampling: the smallest set of tokens whose probabilities add up to this
    seed: int | None = None  # sampling: the random seed (None: torch's current state)


def causal_lm(weights: dict[str, torch.Tensor], spec: ModelSpec, device: torch.device | str = "cpu") -> Any:
    """The transformers model of `spec` holding `weights` (the family's names), on `device`, in eval mode."""
    from scaletrain.models.library_noise import quiet_imports

    hf = spec.hf
    if hf is None:
        raise ValueError(f"PATH: the {spec.family} model family has no transformers counterpart to generate with")
    with quiet_imports():
        model = hf.causal_lm(weights)
    return model.to(device)


def generate(model: Any, prompt_ids: list[int], stop_ids: list[int], options: GenerationOptions) -> list[int]:
    """The completion's ids after `prompt_ids` (stop token left out), from transformers' `generate`."""
    import torch

    if not prompt_ids:
        raise ValueError("--prompt: the prompt encodes to no tokens; give some text")
    if options.seed is not None:
        torch.manual_seed(options.seed)
    sample = options.temperature > 0
    sampling: dict[str, Any] = (
        {"temperature": options.temperature, "top_p": options.top_p, "top_k": None}
        if sample
        else {"temperature": None, "top_p": None, "top_k": None}  # the model's own sampling defaults left out
    )
    device = next(model.parameters()).device
    inputs = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    with torch.no_grad():
        out = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=options.max_new_tokens,
            do_sample=sample,
            use_cache=True,
            eos_token_id=stop_ids or None,
            pad_token_id=stop_ids[0] if stop_ids else 0,
            **sampling,
        )
    completion = out[0, len(prompt_ids) :].tolist()
    for k, token in enumerate(completion):
        if token in stop_ids:
            return completion[:k]
    return completion
