// Shared device helpers, prepended to every kernel source.
//
// Header-free on purpose: NVRTC compiles these with no CUDA toolkit headers, so running Tessera
// needs only the driver and libnvrtc. bf16 values are raw `unsigned short` bit patterns;
// conversions and tensor-core instructions are inline PTX (sm_80+).

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF (__int_as_float(0xff800000))

// A tensor map for the tensor-memory accelerator (the driver's CUtensorMap, 128 opaque bytes),
// encoded by the host and passed by value as a `const __grid_constant__` kernel parameter.
struct __align__(64) TmaDesc {
    u64 v[16];
};

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(bf16 v) { return __uint_as_float(((u32)v) << 16); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float v) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
    return r;
}

// c (16×8 f32 fragment) += a (16×16 bf16, row-major fragment) · b (16×8 bf16, column fragment):
// one warp's mma.sync.m16n8k16 (sm_80+), as attention.cu, image.cu and gemv.cu issue it.
__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two floats → packed bf16x2 (lo in bits 0..15), round to nearest even.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 2^x on the special-function unit (relative error ~2^-22); subnormal results flush to zero and
// -inf gives 0, which is all softmax weights and activations need.
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Sum over the warp; every lane gets it.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block; every thread gets the total. `sh` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* sh) {
    v = warp_sum(v);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();  // `sh` may still be read from a previous call
    if (l == 0) sh[w] = v;
    __syncthreads();
    const int nw = (blockDim.x + 31) >> 5;
    v = l < nw ? sh[l] : 0.f;
    return warp_sum(v);
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}

// Four consecutive values as one 16-byte (f32) or 8-byte (bf16) access; the address must be aligned
// to it.
__device__ __forceinline__ void load4(const float* p, float* v) {
    const uint4 t = *reinterpret_cast<const uint4*>(p);
    v[0] = __uint_as_float(t.x);
    v[1] = __uint_as_float(t.y);
    v[2] = __uint_as_float(t.z);
    v[3] = __uint_as_float(t.w);
}
__device__ __forceinline__ void load4(const bf16* p, float* v) {
    const uint2 t = *reinterpret_cast<const uint2*>(p);
    v[0] = __uint_as_float(t.x << 16);
    v[1] = __uint_as_float(t.x & 0xffff0000u);
    v[2] = __uint_as_float(t.y << 16);
    v[3] = __uint_as_float(t.y & 0xffff0000u);
}
__device__ __forceinline__ void store4(float* p, const float* v) {
    uint4 t;
    t.x = __float_as_uint(v[0]);
    t.y = __float_as_uint(v[1]);
    t.z = __float_as_uint(v[2]);
    t.w = __float_as_uint(v[3]);
    *reinterpret_cast<uint4*>(p) = t;
}
__device__ __forceinline__ void store4(bf16* p, const float* v) {
    uint2 t;
    t.x = pack_bf16x2(v[0], v[1]);
    t.y = pack_bf16x2(v[2], v[3]);
    *reinterpret_cast<uint2*>(p) = t;
}
// Two adjacent values in one 8- (f32) or 4-byte (bf16) store; `p` aligned to it.
__device__ __forceinline__ void store2(float* p, float a, float b) {
    uint2 t;
    t.x = __float_as_uint(a);
    t.y = __float_as_uint(b);
    *reinterpret_cast<uint2*>(p) = t;
}
__device__ __forceinline__ void store2(bf16* p, float a, float b) { *reinterpret_cast<u32*>(p) = pack_bf16x2(a, b); }

// gelu_tanh(x) = ½x(1 + tanh u) = x·σ(2u), u = √(2/π)(x + 0.044715x³): one special-function op
// and a fast division instead of tanhf's longer sequence, within a few f32 ulps of it. The gated
// kernels are memory-bound, so this saves little: W3's 6.33 → 6.15 ms per pass, W2's 0.40 →
// 0.36 ms (H200 runs 12 and 14).
__device__ __forceinline__ float gelu_tanh(float x) {
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return __fdividef(x, 1.f + ex2(-2.f * 1.4426950408889634f * u));
}
__device__ __forceinline__ float silu(float x) { return __fdividef(x, 1.f + ex2(-1.4426950408889634f * x)); }

// Programmatic dependent launch (Hopper): the host launches every kernel allowed to start while
// the kernel before it in the stream is still running (launch.rs), so every kernel begins with
// pdl_enter: it lets its own successor launch, then waits until its predecessor has finished and
// that one's writes are visible. No kernel reads or writes global memory before the wait (CI checks
// the PTX: tests/nvrtc_compile.rs). A no-op before sm_90 and for launches without the attribute.
// (GEMVs that also asked L2 for their weight tile before the wait decoded one stream slower: run g8.)
__device__ __forceinline__ void pdl_enter() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// *p += v on a shared-memory double (sm_60+), without the CUDA headers' atomicAdd.
__device__ __forceinline__ void shared_add_f64(double* p, double v) {
    asm volatile("red.shared.add.f64 [%0], %1;" ::"r"(smem_addr(p)), "d"(v) : "memory");
}

// cp.async: one 16-byte copy global → shared (`valid` false: 0 bytes read, the 16 destination
// bytes zero-filled), its group commit and waits.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;  // 0 bytes read: the 16 destination bytes are zero-filled
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N of this thread's cp.async groups are pending.
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

// The activation codes of `act_code` (cuda/gemm.rs): −1 none, 0 GELU (tanh), 1 SiLU. The erf
// GELU (2) is declined before any image kernel runs.
__device__ __forceinline__ float image_act(int act, float v) {
    if (act == 0) return gelu_tanh(v);
    if (act == 1) return silu(v);
    return v;
}
// A 16-byte chunk of eight bf16 values (in registers) → bf16(act(x)) each: the convolutions'
// fused input activation (act(0) = 0 keeps zero padding zero).
__device__ __forceinline__ void image_act8(int act, uint4& chunk) {
    bf16* e = reinterpret_cast<bf16*>(&chunk);
#pragma unroll
    for (int j = 0; j < 8; j++) e[j] = from_f<bf16>(image_act(act, to_f(e[j])));
}
