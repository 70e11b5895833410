// Entry points of the IPC allreduce (device code in allreduce.cuh; the math, memory layout and the flag protocol
// are described there).
//
// Every entry point is an extern "C" __global__ function so NVRTC (through CuPy RawModule, see
// specverify/jit.py) exports it under a plain name; the same file compiles with `nvcc -arch=sm_90 -c` (the
// `cuda_compile` test). The host-side checks (dtype, sizes, alignment, buffer capacity, world size) live in
// specverify/comm/custom_allreduce.py, which is the only caller; the kernels check again what would corrupt memory
// (world size, grid size, capacity) and report it through the error word instead of writing out of bounds.
//
// Names: specverify_ar_<algo>_<dtype>, algo in {one_shot, two_shot, one_shot_rmsnorm}, dtype in {bf16, f16, f32}.
// Launch: grid = (num_blocks,) with num_blocks <= SV_MAX_BLOCKS and the same on every rank and every call;
// block = (SV_AR_THREADS,).
#include "allreduce.cuh"

#define SV_AR_THREADS 512

namespace specverify {
namespace ar {

__device__ __forceinline__ bool capacity_ok(const Ranks& r, long long bytes, long long slot_bytes, int* host_err) {
  if (bytes <= slot_bytes && bytes >= 0) return true;
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    store_volatile_s32(error_word(r.self), SV_ERR_BAD_ARGS);
    if (host_err != 0) store_volatile_s32(host_err, SV_ERR_BAD_ARGS);
  }
  return false;
}

}  // namespace ar
}  // namespace specverify

#define SV_RANK_PARAMS                                                                                       \
  unsigned long long b0, unsigned long long b1, unsigned long long b2, unsigned long long b3,                \
      unsigned long long b4, unsigned long long b5, unsigned long long b6, unsigned long long b7, int rank, \
      int world, long long slot_bytes, unsigned long long host_err, long long timeout_ns

#define SV_RANKS specverify::ar::make_ranks(b0, b1, b2, b3, b4, b5, b6, b7, rank, world)

#define SV_DEFINE_ALLREDUCE(ALGO, SUFFIX, TYPE)                                                                \
  extern "C" __global__ void __launch_bounds__(SV_AR_THREADS, 1)                                                 \
      specverify_ar_##ALGO##_##SUFFIX(unsigned long long inp, unsigned long long out, long long n,            \
                                      SV_RANK_PARAMS) {                                                      \
    typedef specverify::ar::TYPE T;                                                                           \
    const specverify::ar::Ranks r = SV_RANKS;                                                                 \
    if (!specverify::ar::capacity_ok(r, n * (long long)sizeof(T::Elem), slot_bytes, (int*)host_err)) return; \
    specverify::ar::ALGO<T>((const T::Elem*)inp, (T::Elem*)out, n, r, slot_bytes, (int*)host_err,           \
                            timeout_ns);                                                                     \
  }

#define SV_DEFINE_RMSNORM(SUFFIX, TYPE)                                                                            \
  extern "C" __global__ void __launch_bounds__(SV_AR_THREADS, 1) specverify_ar_one_shot_rmsnorm_##SUFFIX(            \
      unsigned long long inp, unsigned long long out, unsigned long long residual, unsigned long long weight,   \
      long long rows, long long hidden, float eps, SV_RANK_PARAMS) {                                             \
    typedef specverify::ar::TYPE T;                                                                               \
    const specverify::ar::Ranks r = SV_RANKS;                                                                     \
    if (!specverify::ar::capacity_ok(r, rows * hidden * (long long)sizeof(T::Elem), slot_bytes, (int*)host_err)) \
      return;                                                                                                     \
    specverify::ar::one_shot_rmsnorm<T>((const T::Elem*)inp, (T::Elem*)out, (T::Elem*)residual,                 \
                                        (const T::Elem*)weight, rows, hidden, eps, r, slot_bytes,                \
                                        (int*)host_err, timeout_ns);                                             \
  }

SV_DEFINE_ALLREDUCE(one_shot, bf16, BF16)
SV_DEFINE_ALLREDUCE(one_shot, f16, F16)
SV_DEFINE_ALLREDUCE(one_shot, f32, F32)
SV_DEFINE_ALLREDUCE(two_shot, bf16, BF16)
SV_DEFINE_ALLREDUCE(two_shot, f16, F16)
SV_DEFINE_ALLREDUCE(two_shot, f32, F32)
SV_DEFINE_RMSNORM(bf16, BF16)
SV_DEFINE_RMSNORM(f16, F16)
SV_DEFINE_RMSNORM(f32, F32)
