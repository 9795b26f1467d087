"""A pure-Python stand-in for SGLang's ``sgl_kernel`` CPU build, for kvcanary's tests only.

With SGLANG_USE_CPU_ENGINE=1, SGLang 0.5.23 imports ``sgl_kernel`` unconditionally. The real CPU
build is shipped as source only and needs AVX-512/AMX to compile, so the tests put this package on
the path instead (tests_sglang/stubs/, through a .pth file that scripts/setup-sglang writes into
.venv-sglang).

It registers no ``torch.ops.sgl_kernel`` operators, so SGLang's check for the AMX backend (an op
named ``convert_weight_packed``) finds none and every layer (RMSNorm, SiLU-and-mul, rotary
embedding, linear) takes its plain torch path. The names below are the ones the engine imports
on that path with the torch_native attention backend, found by starting the engine: only
``assign_req_to_token_pool_cpu`` is a real implementation (it is called when a speculative
decode step writes its slots into the request table); the others raise StandInError if called.
``weak_ref_tensor`` (imported by SGLang only on CUDA-like devices) is an identity."""

import torch

from _kvcanary_stubs import StandInError, unsupported

__version__ = "0.0.0+kvcanary.stub"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len=None):
    """Write each request's new slots into its row of the request-to-slot table:
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` takes the next
    ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc`` (requests in order)."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pt = 0
    for row, s, e in zip(rows, starts, ends):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = out_cache_loc[pt:pt + n].to(req_to_token.dtype)
        pt += n


def weak_ref_tensor(t):
    """Identity: there are no CUDA graphs on the CPU engine, so nothing needs a non-owning view."""
    return t


# imported at module load on the CPU path, never called by the tests' engine
copy_all_layer_kv_cache_cpu = unsupported(__name__, "copy_all_layer_kv_cache_cpu")  # kernels/ops/kvcache/cache_move.py
build_tree_kernel_efficient_cpu = unsupported(__name__, "build_tree_kernel_efficient_cpu")  # speculative/spec_tree.py
verify_tree_greedy_cpu = unsupported(__name__, "verify_tree_greedy_cpu")
assign_draft_cache_locs_contiguous_cpu = unsupported(__name__, "assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = unsupported(__name__, "assign_extend_cache_locs_cpu")
fill_accept_out_cache_loc_cpu = unsupported(__name__, "fill_accept_out_cache_loc_cpu")  # speculative/eagle.py
fill_bonus_tokens_cpu = unsupported(__name__, "fill_bonus_tokens_cpu")

__all__ = ["StandInError", "assign_req_to_token_pool_cpu", "weak_ref_tensor", "copy_all_layer_kv_cache_cpu",
           "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu", "assign_draft_cache_locs_contiguous_cpu",
           "assign_extend_cache_locs_cpu", "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu"]
