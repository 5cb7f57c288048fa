"""C++ stand-ins for the CUDA built-ins the kernels of ``shaders/cuda`` use, so g++ compiles them for the
host harnesses of test_backend_cuda_prefill.py and test_backend_cuda_imma.py (an OS thread per lane,
std::barrier per warp and per block; ``COLIBRI_HOST_WARP`` defined first: real warp shuffles and
``__syncwarp`` for warps of 32 OS threads). A harness is this prelude, then its own emulations (mma.sync,
shuffles, cp.async), then the kernel sources. ``COLIBRI_HOST_MMA`` drops the kernels' inline-PTX helpers;
``asm`` is defined away for the few inline ones left (matmul.cu's half conversion)."""

HOST_PRELUDE = r"""
#include <atomic>
#include <barrier>
#include <deque>
#include <thread>
#include <vector>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <cmath>
#include <algorithm>
using std::max;
using std::min;
#define __device__
#define __forceinline__ inline
#define __global__
#define __restrict__
#define __shared__
#define __launch_bounds__(...)
#define TC_SHARED static
#define COLIBRI_HOST_MMA
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
struct D3 { unsigned x, y, z; };
static thread_local D3 threadIdx;
static D3 blockIdx, blockDim, gridDim;
static float __int_as_float(unsigned v) { float f; memcpy(&f, &v, 4); return f; }
static float __uint_as_float(unsigned v) { return __int_as_float(v); }
static unsigned __float_as_uint(float f) { unsigned v; memcpy(&v, &f, 4); return v; }
static int __float2int_rn(float f) { return (int)std::nearbyint(f); }  // default mode: nearest even
static unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {  // CUDA semantics: bytes of {y, x}
  unsigned char in[8]; memcpy(in, &x, 4); memcpy(in + 4, &y, 4); unsigned r = 0;
  for (int n = 0; n < 4; n++) r |= (unsigned)in[(s >> (4 * n)) & 7] << (8 * n);
  return r; }
static std::barrier<> *block_bar;
static std::vector<std::barrier<> *> warp_bar;
#ifdef COLIBRI_HOST_WARP  // a warp of 32 OS threads: shuffles exchanged through memory between two barriers
static float shfl_f[1024];
static int shfl_i[1024];
template <class V> static V shfl_xor(V *x, V v, int m) {
  const unsigned t = threadIdx.x; std::barrier<> &b = *warp_bar[t >> 5];
  x[t] = v; b.arrive_and_wait(); const V r = x[t ^ m]; b.arrive_and_wait(); return r; }
static float __shfl_xor_sync(unsigned, float v, int m) { return shfl_xor(shfl_f, v, m); }
static int __shfl_xor_sync(unsigned, int v, int m) { return shfl_xor(shfl_i, v, m); }
static void __syncwarp(unsigned = 0xffffffffu) { warp_bar[threadIdx.x >> 5]->arrive_and_wait(); }
#else  // one thread per block: a warp of one lane
static float __shfl_xor_sync(unsigned, float v, int) { return v; }
#endif
static void __syncthreads() { block_bar->arrive_and_wait(); }
static float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
template <class T> T __ldg(const T *p) { return *p; }
static uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
static uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
#define asm(...) (f = 0.0f)
"""
