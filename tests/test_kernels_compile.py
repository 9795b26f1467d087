"""Every Triton kernel compiles to Hopper (sm_90) machine code, here, without a GPU.

Triton's own compiler and bundled ptxas lower each kernel ahead of time, so type errors that the
interpreter would let through (mixed signedness, pointer casts, tuple arguments) fail on every
machine, not only on a GPU. The compile runs in a child process without ``TRITON_INTERPRET``.
"""

import os
import subprocess
import sys
import warnings

VERIFY = dict(stamps="*i64", num_slots="i64", table="*i32", width="i32", span="i32", bs="i32", table_rows="*i64",
              cached="*i64", starts="*i64", valid="*i1", exp_tok="*i64", exp_w="i32", first="*i64", meta="*i64",
              src="*i64", nsrc="i32", bytes_per_slot="i32", counters="*i64", ring="*i64", cap="i32")
MAPS = dict(tokens="*i64", positions="*i64", row_of="*i64", j_of="*i64", seeds="*i64")
WRITE = dict(stamps="*i64", tokens="*i32", positions="*i32", slots="*i64", row_of="*i64", j_of="*i64", seeds="*i64",
             carry="*i64", contents="*i64", cached="*i64", valid="*i1", table="*i32", width="i32", span="i32",
             bs="i32", table_rows="*i64", exp_tok="*i64", exp_pos="*i64", counters="*i64", ring="*i64", cap="i32",
             n="i32", bytes_per_slot="i32")


def compile_for_hopper(fn, signature, constexprs):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
    assert k.asm["cubin"], fn.__name__
    print("compiled", fn.__name__, constexprs)


def compile_all():
    from kvcanary.kernels.content import _content_kernel
    from kvcanary.kernels.stamp import _block_aggregates, _carry, _write_kernel
    from kvcanary.kernels.verify import _verify_kernel

    for bt, tr, st, va, ex, co in [(True, False, False, True, True, True), (False, True, True, False, False, False)]:
        compile_for_hopper(_verify_kernel, VERIFY, dict(BLOCK=64, BLOCK_TABLE=bt, HAS_TROWS=tr, HAS_STARTS=st,
                                                        HAS_VALID=va, HAS_EXP=ex, HAS_CONTENT=co, WCHUNK=64))
    compile_for_hopper(_block_aggregates, {**MAPS, "agg": "*i64", "n": "i32"}, dict(BLOCK=256))
    compile_for_hopper(_carry, {"agg": "*i64", "carry": "*i64", "nblocks": "i32"}, dict(NB=128))
    for flag in (True, False):
        compile_for_hopper(_write_kernel, WRITE, dict(BLOCK=256, BLOCK_TABLE=flag, HAS_TROWS=flag, HAS_VALID=flag,
                                                      HAS_EXP_TOK=flag, HAS_EXP_POS=flag))
    compile_for_hopper(_content_kernel, dict(slots="*i64", out="*i64", n="i32", src="*i64", nsrc="i32"),
                       dict(BLOCK=32, WCHUNK=64))


def test_every_kernel_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 7


if __name__ == "__main__":
    compile_all()
