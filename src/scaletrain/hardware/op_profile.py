"""Timing a function's kernels op by op on a CPU (a TorchDispatchMode around every ATen op it dispatches), and
counting the ops it dispatches: what `scaletrain bench` records of a real training step."""

from __future__ import annotations

import time

import torch

from scaletrain.hardware.kernels import attention_flops

# ATen ops that move no data (views, metadata): neither timed as kernels nor counted as bytes
VIEW_OPS = frozenset(
    "view _unsafe_view reshape t transpose expand as_strided slice select unsqueeze squeeze permute detach alias "
    "split split_with_sizes unbind empty empty_like empty_strided lift_fresh _reshape_alias _fused_sdp_choice".split()
)
GEMM_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm"})


def step_profile(fn, repeats: int) -> dict:
    """One rank's kernels in `fn`, op by op (a TorchDispatchMode timing every ATen op it dispatches; a CPU runs them
    synchronously), per call of `fn`: its GEMMs by shape {(m, n, k): [FLOPs, seconds]}, its causal attention by
    shape {(seq, head_dim): [FLOPs, seconds]} (forward kernels a third of attention_flops, backward two thirds), and
    the memory-bound rest (norms, activations, RoPE, adds, the loss) as [bytes its tensors hold in and out, seconds]."""
    from torch.utils._python_dispatch import TorchDispatchMode

    gemm: dict[tuple[int, ...], list[float]] = {}
    attention: dict[tuple[int, ...], list[float]] = {}
    rest = [0.0, 0.0]

    def add(table, key, flops, dt) -> None:
        entry = table.setdefault(key, [0.0, 0.0])
        entry[0] += flops / repeats
        entry[1] += dt / repeats

    class _Timed(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            dt = time.perf_counter() - t0
            name = func.overloadpacket.__name__
            if name in VIEW_OPS:
                return out
            if name in GEMM_OPS:
                a, b = args[-2], args[-1]  # (bias,) a, b; batched: (batch, m, k) @ (batch, k, n)
                m, n, k = a.shape[-2], b.shape[-1], a.shape[-1]
                add(gemm, (m, n, k), 2.0 * m * n * k * (a.shape[0] if a.dim() == 3 else 1), dt)
            elif "scaled_dot_product" in name:
                q = args[0]  # forward: the query, backward: the output's gradient, both (batch, heads, seq, dim)
                share = 2.0 / 3.0 if "backward" in name else 1.0 / 3.0
                add(
                    attention,
                    (q.shape[-2], q.shape[-1]),
                    share * attention_flops(q.shape[-2], q.shape[-1], q.shape[0] * q.shape[1]),
                    dt,
                )
            else:
                tensors = [
                    t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)
                ]
                rest[0] += sum(t.numel() * t.element_size() for t in tensors) / repeats
                rest[1] += dt / repeats
            return out

    with _Timed():
        for _ in range(repeats):
            fn()
    return {"gemm": gemm, "attention": attention, "pointwise": rest}


def count_dispatched_ops(fn) -> int:
    """Number of ATen ops `fn()` dispatches (forward and autograd's backward alike), counted by a
    TorchDispatchMode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    with _Count() as counter:
        fn()
    return counter.n
