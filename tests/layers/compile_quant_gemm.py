"""Compile the Triton dequant-GEMMs for a GPU target without a GPU (the interpreter skips the
compiler, whose type and layout rules it does not check): ``python -m
tests.layers.compile_quant_gemm [ARCH]`` builds each kernel for sm_ARCH (default 90: H100 / H200),
float16 / bfloat16 / float32 activations, a decode and a prefill tile, int4 with a group the K step
divides and one it does not; prints one line per variant with its shared memory, exits 1 on a
failure. Run in a process without TRITON_INTERPRET (triton reads it at import)."""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedllm.layers.quantization import triton_dequant_gemm as gemm

_POINTERS = {"s_ptr": "*fp32", "z_ptr": "*u8"}
_DOT = {"fp32": gemm.DOT_IEEE, "fp16": gemm.DOT_NATIVE, "bf16": gemm.DOT_NATIVE}


def compile_one(kind: str, dtype: str, tile: gemm.Tile, group: int, arch: int) -> int:
    """Shared memory bytes of one variant (``kind`` int8 or int4)."""
    fn = gemm._int8_gemm_kernel if kind == "int8" else gemm._int4_gemm_kernel
    consts = {"HAS_BIAS": True, "DOT": _DOT[dtype], "BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n}
    consts["BLOCK_K"] = tile.block_k
    if kind == "int4":
        consts.update(GROUP=group, HAS_ZERO=True, BLOCK_K=gemm.int4_block_k(tile.block_k, group))
    pointers = {**_POINTERS, "x_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "b_ptr": f"*{dtype}"}
    pointers["w_ptr"] = "*i8" if kind == "int8" else "*i32"
    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in names}
    source = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in consts.items()})
    options = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).metadata.shared


def main(arch: int) -> int:
    failed = 0
    decode, prefill = gemm.tile_for(1), gemm.tile_for(4096)
    variants = [("int8", "bf16", decode, 0), ("int8", "fp32", prefill, 0), ("int4", "bf16", decode, 128)]
    variants += [("int4", "fp16", prefill, 128), ("int4", "fp32", decode, 40)]
    for kind, dtype, tile, group in variants:
        try:
            shared = compile_one(kind, dtype, tile, group, arch)
            print(f"ok   {kind} {dtype} {tile} group {group}: {shared} bytes of shared memory")
        except Exception as exc:  # noqa: BLE001 - report each variant
            failed += 1
            print(f"FAIL {kind} {dtype} {tile} group {group}: {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 90))
