"""Compile one kernel variant for sm_90a on this machine (no GPU needed) and count, per inner loop,
its instructions, tensor-core ops and register spills (docs/kernels.md shows what to look for).

    PYTHONPATH=. python scripts/kernel_sass.py bwd:dense:128:128x64w8s3 bwd:causal:128:128x64w8s3:ragged
    PYTHONPATH=t36:. python scripts/kernel_sass.py ...   # another Triton, e.g. 3.6:
                                                         # pip install --target t36 triton==3.6.0

A variant is KERNEL:KIND:HEAD_DIM:BMxBNwWARPSsSTAGES[:ragged][:dropout], KERNEL fwd, pfwd (the
persistent forward, for 132 SMs), dec (the split-KV decode forward, 4 heads a program), bwd (both
kinds of program in one launch), dkdv or dq; KIND dense, causal or sparse (128x128 mask blocks);
HEAD_DIM the real head dim (computed as ``plan.head_dim_parts`` says);
``ragged`` compiles the EVEN_LENGTHS=False variant, ``dropout`` the DROPOUT one, ``alibi`` or
``softcap`` the built-in score function's generated helper. Arguments are typed
as the launcher passes them: bf16 tensors, the head-dim stride 1, other tensor strides divisible by 16.
"""

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparseflash.attention.score_mods import make_score_mod
from sparseflash.attention.triton import backward, codegen, forward, forward_decode, forward_persistent
from sparseflash.attention.triton.plan import head_dim_parts
from sparseflash.attention.triton.tuning import KernelConfig
from sparseflash.masks.functions import trace

KINDS = {"dense": (0, False), "causal": (1, True), "sparse": (2, False)}
PROGRAMS = {"bwd": 0, "dkdv": 1, "dq": 2}
FP32_TENSORS = {"LSE", "DELTA"}
BF16_TENSORS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV"}


def compile_variant(spec: str):
    kernel, kind, head_dim, tiles, *rest = spec.split(":")
    bm, bn, warps, stages = map(int, re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", tiles).groups())
    mask_kind, causal = KINDS[kind]
    fn = {"fwd": forward._attn_fwd, "pfwd": forward_persistent._attn_fwd_persistent,
          "dec": forward_decode._attn_fwd_decode}.get(kernel, backward._attn_bwd)
    constants = dict(MASK_KIND=mask_kind, IS_CAUSAL=causal, HAS_KEY_LENGTHS=False, BLOCK_M=bm, BLOCK_N=bn,
                     SPARSE_BLOCK_M=128, SPARSE_BLOCK_N=128, **head_dim_parts(int(head_dim)), DOT_PRECISION="ieee",
                     WIDEN_DOTS=False,
                     EVEN_LENGTHS=kind != "sparse" and "ragged" not in rest, MASK_MOD=None, SCORE_MOD=None,
                     SCORE_KEYS=None, SCORE_ROW=None, DROPOUT="dropout" in rest)
    for name in set(rest) & {"alibi", "softcap"}:
        generated = codegen.helpers(None, trace(make_score_mod(name, 16), "score_mod"))
        constants.update(SCORE_MOD=generated.score_mod, SCORE_KEYS=generated.score_keys,
                         SCORE_ROW=generated.score_row)
    if kernel == "pfwd":
        constants.update(NUM_PROGRAMS=132, MASK_EVERY_TILE=False)
    elif kernel == "dec":
        constants.update(PACK=4, SPLIT=True)
    elif kernel != "fwd":
        constants.update(PROGRAMS=PROGRAMS[kernel], SCORE_MOD_GRADS=None,
                         QUERY_ROWS=backward.query_rows(KernelConfig(bm, bn, warps, stages), PROGRAMS[kernel]))
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.startswith("stride_") and name.endswith("d"):
            signature[name], constants[name] = "constexpr", 1
        elif name.isupper():  # a tensor
            signature[name] = ("*fp32" if name in FP32_TENSORS else "*bf16" if name in BF16_TENSORS
                               else "*i64" if name in ("MODS", "SEED") else "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "scale", "dropout_scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name in ("head_dim", "stats_stride") or (name.startswith("stride_")
                                                         and not re.search("num|idx|col|row", name)):
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, attrs=attrs,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def loops(sass: str) -> list[str]:
    """One line per backward branch (an inner or outer loop) of a SASS listing."""
    code = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    lines = []
    for address, text in code:
        target = re.search(r"BRA\s+.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            body = [t for a, t in code if int(target.group(1), 16) <= a <= address]
            count = lambda op: sum(op in t for t in body)  # noqa: E731
            lines.append(f"  loop {len(body):5d} instr  HGMMA {count('HGMMA'):3d}  spill loads {count('LDL'):3d}"
                         f"  spill stores {count('STL'):3d}  exp2 {count('MUFU.EX2')}")
    return lines


def main() -> None:
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for spec in sys.argv[1:]:
        compiled = compile_variant(spec)
        with tempfile.TemporaryDirectory() as tmp:
            ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
            open(ptx, "w").write(compiled.asm["ptx"])
            open(cubin, "wb").write(compiled.asm["cubin"])
            usage = subprocess.run([os.path.join(tools, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                                   capture_output=True, text=True).stderr
            sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin],
                                  capture_output=True, text=True).stdout
        used = " ".join(line.split(":", 1)[-1].strip() for line in usage.splitlines() if "Used" in line or "spill" in line)
        partitions = compiled.asm["ttgir"].count("ttg.warp_specialize")
        print(f"{spec} (triton {triton.__version__}): shared {compiled.metadata.shared} B; {used}"
              + (f"; warp-specialised loops {partitions}" if spec.startswith("pfwd") else ""))
        if os.environ.get("KERNEL_SASS_DUMP"):  # the TTGIR and SASS, for reading
            for ext, text in (("ttgir", compiled.asm["ttgir"]), ("sass", sass)):
                open(os.path.join(os.environ["KERNEL_SASS_DUMP"], f"{spec.replace(':', '_')}.{ext}"), "w").write(text)
        print("\n".join(loops(sass)))


if __name__ == "__main__":
    main()
