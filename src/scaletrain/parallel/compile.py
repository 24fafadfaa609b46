"""torch.compile per block: each block is compiled once and reused by all of them (same code, same shapes), so
compile time does not grow with depth, and FSDP2 still sees one module per block to shard.

`nn.Module.compile` only sets what the block's `__call__` runs; FSDP2's and DDP's hooks are looked up at call time
either way, so compiling blocks after the model was wrapped (parallel.compile=auto, once the first steps showed it
pays: CompileProbe) runs the same code as compiling them before wrapping."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from scaletrain.models.spec import ModelSpec
from scaletrain.parallel.blocks import block_container, block_items


def apply_compile(model: nn.Module, spec: ModelSpec | None = None) -> int:
    """Compile every block (parallel/blocks.py) in place (`nn.Module.compile`, which keeps parameter names).
    Returns the number of blocks compiled."""
    found = block_container(model, spec)
    if found is None:
        raise ValueError("parallel.compile: the model has no container of blocks to compile")
    blocks = block_items(found[1])
    for _, block in blocks:
        block.compile(fullgraph=True)
    return len(blocks)


# parallel.compile=auto on a GPU decides by these, measured on one H200 (torch 2.11, llama-1b, bf16, seq 2048,
# micro-batch 4, 2026-12-04; shared/notes/gpu-h200.md): compiled blocks ran 47,823 tokens/s where eager ran
# 36,343, and compiling the blocks took about 20 s.
COMPILE_SPEEDUP = 47_823 / 36_343
COMPILE_SECONDS = 20.0
# step 1 warms up (allocator, library autotuning, first collectives); the steps after it up to this one are timed
PROBE_STEPS = 3


@dataclass(frozen=True)
class CompileDecision:
    """What the probe saw and chose: compile when the time compiled steps save over the steps left is more than
    the compilation costs."""

    compile: bool
    eager_step_s: float  # seconds per eager step (the slowest rank's)
    steps_left: int
    saves_s: float  # steps_left x eager_step_s x (1 - 1/speedup)
    compile_s: float

    def describe(self) -> str:
        verdict = "compiling the blocks" if self.compile else "staying eager"
        return (
            f"compile auto: eager {self.eager_step_s * 1e3:.0f} ms/step x {self.steps_left} steps left; compiling "
            f"would save ~{self.saves_s:.0f} s against ~{self.compile_s:.0f} s to compile: {verdict}"
        )


@dataclass
class CompileProbe:
    """parallel.compile=auto on a GPU: the first steps run eager and are timed, then the blocks are compiled in
    place if that pays back over the steps left. `observe` is called after every step with the step number and a
    clock read after the device finished the step; it returns the decision once, at step start_step + PROBE_STEPS."""

    steps: int  # train.steps
    start_step: int  # the step training (re)starts after
    speedup: float = COMPILE_SPEEDUP
    compile_s: float = COMPILE_SECONDS
    _t0: float | None = None

    @property
    def decide_at(self) -> int:
        return self.start_step + PROBE_STEPS

    def timing(self, step: int) -> bool:
        """Whether the clock must be read (device synchronised) after `step`."""
        return step in (self.start_step + 1, self.decide_at)

    def observe(self, step: int, now: float) -> float | None:
        """Seconds per eager step once the probe's steps are done (at decide_at), else None."""
        if step == self.start_step + 1:
            self._t0 = now
        if step != self.decide_at or self._t0 is None:
            return None
        return (now - self._t0) / (PROBE_STEPS - 1)

    def decide(self, eager_step_s: float) -> CompileDecision:
        """The decision for the slowest rank's eager step time (every rank must decide alike)."""
        left = max(0, self.steps - self.decide_at)
        saves = left * eager_step_s * (1 - 1 / self.speedup)
        return CompileDecision(saves > self.compile_s, eager_step_s, left, saves, self.compile_s)
