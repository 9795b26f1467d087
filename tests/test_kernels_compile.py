"""Every Triton kernel compiles to Hopper (sm_90) machine code, here, without a GPU.

Triton's own compiler and bundled ptxas lower each kernel ahead of time, so type errors that the
interpreter would let through (mixed signedness, pointer casts, tuple arguments) fail on every
machine, not only on a GPU. The machine code is then read back with the bundled ``cuobjdump``:
content tiles must load 16 bytes per lane and no kernel may spill registers to local memory.
The compile runs in a child process without ``TRITON_INTERPRET``.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import warnings

VERIFY = dict(stamps="*i64", num_slots="i64", table="*i32", width="i32", span="i32", bs="i32", table_rows="*i64",
              cached="*i64", starts="*i64", valid="*i1", exp_tok="*i64", exp_w="i32", exp_rows="*i64", first="*i64", meta="*i64",
              cursor="*i64", src="*i64", nsrc="i32", ntiles="i32", bytes_per_slot="i32", counters="*i64", ring="*i64", cap="i32")
TOKENS = dict(tokens="*i64", positions="*i64", offsets="*i64", rows="i32", steps="i32", cached="*i64", table="*i32",
              width="i32", span="i32", bs="i32", table_rows="*i64", stamps="*i64", num_slots="i64", seeds="*i64",
              over="*i64")
WRITE = dict(stamps="*i64", num_slots="i64", tokens="*i32", positions="*i32", slots="*i64", offsets="*i64",
             rows="i32", steps="i32", seeds="*i64", over="*i64", carry="*i64", contents="*i64", cached="*i64", valid="*i1",
             table="*i32", width="i32", span="i32", bs="i32", table_rows="*i64", exp_tok="*i64", exp_pos="*i64",
             counters="*i64", ring="*i64", cap="i32", n="i32", bytes_per_slot="i32", writers="*i64")
CONTENT = dict(slots="*i64", out="*i64", n="i32", num_slots="i64", src="*i64", nsrc="i32", ntiles="i32")
WINDOW = dict(cached="*i64", starts="*i64", valid="*i1", rows="i32", first="*i64", meta="*i64", cursor="*i64",
              counters="*i64", content_slots="i64")


def compile_for_hopper(fn, signature, constexprs, tag, out_dir, num_warps=4):
    """Compile for sm_90 as a launch with 16-byte aligned tensors would; report the machine code."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    aligned = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=aligned),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    path = os.path.join(out_dir, tag + ".cubin")
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", path], capture_output=True, text=True,
                          check=True).stdout
    res = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                         check=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    print(json.dumps(dict(kernel=tag, regs=int(regs.group(1)) if regs else None,
                          stack=int(re.search(r"STACK:(\d+)", res).group(1)),
                          spill_stores=len(re.findall(r"\bSTL\b", sass)),
                          loads_16B=len(re.findall(r"\bLDG\.E\.128\b", sass)),
                          loads_8B=len(re.findall(r"\bLDG\.E\.64\b", sass)))), flush=True)


def compile_all(out_dir):
    from kvcanary.kernels.content import _content_kernel, content_block
    from kvcanary.kernels.stamp import _block_aggregates, _carry, _write_kernel
    from kvcanary.kernels.verify import _verify_kernel, _window_kernel

    for tag, bt, tr, st, va, ex, er, co, wi, block, warps, narrow in [
        ("verify_content", True, False, False, True, True, True, True, True, 32, 4, False),
        ("verify_content_unmasked", True, False, False, False, False, False, True, False, 32, 4, False),
        ("verify_meta", False, True, True, False, True, False, False, False, 512, 8, False),
        ("verify_narrow", True, False, False, True, True, True, True, True, 32, 4, True),
    ]:
        compile_for_hopper(_verify_kernel, VERIFY, dict(BLOCK=block, BLOCK_TABLE=bt, HAS_TROWS=tr, HAS_STARTS=st,
                                                        HAS_VALID=va, HAS_EXP=ex, HAS_EROWS=er, HAS_CONTENT=co,
                                                        HAS_WINDOW=wi,
                                                        CHUNK=64, SAME_PS=True, EVEN=True, NARROW=narrow), tag, out_dir,
                           warps)
    compile_for_hopper(_window_kernel, WINDOW, dict(RB=1024, HAS_STARTS=True, HAS_VALID=True), "window", out_dir)
    compile_for_hopper(_block_aggregates, {**TOKENS, "agg": "*i64", "n": "i32", "slots": "*i64", "valid": "*i1",
                                           "writers": "*i64"},
                       dict(BLOCK=256, BLOCK_TABLE=True, HAS_TROWS=False, HAS_VALID=True, HAS_OVER=True),
                       "aggregates", out_dir)
    compile_for_hopper(_carry, {"agg": "*i64", "carry": "*i64", "nblocks": "i32"}, dict(NB=128), "carry", out_dir)
    for flag in (True, False):
        compile_for_hopper(_write_kernel, WRITE, dict(BLOCK=256, SEEDED=flag, BLOCK_TABLE=flag, HAS_TROWS=flag,
                                                      HAS_VALID=flag, HAS_EXP_TOK=flag, HAS_EXP_POS=flag,
                                                      HAS_CONTENT=flag, HAS_OVER=flag), f"write_{flag}", out_dir)
    for chunk, even in ((64, True), (32, False), (2, True)):
        consts = dict(BLOCK=content_block(chunk), CHUNK=chunk, SAME_PS=even, EVEN=even, NARROW=False)
        compile_for_hopper(_content_kernel, CONTENT, consts, f"content_{chunk}_{even}", out_dir)
    for same_ps in (True, False):  # narrow runs (vLLM's CPU layouts): element loads at listed offsets
        consts = dict(BLOCK=content_block(64), CHUNK=64, SAME_PS=same_ps, EVEN=False, NARROW=True)
        compile_for_hopper(_content_kernel, CONTENT, consts, f"content_narrow_{same_ps}", out_dir)


def test_every_kernel_compiles_for_hopper_without_spills_and_with_wide_content_loads():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = {r["kernel"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert len(reports) == 14, sorted(reports)
    for r in reports.values():
        assert r["spill_stores"] == 0 and r["stack"] == 0, r
    for tag in ("verify_content", "verify_content_unmasked", "content_64_True", "content_32_False",
                "content_2_True"):
        assert reports[tag]["loads_16B"] > 0, reports[tag]  # the content tile's loads
    assert reports["verify_meta"]["loads_16B"] == 0  # no content tile without sources


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        compile_all(d)
