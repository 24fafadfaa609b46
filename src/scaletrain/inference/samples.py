"""`train.sample_prompts`: a few prompts answered at each evaluation of a training run, so a user sees what the
model says as it learns, beside the loss (metrics.jsonl's evaluation record, TensorBoard text, the HTML report).

Every rank hands its part of the weights to a full state dict gathered onto rank 0's host memory (torch's
get_model_state_dict, a collective: any data or tensor parallel layout); rank 0 builds the transformers model in
memory and answers greedily (inference/generate.py). Pipeline stages hold different layers on different ranks and
are not gathered: a pipelined run skips the samples and says so once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain.monitor import log

if TYPE_CHECKING:
    import torch
    from torch import nn

    from scaletrain.config.schema import JobConfig
    from scaletrain.models.spec import ModelSpec


class PromptSampler:
    """Answers cfg.train.sample_prompts with the current weights of `module` (the trained, laid-out model of
    `spec`); `answer()` on every rank. pipelined: the model is cut into pipeline stages (not answered)."""

    def __init__(
        self, cfg: JobConfig, spec: ModelSpec, module: nn.Module, rank: int, device: torch.device, pipelined: bool
    ):
        self.cfg, self.spec, self.module, self.rank, self.device = cfg, spec, module, rank, device
        self.prompts = list(cfg.train.sample_prompts)
        self.codec = None
        if not self.prompts:
            return
        if pipelined:
            self.prompts = []
            log.warning("train.sample_prompts: not answered under pipeline parallelism (parallel.pp > 1)")
            return
        if spec.hf is None:
            self.prompts = []
            log.warning("train.sample_prompts: the %s model family has no transformers counterpart", spec.family)
            return
        if rank != 0:
            return
        from scaletrain.inference.source import ModelSource, find_tokenizer
        from scaletrain.inference.text import TextCodec

        try:
            name = find_tokenizer(ModelSource(cfg.run_dir(), "checkpoint", cfg), None)
            self.codec = TextCodec(name, spec.vocab_size or 0)
        except ValueError as e:
            log.warning("train.sample_prompts: not answered: %s", e)

    def answer(self) -> list[dict] | None:
        """[{prompt, answer}] on rank 0 (None elsewhere, or with no prompts); a collective on every rank."""
        if not self.prompts:
            return None
        from scaletrain.inference.generate import GenerationOptions, causal_lm, generate
        from scaletrain.parallel.state import gathered_weights

        # one whole weight at a time, kept on rank 0 only, as plain tensors (fp8's wrappers and a 4-bit base made
        # plain): the sample model is a plain transformers one
        keep = self.rank == 0 and self.codec is not None
        weights = {name: t.float() for name, t in gathered_weights(self.module, keep)}
        if self.rank != 0 or self.codec is None:
            return None
        try:
            model = causal_lm(weights, self.spec, self.device)
            chat = self.codec.template is not None
            stops = self.codec.stop_ids(chat)
            out = []
            for prompt in self.prompts:
                ids = self.codec.chat(prompt) if chat else self.codec.encode(prompt)
                completion = generate(model, ids, stops, GenerationOptions(self.cfg.train.sample_tokens))
                out.append({"prompt": prompt, "answer": self.codec.decode(completion)})
        except (ValueError, KeyError, RuntimeError) as e:  # a sample must never stop the training
            log.warning("train.sample_prompts: not answered from now on: %s", e)
            self.codec = None  # the other ranks still take part in the gather: the collective stays matched
            return None
        return out
