// MoE router + token->expert block alignment in ONE launch of one thread-block cluster (sm_90+), for M <= 64 tokens,
// E <= 512 experts, top_k <= 8. Device code only (no torch, no host headers): it compiles through NVRTC (CuPy
// RawModule, specverify/jit.py) and nvcc -arch=sm_90. Opt-in (specverify.moe._VARIANT["route"] = "cluster"); not
// yet run on a GPU when written (sixth session): bench/RESULTS.md says when it was.
//
// Routing, per token row (row = cluster CTA rank * 8 + warp; lane l holds experts e = l + 32 j, j < 16):
//   s[e] = sigmoid(x[e]) or softmax(x)[e] in fp32 (a row with a NaN logit: every softmax score NaN);
//   c[e] = s[e] + bias[e], a non-finite c becomes -inf (never wins);
//   n_group > 1: groups of E / n_group experts ranked by the sum of their two best c (one if the group has one
//   expert; NaN -> -inf), ties to the lower group id; only the topk_group best keep their c;
//   top_k rounds of a warp argmax: redux.max over the order-preserving int32 image of c, then redux.min over the
//   expert ids of the lanes holding that maximum (ties to the lowest id); a -inf winner is no expert (id -1, w 0);
//   w = s[id] (unbiased), divided by sum(w) where renorm and the sum is > 0, times scale.
// Alignment, without any global atomic or ticket: every routing warp stores its slots' expert ids into CTA 0's
// shared memory through distributed shared memory (mapa + st.shared::cluster); after one cluster barrier CTA 0
// ranks the slots inside their experts with shared-memory atomics (order inside an expert free), scans the
// block-padded counts and writes the outputs. Slot s = row * top_k + k.
//
// | name        | shape / type         | meaning                                                             |
// | ----------- | -------------------- | ------------------------------------------------------------------- |
// | logits      | [M, E], row stride   | bf16 / fp16 (raw 16-bit words) or fp32                              |
// | bias        | [E] fp32 or null     | correction bias, only to choose                                     |
// | topk_ids    | [M, top_k] int32     | out: experts, -1 for none                                           |
// | topk_w      | [M, top_k] fp32      | out: routed weights                                                 |
// | sorted_ids  | [max_blocks * B]     | out: slots grouped by expert, each run padded with S = M * top_k;   |
// |             | int32                | entries past num_post_pad are not written                           |
// | expert_ids  | [max_blocks] int32   | out: expert of each block, -1 past the used ones                    |
// | npad        | [1] int32            | out: num_tokens_post_padded (a multiple of B)                       |
//
// Launch: grid (SVR_CLUSTER,) = one cluster, block (SVR_THREADS,); the cluster shape is compiled in
// (__cluster_dims__), so a plain launch works, in CUDA-graph capture too. Nothing needs to be zero on entry.
#pragma once

#define SVR_WARPS 8
#define SVR_THREADS (SVR_WARPS * 32)
#define SVR_CLUSTER 8
#define SVR_MAX_E 512
#define SVR_EPL (SVR_MAX_E / 32)
#define SVR_MAX_TOPK 8
#define SVR_MAX_SLOTS (SVR_CLUSTER * SVR_WARPS * SVR_MAX_TOPK)
#define SVR_INT_MIN (-2147483647 - 1)
#define SVR_NEG_INF __int_as_float(0xff800000)
#define SVR_NAN __int_as_float(0x7fc00000)

namespace svroute {

// 16-bit logits arrive as raw words (no cuda_bf16.h / cuda_fp16.h: NVRTC through CuPy may not have them)
struct Bf16 { unsigned short bits; };
struct F16 { unsigned short bits; };
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(Bf16 v) { return __uint_as_float(((unsigned int)v.bits) << 16); }
__device__ __forceinline__ float to_f32(F16 v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}

// order-preserving int32 image of a float without NaN (-0.0 as +0.0); -inf maps to the smallest finite image's
// neighbour, so "c == -inf" is "ordered == ORD_NEG_INF"
__device__ __forceinline__ int ordered(float v) {
  v = (v == 0.0f) ? 0.0f : v;
  int u = __float_as_int(v);
  return u ^ ((u >> 31) & 0x7FFFFFFF);
}
#define SVR_ORD_NEG_INF (-2139095041)

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ unsigned map_to_rank(unsigned addr, unsigned rank) {
  unsigned out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}
__device__ __forceinline__ void st_cluster(unsigned addr, int v) {
  asm volatile("st.shared::cluster.s32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T>
__device__ void route_row(const T* __restrict__ logits, long long stride_lm, const float* __restrict__ bias,
                          int row, int E, int top_k, int n_group, int topk_group, int softmax, int renorm,
                          float scale, int* __restrict__ topk_ids, float* __restrict__ topk_w, int lane,
                          int* slot_ids /* [top_k] for the caller, lane 0 */) {
  float s[SVR_EPL], c[SVR_EPL];
  const T* x = logits + (long long)row * stride_lm;
#pragma unroll
  for (int j = 0; j < SVR_EPL; ++j) {
    int e = lane + 32 * j;
    float v = (e < E) ? to_f32(x[e]) : SVR_NEG_INF;
    s[j] = v;
  }
  if (softmax) {
    bool has_nan = false;
    float mx = SVR_NEG_INF;
#pragma unroll
    for (int j = 0; j < SVR_EPL; ++j) {
      has_nan |= (s[j] != s[j]);
      mx = fmaxf(mx, s[j]);
    }
    has_nan = __any_sync(0xffffffffu, has_nan);
    mx = warp_max(mx);
    float den = 0.0f;
#pragma unroll
    for (int j = 0; j < SVR_EPL; ++j) {
      s[j] = (lane + 32 * j < E) ? expf(s[j] - mx) : 0.0f;
      den += s[j];
    }
    den = warp_sum(den);
#pragma unroll
    for (int j = 0; j < SVR_EPL; ++j) s[j] = has_nan ? SVR_NAN : s[j] / den;
  } else {
#pragma unroll
    for (int j = 0; j < SVR_EPL; ++j) s[j] = 1.0f / (1.0f + expf(-s[j]));
  }
#pragma unroll
  for (int j = 0; j < SVR_EPL; ++j) {
    int e = lane + 32 * j;
    float v = s[j] + ((bias != nullptr && e < E) ? bias[e] : 0.0f);
    bool finite = (e < E) && (v == v) && (fabsf(v) != -SVR_NEG_INF);
    c[j] = finite ? v : SVR_NEG_INF;
  }
  if (n_group > 1) {
    // group score: the sum of the two best c of the group (one best if the group has one expert); NaN -> -inf
    int gsize = E / n_group;
    unsigned keep = 0;  // bit g: group g kept (n_group <= 32)
    float gscore_lane = SVR_NEG_INF;  // lane g holds group g's score
    for (int g = 0; g < n_group; ++g) {
      float m1 = SVR_NEG_INF, m2 = SVR_NEG_INF;
#pragma unroll
      for (int j = 0; j < SVR_EPL; ++j) {
        int e = lane + 32 * j;
        if (e < E && e / gsize == g) {
          float v = c[j];
          if (v > m1) { m2 = m1; m1 = v; } else if (v > m2) { m2 = v; }
        }
      }
      for (int o = 16; o > 0; o >>= 1) {
        float a1 = __shfl_xor_sync(0xffffffffu, m1, o), a2 = __shfl_xor_sync(0xffffffffu, m2, o);
        float hi = fmaxf(m1, a1);
        float lo = fmaxf(fminf(m1, a1), fmaxf(m2, a2));
        m1 = hi;
        m2 = lo;
      }
      float sc = (gsize >= 2) ? m1 + m2 : m1;
      sc = (sc == sc) ? sc : SVR_NEG_INF;
      if (lane == g) gscore_lane = sc;
    }
    for (int t = 0; t < topk_group; ++t) {
      int key = (lane < n_group && !((keep >> lane) & 1u)) ? ordered(gscore_lane) : SVR_INT_MIN;
      int best = __reduce_max_sync(0xffffffffu, key);
      unsigned cand = (key == best && lane < n_group && !((keep >> lane) & 1u)) ? (unsigned)lane : 0xffffffffu;
      unsigned g = __reduce_min_sync(0xffffffffu, cand);
      if (g < 32u) keep |= 1u << g;
    }
#pragma unroll
    for (int j = 0; j < SVR_EPL; ++j) {
      int e = lane + 32 * j;
      if (e >= E || !((keep >> (e / gsize)) & 1u)) c[j] = SVR_NEG_INF;
    }
  }
  // top_k rounds of a warp argmax
  float wsum = 0.0f;
  float my_w = 0.0f;
  int my_id = -1;
  for (int k = 0; k < top_k; ++k) {
    int lbest = SVR_INT_MIN, lidx = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < SVR_EPL; ++j) {
      int o = ordered(c[j]);
      int e = lane + 32 * j;
      if (o > lbest) { lbest = o; lidx = e; }  // j ascending: ties keep the lower expert id
    }
    int best = __reduce_max_sync(0xffffffffu, lbest);
    unsigned cand = (lbest == best) ? (unsigned)lidx : 0xffffffffu;
    int win = (int)__reduce_min_sync(0xffffffffu, cand);
    bool none = (best <= SVR_ORD_NEG_INF);
    float ws = 0.0f;
    if (!none && (win & 31) == lane) {
      int jw = win >> 5;
#pragma unroll
      for (int j = 0; j < SVR_EPL; ++j)
        if (j == jw) { ws = s[j]; c[j] = SVR_NEG_INF; }
    }
    ws = __shfl_sync(0xffffffffu, ws, win & 31);
    if (none) ws = 0.0f;
    wsum += ws;
    if (lane == k) { my_id = none ? -1 : win; my_w = ws; }
    if (lane == 0) slot_ids[k] = none ? -1 : win;
  }
  if (renorm && wsum > 0.0f) my_w = my_w / wsum;
  my_w *= scale;
  if (lane < top_k) {
    topk_ids[(long long)row * top_k + lane] = my_id;
    topk_w[(long long)row * top_k + lane] = my_w;
  }
}

template <typename T>
__device__ void route_align(const T* __restrict__ logits, long long stride_lm, const float* __restrict__ bias,
                            int* __restrict__ topk_ids, float* __restrict__ topk_w, int* __restrict__ sorted_ids,
                            int* __restrict__ expert_ids, int* __restrict__ npad, int M, int E, int top_k,
                            int n_group, int topk_group, int softmax, int renorm, float scale, int block_size,
                            int max_blocks) {
  __shared__ int s_ids[SVR_MAX_SLOTS];   // CTA 0: every slot's expert (written by all CTAs)
  __shared__ int s_cnt[SVR_MAX_E];       // CTA 0: tokens per expert
  __shared__ int s_offs[SVR_MAX_E];      // CTA 0: padded start offset per expert
  __shared__ int s_warp[SVR_WARPS];
  __shared__ int s_slot[SVR_WARPS][SVR_MAX_TOPK];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned rank = cluster_rank();
  cluster_arrive_relaxed();  // "this CTA has started": waited for before the first remote store
  const int row = (int)rank * SVR_WARPS + warp;
  if (row < M) {
    route_row(logits, stride_lm, bias, row, E, top_k, n_group, topk_group, softmax, renorm, scale, topk_ids,
              topk_w, lane, s_slot[warp]);
  }
  __syncwarp();
  if (rank == 0) {
    for (int e = threadIdx.x; e < SVR_MAX_E; e += SVR_THREADS) s_cnt[e] = 0;
  }
  cluster_wait();  // every CTA of the cluster runs: its shared memory may be written
  if (row < M && lane < top_k) {
    unsigned dst = map_to_rank(smem_addr(&s_ids[row * top_k + lane]), 0);
    st_cluster(dst, s_slot[warp][lane]);
  }
  cluster_arrive_release();
  cluster_wait_acquire();  // CTA 0 sees every slot's expert
  if (rank != 0) return;

  const int S = M * top_k;
  int my_slot[2], my_rank[2], my_e[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    int sl = threadIdx.x + i * SVR_THREADS;
    int e = (sl < S) ? s_ids[sl] : -1;
    bool ok = (e >= 0 && e < E);
    my_slot[i] = sl;
    my_e[i] = ok ? e : -1;
    my_rank[i] = ok ? atomicAdd(&s_cnt[e], 1) : 0;
  }
  __syncthreads();
  // exclusive scan of the block-padded counts over SVR_MAX_E experts: two per thread, warp scans, warp totals
  int e0 = 2 * threadIdx.x, e1 = e0 + 1;
  int c0 = (e0 < E) ? s_cnt[e0] : 0, c1 = (e1 < E) ? s_cnt[e1] : 0;
  int p0 = (c0 + block_size - 1) / block_size * block_size, p1 = (c1 + block_size - 1) / block_size * block_size;
  int v = p0 + p1, incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    int t = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += t;
  }
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  int base = 0, total = 0;
  for (int w = 0; w < SVR_WARPS; ++w) {
    int t = s_warp[w];
    if (w < warp) base += t;
    total += t;
  }
  int off0 = base + incl - v, off1 = off0 + p0;
  if (e0 < SVR_MAX_E) s_offs[e0] = off0;
  if (e1 < SVR_MAX_E) s_offs[e1] = off1;
  if (threadIdx.x == 0) *npad = total;
  // each expert's padding (sentinel S) and block ids, by the thread that owns the expert
  for (int q = c0; q < p0; ++q) sorted_ids[off0 + q] = S;
  for (int q = c1; q < p1; ++q) sorted_ids[off1 + q] = S;
  for (int b = 0; b < p0 / block_size; ++b) expert_ids[off0 / block_size + b] = e0;
  for (int b = 0; b < p1 / block_size; ++b) expert_ids[off1 / block_size + b] = e1;
  for (int b = total / block_size + threadIdx.x; b < max_blocks; b += SVR_THREADS) expert_ids[b] = -1;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 2; ++i)
    if (my_e[i] >= 0) sorted_ids[s_offs[my_e[i]] + my_rank[i]] = my_slot[i];
}

}  // namespace svroute
