// Low-latency allreduce across ranks that map each other's memory through CUDA IPC.
//
// Device code only: no torch, no host headers, nothing NVRTC lacks (fp16/bf16 conversions are written out here
// rather than taken from cuda_fp16.h / cuda_bf16.h), so the same text compiles through NVRTC (CuPy RawModule) and
// through nvcc -arch=sm_90.
//
// Math
//   one-shot   out[i] = sum_{p < world} x_p[i]                      every rank reads every peer's copy
//   two-shot   rank r owns shard r; reduce-scatter: s_r = sum_p x_p[shard r], then all-gather the s_q
//   fused      y   = sum_p x_p[row] + residual[row]   (rounded to the dtype, written back to residual)
//              out = y * rsqrt(mean(y^2) + eps) * weight                 (fp32 arithmetic, one rounding)
//   Sums run in fp32 in rank order 0..world-1 on every rank, so every rank gets bit-identical results.
//
// Memory of one rank (one cudaMalloc, shared with the peers through a CUDA IPC handle), `base`:
// | bytes                         | what                                  | written by             |
// | ----------------------------- | ------------------------------------- | ---------------------- |
// | [0, 4)                        | error word (0 ok, else SV_ERR_*)       | this rank              |
// | [64, 64 + 4*MAX_BLOCKS)       | epoch[b]: calls block b has made       | this rank              |
// | flags: kFlagOffset, 2 phases  | flag[phase][b][p]: peer p's epoch      | peer p (remote stores) |
// | [kDataOffset, + 2*slot_bytes) | staging slots 0 and 1 (double buffer)  | this rank (copy-in, two-shot partials) |
//
// Kernel arguments (all kernels)
// | name        | type                  | meaning                                                            |
// | ----------- | --------------------- | ------------------------------------------------------------------ |
// | inp         | T* (device)           | this rank's input, 16-byte aligned, n elements (fused: rows*hidden) |
// | out         | T* (device)           | output, 16-byte aligned, same size; may alias inp                   |
// | n           | int64                 | elements                                                           |
// | b0..b7      | u64                   | every rank's `base` mapped into this process (unused ones 0)      |
// | rank, world | int32                 | this rank, number of ranks (2..8)                                  |
// | slot_bytes  | int64                 | bytes of one staging slot (n * sizeof(T) must fit)                 |
// | host_err    | int32* (pinned host)  | mirrors the error word so the host can read it without a sync     |
// | timeout_ns  | int64                 | how long a flag wait may spin before giving up                     |
//
// Synchronisation: every launch uses the same grid (gridDim.x blocks, fixed per communicator), so block b's epoch
// counts the same calls on every rank. Block b first copies its share of the input into this rank's staging slot
// (epoch & 1), then stores its epoch into flag[phase][b][rank] of every peer (release, system scope) and spins on
// its own flag[phase][b][p] (acquire) until every peer has reached the same epoch. Only then does it read peers'
// slots. A slot is written again two calls later; by then every peer has started the next call (it signalled the
// barrier of call e+1), and a stream runs its kernels in order, so no peer still reads it: double buffering
// without a second barrier. A wait longer than timeout_ns writes SV_ERR_TIMEOUT to the error word and the pinned
// host word and returns; later launches see the error word and return at once (the host raises).
#pragma once

#define SV_MAX_RANKS 8
#define SV_MAX_BLOCKS 64
#define SV_ERR_TIMEOUT 1
#define SV_ERR_BAD_ARGS 2

namespace specverify {
namespace ar {

constexpr unsigned long long kEpochOffset = 64;
constexpr unsigned long long kFlagOffset = 512;
constexpr unsigned long long kFlagPhaseBytes = 4ull * SV_MAX_BLOCKS * SV_MAX_RANKS;
constexpr unsigned long long kDataOffset = 8192;  // after the flags; 16-byte (and 128-byte) aligned

struct Pack {  // 16 bytes moved by one vector load/store
  unsigned int w[4];
};

// ---- memory operations (inline PTX so both NVRTC and nvcc accept them unchanged) ----------------------------------

__device__ __forceinline__ Pack load_pack_cg(const void* p) {  // bypass L1: peers' data is written by other SMs
  Pack v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
               : "l"(p));
  return v;
}

__device__ __forceinline__ Pack load_pack(const void* p) {
  Pack v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
               : "l"(p));
  return v;
}

__device__ __forceinline__ void store_pack(void* p, const Pack& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.w[0]), "r"(v.w[1]), "r"(v.w[2]),
               "r"(v.w[3])
               : "memory");
}

__device__ __forceinline__ unsigned int load_acquire_sys(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release_sys(unsigned int* p, unsigned int v) {
  asm volatile("fence.acq_rel.sys;\n\tst.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned int load_volatile_u32(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_volatile_s32(int* p, int v) {
  asm volatile("st.volatile.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---- element types: 16-byte packs <-> fp32 -----------------------------------------------------------------------

__device__ __forceinline__ float bf16_to_f32(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }

__device__ __forceinline__ unsigned short f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}

__device__ __forceinline__ float f16_to_f32(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ unsigned short f32_to_f16(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

struct F32 {
  static constexpr int kPack = 4;
  typedef float Elem;
  __device__ static __forceinline__ float to_f32(float x) { return x; }
  __device__ static __forceinline__ float from_f32(float x) { return x; }
  __device__ static __forceinline__ void unpack(const Pack& p, float* f) {
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = __uint_as_float(p.w[i]);
  }
  __device__ static __forceinline__ Pack pack(const float* f) {
    Pack p;
#pragma unroll
    for (int i = 0; i < 4; ++i) p.w[i] = __float_as_uint(f[i]);
    return p;
  }
};

template <bool kBf16>
struct Half16 {  // bf16 (kBf16) or fp16, stored as raw 16-bit words
  static constexpr int kPack = 8;
  typedef unsigned short Elem;
  __device__ static __forceinline__ float to_f32(unsigned short x) { return kBf16 ? bf16_to_f32(x) : f16_to_f32(x); }
  __device__ static __forceinline__ unsigned short from_f32(float x) { return kBf16 ? f32_to_bf16(x) : f32_to_f16(x); }
  __device__ static __forceinline__ void unpack(const Pack& p, float* f) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = to_f32((unsigned short)(p.w[i] & 0xffffu));
      f[2 * i + 1] = to_f32((unsigned short)(p.w[i] >> 16));
    }
  }
  __device__ static __forceinline__ Pack pack(const float* f) {
    Pack p;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      p.w[i] = (unsigned int)from_f32(f[2 * i]) | ((unsigned int)from_f32(f[2 * i + 1]) << 16);
    }
    return p;
  }
};

typedef Half16<true> BF16;
typedef Half16<false> F16;

// ---- the rank table and the barrier -------------------------------------------------------------------------------

struct Ranks {
  // Every rank's base, as eight fields rather than an array: an array indexed at run time would live in local
  // memory; base_at() with a constant index (unrolled loops) folds to a register.
  char* b0;
  char* b1;
  char* b2;
  char* b3;
  char* b4;
  char* b5;
  char* b6;
  char* b7;
  char* self;  // base of this rank
  int rank;
  int world;
};

__device__ __forceinline__ char* base_at(const Ranks& r, int p) {
  switch (p) {
    case 0: return r.b0;
    case 1: return r.b1;
    case 2: return r.b2;
    case 3: return r.b3;
    case 4: return r.b4;
    case 5: return r.b5;
    case 6: return r.b6;
    default: return r.b7;
  }
}

__device__ __forceinline__ Ranks make_ranks(unsigned long long b0, unsigned long long b1, unsigned long long b2,
                                            unsigned long long b3, unsigned long long b4, unsigned long long b5,
                                            unsigned long long b6, unsigned long long b7, int rank, int world) {
  Ranks r;
  r.b0 = (char*)b0;
  r.b1 = (char*)b1;
  r.b2 = (char*)b2;
  r.b3 = (char*)b3;
  r.b4 = (char*)b4;
  r.b5 = (char*)b5;
  r.b6 = (char*)b6;
  r.b7 = (char*)b7;
  r.self = base_at(r, rank);
  r.rank = rank;
  r.world = world;
  return r;
}

__device__ __forceinline__ int* error_word(char* base) { return (int*)base; }

__device__ __forceinline__ unsigned int* epoch_word(char* base, int block) {
  return (unsigned int*)(base + kEpochOffset) + block;
}

__device__ __forceinline__ unsigned int* flag_word(char* base, int phase, int block, int peer) {
  return (unsigned int*)(base + kFlagOffset + phase * kFlagPhaseBytes) + block * SV_MAX_RANKS + peer;
}

__device__ __forceinline__ char* slot_ptr(char* base, unsigned int epoch, long long slot_bytes) {
  return base + kDataOffset + (long long)(epoch & 1u) * slot_bytes;
}

// Start of a call: read this block's epoch, advance it, and say whether an earlier call failed. Every thread
// gets the new epoch; returns false when the kernel must return at once.
__device__ __forceinline__ bool begin_call(const Ranks& r, unsigned int* epoch_out) {
  __shared__ unsigned int s_epoch;
  __shared__ int s_ok;
  if (threadIdx.x == 0) {
    char* self = r.self;
    int err = (int)load_volatile_u32((const unsigned int*)error_word(self));
    unsigned int e = *epoch_word(self, blockIdx.x) + 1u;
    if (e == 0u) e = 1u;  // 0 is the value of a never-written flag; skip it when the counter wraps
    *epoch_word(self, blockIdx.x) = e;
    s_epoch = e;
    s_ok = (err == 0) && (r.world >= 2) && (r.world <= SV_MAX_RANKS) && (gridDim.x <= SV_MAX_BLOCKS);
  }
  __syncthreads();
  *epoch_out = s_epoch;
  return s_ok != 0;
}

// Flag barrier of block blockIdx.x at `phase`: after it, every peer's block blockIdx.x has finished what it did
// before its own barrier call of the same epoch. Returns false on timeout or when another block failed.
__device__ __forceinline__ bool barrier(const Ranks& r, int phase, unsigned int epoch, int* host_err,
                                        long long timeout_ns) {
  __shared__ int s_ok;
  if (threadIdx.x == 0) s_ok = 1;
  __syncthreads();  // every thread's earlier stores are ordered before the release below
  const int p = threadIdx.x;
  if (p < r.world) {
    char* self = r.self;
    char* peer = base_at(r, p);
    store_release_sys(flag_word(peer, phase, blockIdx.x, r.rank), epoch);
    const unsigned int* mine = flag_word(self, phase, blockIdx.x, p);
    const unsigned long long start = global_timer_ns();
    unsigned int spins = 0;
    // Wrap-safe "flag >= epoch": peers are at most one epoch ahead.
    while ((int)(load_acquire_sys(mine) - epoch) < 0) {
      if ((++spins & 1023u) == 0u) {
        if (load_volatile_u32((const unsigned int*)error_word(self)) != 0u) {
          s_ok = 0;
          break;
        }
        if ((long long)(global_timer_ns() - start) > timeout_ns) {
          store_volatile_s32(error_word(self), SV_ERR_TIMEOUT);
          if (host_err != 0) store_volatile_s32(host_err, SV_ERR_TIMEOUT);
          s_ok = 0;
          break;
        }
      }
    }
  }
  __syncthreads();
  return s_ok != 0;
}

// ---- kernels -----------------------------------------------------------------------------------------------------

// Elements past the last whole pack (n % kPack of them) are summed one by one by block 0, one-shot style; block 0
// copies them in before its first barrier, so they are visible to every peer's block 0 after it.
template <typename T>
__device__ __forceinline__ void copy_tail_in(const typename T::Elem* inp, typename T::Elem* stage, long long first,
                                             long long n) {
  if (blockIdx.x != 0) return;
  for (long long i = first + threadIdx.x; i < n; i += blockDim.x) stage[i] = inp[i];
}

template <typename T>
__device__ __forceinline__ void reduce_tail(const Ranks& r, unsigned int epoch, long long slot_bytes,
                                            typename T::Elem* out, long long first, long long n) {
  if (blockIdx.x != 0) return;
  for (long long i = first + threadIdx.x; i < n; i += blockDim.x) {
    float acc = 0.f;
#pragma unroll
    for (int p = 0; p < SV_MAX_RANKS; ++p) {
      if (p < r.world) {
        const volatile typename T::Elem* src =
            (const volatile typename T::Elem*)slot_ptr(base_at(r, p), epoch, slot_bytes);
        acc += T::to_f32(src[i]);
      }
    }
    out[i] = T::from_f32(acc);
  }
}

template <typename T>
__device__ __forceinline__ void one_shot(const typename T::Elem* inp, typename T::Elem* out, long long n, const Ranks& r,
                         long long slot_bytes, int* host_err, long long timeout_ns) {
  unsigned int epoch;
  if (!begin_call(r, &epoch)) return;
  const long long packs = n / T::kPack;
  const long long tail_first = packs * T::kPack;
  char* my_slot = slot_ptr(r.self, epoch, slot_bytes);
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (long long j = first; j < packs; j += stride) {
    store_pack(my_slot + j * 16, load_pack(inp + j * T::kPack));
  }
  copy_tail_in<T>(inp, (typename T::Elem*)my_slot, tail_first, n);
  if (!barrier(r, 0, epoch, host_err, timeout_ns)) return;
  for (long long j = first; j < packs; j += stride) {
    float acc[T::kPack];
    float v[T::kPack];
#pragma unroll
    for (int k = 0; k < T::kPack; ++k) acc[k] = 0.f;
#pragma unroll
    for (int p = 0; p < SV_MAX_RANKS; ++p) {
      if (p < r.world) {
        T::unpack(load_pack_cg(slot_ptr(base_at(r, p), epoch, slot_bytes) + j * 16), v);
#pragma unroll
        for (int k = 0; k < T::kPack; ++k) acc[k] += v[k];
      }
    }
    store_pack(out + j * T::kPack, T::pack(acc));
  }
  reduce_tail<T>(r, epoch, slot_bytes, out, tail_first, n);
}

template <typename T>
__device__ __forceinline__ void two_shot(const typename T::Elem* inp, typename T::Elem* out, long long n, const Ranks& r,
                         long long slot_bytes, int* host_err, long long timeout_ns) {
  unsigned int epoch;
  if (!begin_call(r, &epoch)) return;
  const long long packs = n / T::kPack;
  const long long tail_first = packs * T::kPack;
  const long long shard = (packs + r.world - 1) / r.world;  // packs per rank; the last shard may be short
  char* my_slot = slot_ptr(r.self, epoch, slot_bytes);
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  // Copy-in: block b copies its part of every shard (the part peers' block b will read).
  for (int q = 0; q < r.world; ++q) {
    for (long long i = first; i < shard; i += stride) {
      const long long j = q * shard + i;
      if (j < packs) store_pack(my_slot + j * 16, load_pack(inp + j * T::kPack));
    }
  }
  copy_tail_in<T>(inp, (typename T::Elem*)my_slot, tail_first, n);
  if (!barrier(r, 0, epoch, host_err, timeout_ns)) return;
  // Reduce-scatter: sum this rank's shard over all ranks, in place in this rank's slot (peers read only their own
  // shards of it during this phase).
  for (long long i = first; i < shard; i += stride) {
    const long long j = (long long)r.rank * shard + i;
    if (j >= packs) break;
    float acc[T::kPack];
    float v[T::kPack];
#pragma unroll
    for (int k = 0; k < T::kPack; ++k) acc[k] = 0.f;
#pragma unroll
    for (int p = 0; p < SV_MAX_RANKS; ++p) {
      if (p < r.world) {
        T::unpack(load_pack_cg(slot_ptr(base_at(r, p), epoch, slot_bytes) + j * 16), v);
#pragma unroll
        for (int k = 0; k < T::kPack; ++k) acc[k] += v[k];
      }
    }
    store_pack(my_slot + j * 16, T::pack(acc));
  }
  reduce_tail<T>(r, epoch, slot_bytes, out, tail_first, n);
  if (!barrier(r, 1, epoch, host_err, timeout_ns)) return;
  // All-gather: shard q comes from rank q's slot.
#pragma unroll
  for (int q = 0; q < SV_MAX_RANKS; ++q) {
    if (q < r.world) {
      const char* src = slot_ptr(base_at(r, q), epoch, slot_bytes);
      for (long long i = first; i < shard; i += stride) {
        const long long j = q * shard + i;
        if (j < packs) store_pack(out + j * T::kPack, load_pack_cg(src + j * 16));
      }
    }
  }
}

__device__ __forceinline__ float block_sum(float x) {
  __shared__ float s_part[32];
  __shared__ float s_total;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  if (lane == 0) s_part[warp] = x;
  __syncthreads();
  if (warp == 0) {
    float y = (lane < (int)((blockDim.x + 31) >> 5)) ? s_part[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) y += __shfl_xor_sync(0xffffffffu, y, o);
    if (lane == 0) s_total = y;
  }
  __syncthreads();
  const float total = s_total;
  __syncthreads();  // s_part / s_total may be reused by the next row
  return total;
}

// One-shot allreduce of [rows, hidden] followed by residual add and RMSNorm, one row per block at a time.
// hidden % T::kPack == 0 (checked on the host).
template <typename T>
__device__ __forceinline__ void one_shot_rmsnorm(const typename T::Elem* inp, typename T::Elem* out, typename T::Elem* residual,
                                 const typename T::Elem* weight, long long rows, long long hidden, float eps,
                                 const Ranks& r, long long slot_bytes, int* host_err, long long timeout_ns) {
  unsigned int epoch;
  if (!begin_call(r, &epoch)) return;
  const long long row_packs = hidden / T::kPack;
  char* my_slot = slot_ptr(r.self, epoch, slot_bytes);
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    for (long long j = row * row_packs + threadIdx.x; j < (row + 1) * row_packs; j += blockDim.x) {
      store_pack(my_slot + j * 16, load_pack(inp + j * T::kPack));
    }
  }
  if (!barrier(r, 0, epoch, host_err, timeout_ns)) return;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    float sumsq = 0.f;
    for (long long j = row * row_packs + threadIdx.x; j < (row + 1) * row_packs; j += blockDim.x) {
      float acc[T::kPack];
      float v[T::kPack];
#pragma unroll
      for (int k = 0; k < T::kPack; ++k) acc[k] = 0.f;
#pragma unroll
      for (int p = 0; p < SV_MAX_RANKS; ++p) {
        if (p < r.world) {
          T::unpack(load_pack_cg(slot_ptr(base_at(r, p), epoch, slot_bytes) + j * 16), v);
#pragma unroll
          for (int k = 0; k < T::kPack; ++k) acc[k] += v[k];
        }
      }
      T::unpack(load_pack(residual + j * T::kPack), v);  // peers first (rank order), then the residual
#pragma unroll
      for (int k = 0; k < T::kPack; ++k) acc[k] += v[k];
      const Pack y = T::pack(acc);
      store_pack(residual + j * T::kPack, y);
      T::unpack(y, v);  // the norm sees the rounded residual, as a separate add + norm would
#pragma unroll
      for (int k = 0; k < T::kPack; ++k) sumsq += v[k] * v[k];
    }
    const float inv_rms = rsqrtf(block_sum(sumsq) / (float)hidden + eps);
    for (long long j = row * row_packs + threadIdx.x; j < (row + 1) * row_packs; j += blockDim.x) {
      float y[T::kPack];
      float w[T::kPack];
      T::unpack(load_pack(residual + j * T::kPack), y);  // this thread wrote it above
      T::unpack(load_pack(weight + (j - row * row_packs) * T::kPack), w);
#pragma unroll
      for (int k = 0; k < T::kPack; ++k) y[k] = y[k] * inv_rms * w[k];
      store_pack(out + j * T::kPack, T::pack(y));
    }
  }
}

}  // namespace ar
}  // namespace specverify
