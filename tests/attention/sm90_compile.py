"""Compile the Gluon kernels for Hopper (sm_90a) on a machine without a GPU: ``python -m tests.attention.sm90_compile``
(with TRITON_INTERPRET unset) prints ``compiled <case>`` for each case it compiled, through ptxas to a cubin, within
an H100's shared memory and with the products in flight: ptxas's info output for each kernel (Triton prints it with
``dump_ptxas_log``) does not say it serialized them for want of registers. A kernel Triton's cache already holds runs
no ptxas: run it with an empty TRITON_CACHE_DIR, as test_gluon.py does.

Triton's front end, its passes and ptxas need no GPU; only its driver asks CUDA for the device, stream and
target. ``Sm90Driver`` answers for them, and the Gluon kernels' own ``launch`` functions build every argument
from CPU tensors (their plans, descriptors, tables and MODS) and hand them to a ``CompileOnly`` launcher in
place of the kernel's: the arguments a GPU run passes, compiled there. test_gluon.py runs it in a child
process, since the interpreter a CPU test run sets (TRITON_INTERPRET) is read when kernels are defined.
"""

from __future__ import annotations

import contextlib
import io

import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from sparseflash import masks
from sparseflash.attention.score_mods import make_score_mod
from sparseflash.attention.triton import backward_gluon, forward_gluon
from sparseflash.attention.triton.plan import LaunchPlan
from sparseflash.masks.functions import trace

SEQ_LEN, HEADS = 512, 4
RAGGED_LEN = 700  # a multiple of neither tile (128 and 64 rows)
HOPPER_SHARED_BYTES = 232448  # shared memory a block may take on an H100 (227 KiB): more compiles, then fails to launch


class Sm90Driver:
    """Triton's driver as far as compiling for an H100 needs it: device 0, stream 0, target sm_90a."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:
        from triton.backends.nvidia.driver import ty_to_cpp
        return ty_to_cpp(ty)


class CompileOnly:
    """A ``Launcher`` stand-in that compiles the kernel for the arguments of a launch and keeps what it compiled."""

    def __init__(self, kernel):
        self.kernel, self.compiled = kernel, []

    def __call__(self, grid, tensors, scalars, constexprs) -> None:
        self.compiled.append(self.kernel.warmup(*tensors, *scalars, grid=grid, **constexprs))

    compile_ahead = __call__


def _documents(b, h, q_idx, kv_idx):
    return DOCUMENT_IDS[q_idx] == DOCUMENT_IDS[kv_idx]


DOCUMENT_IDS = torch.arange(SEQ_LEN) // 200  # documents of 200 tokens: rows of unequal lengths


def cases() -> dict:
    """name -> (direction, head dim, mask, score function)."""
    causal = masks.make("causal", SEQ_LEN)
    documents = masks.from_mask_mod(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & _documents(b, h, q_idx, kv_idx),
                                    SEQ_LEN, block=128)
    alibi, softcap = make_score_mod("alibi", HEADS), make_score_mod("softcap", HEADS, cap=5.0)
    return {
        "forward-d128-causal": ("forward", 128, causal, None),
        "forward-d128-alibi": ("forward", 128, causal, alibi),
        "forward-d128-documents": ("forward", 128, documents, None),
        "forward-d64-dense": ("forward", 64, masks.make("dense", SEQ_LEN), None),  # three consumer warpgroups
        "forward-d64-causal": ("forward", 64, causal, None),
        "forward-d64-alibi": ("forward", 64, causal, alibi),
        "forward-d64-documents": ("forward", 64, documents, None),
        "forward-d256-causal": ("forward", 256, causal, None),
        "forward-d256-alibi": ("forward", 256, causal, alibi),
        "forward-d256-documents": ("forward", 256, documents, None),
        "forward-d48-causal": ("forward", 48, causal, None),  # head dims in two parts: 32 + 16
        "forward-d80-causal": ("forward", 80, causal, None),  # 64 + 16
        "forward-d96-documents": ("forward", 96, documents, None),  # 64 + 32
        "forward-d160-alibi": ("forward", 160, causal, alibi),  # 128 + 32, two K/V buffers
        "forward-d192-causal": ("forward", 192, causal, None),  # 128 + 64, 64-key tiles
        # lengths the tiles do not divide: the last key tile ends at the last key (RAGGED_KEYS)
        "forward-d128-dense-ragged": ("forward", 128, masks.make("dense", RAGGED_LEN), None),
        "forward-d64-alibi-ragged": ("forward", 64, masks.make("causal", RAGGED_LEN), alibi),
        "forward-d256-causal-ragged": ("forward", 256, masks.make("causal", RAGGED_LEN), None),
        "backward-d128-causal": ("backward", 128, causal, None),
        "backward-d128-alibi": ("backward", 128, causal, alibi),
        "backward-d128-softcap": ("backward", 128, causal, softcap),
        "backward-d128-documents": ("backward", 128, documents, None),
        "backward-d64-alibi": ("backward", 64, causal, alibi),
        "backward-d64-documents": ("backward", 64, documents, None),
        "backward-d48-causal": ("backward", 48, causal, None),  # 32 + 16, dQ tiles of both parts a warpgroup
        "backward-d80-alibi": ("backward", 80, causal, alibi),  # 64 + 16, a part's dQ tile a warpgroup
        "backward-d96-documents": ("backward", 96, documents, None),  # 64 + 32
        "backward-d160-causal": ("backward", 160, causal, None),  # a part's columns a warpgroup: 128 | 32
        "backward-d192-alibi": ("backward", 192, causal, alibi),  # 128 | 64
        "backward-d256-documents": ("backward", 256, documents, None),  # 128 | 128, two Q buffers, one dO buffer
        "backward-d256-causal": ("backward", 256, causal, None),
        "backward-d128-dense-ragged": ("backward", 128, masks.make("dense", RAGGED_LEN), None),
        "backward-d64-alibi-ragged": ("backward", 64, masks.make("causal", RAGGED_LEN), alibi),
        "backward-d160-causal-ragged": ("backward", 160, masks.make("causal", RAGGED_LEN), None),
        "forward-d128-causal-key-lengths": ("forward", 128, causal, None, True),
        "forward-d64-dense-key-lengths": ("forward", 64, masks.make("dense", SEQ_LEN), None, True),  # three consumers
        "backward-d128-dense-key-lengths": ("backward", 128, masks.make("dense", SEQ_LEN), None, True),
        "backward-d256-causal-key-lengths": ("backward", 256, causal, None, True),
        # SPARSE: the row walks cut at the first block past a batch's keys (``gluon_tools.walk_before``)
        "forward-d128-documents-key-lengths": ("forward", 128, documents, None, True),
        "forward-d256-documents-key-lengths": ("forward", 256, documents, None, True),  # 64-key tiles, K_EARLY
        "backward-d128-documents-key-lengths": ("backward", 128, documents, None, True),
    }


def compile_case(direction: str, dim: int, mask, score_mod, key_lengths: bool = False) -> list:
    """The kernels ``launch`` of ``direction`` compiles for (2, HEADS, the mask's length, dim) bf16 inputs (with
    ``key_lengths``, a key length per batch)."""
    q = torch.randn(2, HEADS, mask.q_len, dim, dtype=torch.bfloat16)
    score_graph = trace(score_mod, "score_mod") if score_mod is not None else None
    plan = LaunchPlan(q, q, mask, key_lengths, dim ** -0.5, score_graph)
    lengths = plan.key_lengths_arg(torch.tensor([mask.kv_len - 100, 3]) if key_lengths else None)
    mods = plan.mods_table(plan.captures(score_graph))
    module = forward_gluon if direction == "forward" else backward_gluon
    launchers = {"forward": ["FORWARD_GLUON"],
                 "backward": ["BACKWARD_GLUON", "BACKWARD_GLUON_WIDE", "LSE2_LESS_ROWS"]}[direction]
    stand_ins = {name: CompileOnly(getattr(module, name).kernel) for name in launchers}
    originals = {name: getattr(module, name) for name in launchers}
    for name, stand_in in stand_ins.items():
        setattr(module, name, stand_in)
    try:
        if direction == "forward":
            assert module.launch(plan, q, q, q, torch.empty_like(q), torch.empty(q.shape[:3]), lengths, mods)
        else:
            stats = torch.zeros(2 * HEADS, mask.q_len)
            grads = [torch.empty_like(q) for _ in range(2)]
            assert module.launch(plan, q, q, q, q, stats, stats, module.accumulator(plan, q), *grads, lengths, mods,
                                 mask.q_len)
    finally:
        for name, original in originals.items():
            setattr(module, name, original)
    return [kernel for stand_in in stand_ins.values() for kernel in stand_in.compiled]


SERIALIZED = "wgmma.mma_async instructions are serialized"  # ptxas's info where too few registers hold them in flight


def compile_logged(direction: str, dim: int, mask, score_mod, key_lengths: bool = False) -> tuple[list, str]:
    """``compile_case``'s kernels and the info output of the ptxas runs that built them (none for a kernel already
    in Triton's cache)."""
    log = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        compiled = compile_case(direction, dim, mask, score_mod, key_lengths)
    return compiled, log.getvalue()


def main() -> None:
    driver.set_active(Sm90Driver())
    for name, case in cases().items():
        compiled, ptxas_info = compile_logged(*case)
        assert compiled and all(kernel.asm["cubin"] for kernel in compiled), name
        shared = [kernel.metadata.shared for kernel in compiled]
        assert max(shared) <= HOPPER_SHARED_BYTES, f"{name}: shared memory {shared} over {HOPPER_SHARED_BYTES} bytes"
        assert SERIALIZED not in ptxas_info, f"{name}: ptxas serialized the products:\n{ptxas_info}"
        print("compiled", name, flush=True)


if __name__ == "__main__":
    main()
