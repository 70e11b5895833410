// Entry points of the cluster router + alignment (device code and the math in moe_route.cuh). Every entry is an
// extern "C" __global__ function so NVRTC (CuPy RawModule, specverify/jit.py) exports it under a plain name; the same
// file compiles with nvcc -arch=sm_90. Host-side checks (sizes, dtypes, the device) live in specverify/moe.py, the
// only caller. Names: specverify_route_align_cluster_<dtype>, dtype in {bf16, f16, f32}.
#include "moe_route.cuh"

#define SVR_DEFINE(SUFFIX, TYPE)                                                                                   \
  extern "C" __global__ void __cluster_dims__(SVR_CLUSTER, 1, 1) __launch_bounds__(SVR_THREADS, 1)               \
      specverify_route_align_cluster_##SUFFIX(const TYPE* logits, long long stride_lm, const float* bias,       \
                                              int* topk_ids, float* topk_w, int* sorted_ids, int* expert_ids,   \
                                              int* npad, int M, int E, int top_k, int n_group, int topk_group,  \
                                              int softmax, int renorm, float scale, int block_size,             \
                                              int max_blocks) {                                                 \
    svroute::route_align<TYPE>(logits, stride_lm, bias, topk_ids, topk_w, sorted_ids, expert_ids, npad, M, E,  \
                               top_k, n_group, topk_group, softmax, renorm, scale, block_size, max_blocks);     \
  }

SVR_DEFINE(bf16, svroute::Bf16)
SVR_DEFINE(f16, svroute::F16)
SVR_DEFINE(f32, float)
