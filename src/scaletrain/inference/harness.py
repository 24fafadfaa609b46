"""`scaletrain eval PATH --lm-eval TASKS`: EleutherAI's lm-evaluation-harness (the eval extra) run straight on a
scaletrain checkpoint, without converting it first: the harness asks an `LM` for log-likelihoods and completions,
and this one answers with the family's own model (the one trained, as `eval --data` runs it) for log-likelihoods and
its transformers counterpart (inference/generate.py, KV cache) for completions, tokenized by the run's tokenizer.

Offline: tasks come from the harness's own registry or from `--lm-eval-include DIR` (task YAMLs whose data are local
files); HF_DATASETS_OFFLINE / HF_HUB_OFFLINE are set so nothing is fetched (a task whose data is not local fails in
one line). One process (the checkpoint is read whole, as `generate` reads it).

Tokenization follows the harness's HF model (lm_eval/models/huggingface.py): a context's trailing spaces move to the
continuation, the continuation's ids are the whole text's ids after the context's, and an empty context is
preceded by EOS (bytes without EOS: a newline).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from scaletrain.inference.text import TextCodec
    from scaletrain.models.spec import ModelSpec


def harness_lm(weights: dict[str, torch.Tensor], spec: ModelSpec, codec: TextCodec, device: str, max_length: int):
    """An lm_eval `LM` over `weights` (the family's names); ValueError naming the eval extra when lm-eval is not
    installed."""
    from scaletrain.config.extras import require

    require("lm_eval", "--lm-eval")
    from lm_eval.api.model import LM

    class ScaletrainLM(LM):
        def __init__(self) -> None:
            super().__init__()
            model = spec.build("meta")
            model.to_empty(device=device)
            spec.init_buffers(model)
            model.load_state_dict(weights, strict=True)
            self.model = model.eval()
            self.weights = weights
            self._device = device  # LM's own attribute behind its `device` property
            self.max_length = max_length
            self._generator: Any = None

        @property
        def prefix_id(self) -> int:
            return codec.eos_id if codec.eos_id is not None else codec.encode("\n")[0]

        def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
            """Summed log-probability of `continuation` after `context`, and whether greedy decoding gives it."""
            import torch

            ids = (context + continuation)[-(self.max_length + 1) :]
            inputs = torch.tensor([ids[:-1]], dtype=torch.long, device=device)
            with torch.no_grad():
                logp = torch.log_softmax(self.model(inputs)[0].double(), dim=-1)[-len(continuation) :]
            target = torch.tensor(continuation, device=device)
            greedy = bool((logp.argmax(dim=-1) == target).all())
            return float(logp.gather(1, target[:, None]).sum()), greedy

        def loglikelihood(self, requests) -> list[tuple[float, bool]]:
            out = []
            for request in requests:
                context, continuation = request.args
                spaces = len(context) - len(context.rstrip())
                if spaces:
                    context, continuation = context[:-spaces], context[-spaces:] + continuation
                whole = codec.encode(context + continuation)
                context_ids = codec.encode(context) if context else []
                continuation_ids = whole[len(context_ids) :]
                out.append(self._score(context_ids or [self.prefix_id], continuation_ids))
            return out

        def loglikelihood_rolling(self, requests) -> list[float]:
            from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

            out = []
            for request in requests:
                (text,) = request.args
                windows = get_rolling_token_windows(codec.encode(text), self.prefix_id, self.max_length, 1)
                out.append(sum(self._score(*make_disjoint_window(w))[0] for w in windows))
            return out

        def generate_until(self, requests) -> list[str]:
            from scaletrain.inference.generate import GenerationOptions, causal_lm, generate

            if self._generator is None:
                self._generator = causal_lm(self.weights, spec, device)
            out = []
            for request in requests:
                context, kwargs = request.args
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                options = GenerationOptions(max_new_tokens=int(kwargs.get("max_gen_toks", 256)))
                ids = codec.encode(context)[-self.max_length :] or [self.prefix_id]
                text = codec.decode(generate(self._generator, ids, codec.stop_ids(chat=False), options))
                for stop in until:
                    text = text.split(stop, 1)[0]
                out.append(text)
            return out

    return ScaletrainLM()


def run_harness(lm: Any, tasks: list[str], include: Path | None, limit: int | None, num_fewshot: int | None) -> dict:
    """lm-eval's results for `tasks` on `lm`: {task: {metric: value}} (the harness's `metric,filter` keys);
    ValueError (one line naming the flag) for an unknown task or data that is not available offline."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the harness must read local files only, never fetch
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if include is not None and not include.is_dir():
        raise ValueError(f"--lm-eval-include: {include} is not a folder of task YAML files")
    manager = TaskManager(include_path=str(include) if include is not None else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(
            f"--lm-eval: no task named {', '.join(unknown)}"
            + ("" if include else "; pass --lm-eval-include DIR with its YAML")
        )
    try:
        results = simple_evaluate(
            model=lm, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot, log_samples=False
        )
    except (ConnectionError, OSError) as e:  # datasets/hub offline: the task's data is not on this machine
        raise ValueError(f"--lm-eval: a task's data is not available offline ({type(e).__name__}: {e})") from None
    assert results is not None  # one process: the harness returns results on rank 0
    return {
        task: {k: v for k, v in metrics.items() if k != "alias" and isinstance(v, (int, float))}
        for task, metrics in results["results"].items()
    }
