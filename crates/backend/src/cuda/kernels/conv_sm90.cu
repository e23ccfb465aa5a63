// Convolution as an implicit GEMM on Hopper's warpgroup MMA (wgmma, sm_90a): conv_wgmma{BN}_{out}.
// Same arguments and result as conv_implicit in image.cu (which serves every other GPU), CPU
// reference crates/backend/src/cpu/conv.rs:
//
// out[p, n] = bias[n] + Σ_{ky, kx, c} act(x)[src(p, ky, kx), c] · wt[n, (ky·k + kx)·cin + c]
// (or out[p, n] += that, with `add`)
//
// over one channels-last image, bf16 in, f32 accumulation, one rounding to the output type.
//
// A CTA computes 128 output pixels × BN (64, 128, 144 or 256) output channels with two
// warpgroups, each 64 pixels × BN by wgmma m64n{BN}k16 with both operands in shared memory
// (wgmma.cuh's 128-byte swizzle). The reduction runs over the weight's row as stored, (ky, kx, c)
// flattened, in steps of 64 — one 128-byte row per pixel and per output channel. A step may span
// taps: each 16-byte piece (8 channels; cin is a multiple of 8) lies in one tap, so a 144-channel
// input takes 20¼ steps of the 9 × 144 products rather than 27 of 64-channel chunks per tap (one
// in four of them a quarter full). Every thread gathers: a step is one 16-byte cp.async per pixel
// row and per weight row, zero-filled for taps on the padding, pixels past the image, the
// reduction's end and output channels past cout. AHEAD = STAGES − 1 −
// KEEP steps load while one multiplies, and each warpgroup keeps KEEP steps' products in flight
// past its wait (CwCfg): the stage that step s + AHEAD fills was last read by step s − 1 − KEEP,
// which every warpgroup waited for before the barrier of step s. Where that leaves the kernel
// (run g15, H100): 334–432 TFLOP/s (250–300 in g10, when every gathered piece divided by the
// upsampling factor; see gather_src); the mma.sync kernel in image.cu ran at 100–180.
//
// The pixel → source map is conv_implicit's: nearest 2× upsampling reads (uy >> 1, ux >> 1);
// stride 2 reads (2·oy + ky, 2·ox + kx) padded only after. The input activation (act ≥ 0) is
// applied in shared memory by the thread that copied each chunk, after its copies land and
// before the fence that hands the stage to the tensor cores (bf16(act(x)), im2col8's rounding;
// act(0) = 0 keeps the padding zero).
//
// CTAs are numbered channel tile fastest, so the CTAs of one pixel tile run together and read
// its pixels once from memory. Needs cin a multiple of 8, x, its row stride and the weight's rows
// 16-byte aligned, and the (upsampled) image's sides below 2^15 (the host checks).
#define CW_BM 128
#define CW_THREADS 256

// The source of one gathered 16-byte piece: tap (ky, kx) of the pixel whose top-left tap is packed
// in `yx` (y high, x low 16 bits, in the upsampled image), channels c0..c0 + 7; `ok` false (and
// `x` returned) on the padding, past the last pixel or past the reduction (`kv`). Upsampling is a
// shift (`ush` 1 for 2×): a division by the runtime factor cost ~30 instructions a piece, which
// the gathering warps issue 12–16 times a step.
__device__ __forceinline__ const bf16* gather_src(const bf16* x, long xs, int w, int vh, int vw, int ush, int yx,
                                                  int ky, int kx, int c0, bool kv, bool& ok) {
    const int uy = (yx >> 16) + ky, ux = (int)(short)(yx & 0xffff) + kx;
    ok = kv && (unsigned)uy < (unsigned)vh && (unsigned)ux < (unsigned)vw;
    return ok ? x + (long)((uy >> ush) * w + (ux >> ush)) * xs + c0 : x;
}

// Output pixel p's top-left tap in the (upsampled) image, y in the high and x in the low 16 bits
// (sides below 2^15, the host checks); y far negative past the last pixel, so every tap of it
// falls outside the image.
__device__ __forceinline__ int pixel_corner(long p, long pixels, int ow, int down, int pad) {
    int oy = -(1 << 14), ox = 0;
    if (p < pixels) {
        const int py = (int)(p / ow), px = (int)(p - (long)py * ow);
        oy = py * down - pad;
        ox = px * down - pad;
    }
    return (int)(((u32)oy << 16) | ((u32)ox & 0xffffu));
}

// Where reduction index kf = (ky·k + kx)·cin + c0 lies: its tap and first channel (eight
// channels of one tap, cin a multiple of 8); `kv` false past the reduction's end kk.
struct ConvPiece {
    int ky, kx, c0;
    bool kv;
};
__device__ __forceinline__ ConvPiece conv_piece(int kf, int kk, int cin, int k) {
    const int tap = kf / cin, ky = tap / k;
    return ConvPiece{ky, tap - ky * k, kf - tap * cin, kf < kk};
}

// One 64-pixel block of a wgmma accumulator (m64nBN) into the output: warp wq of the warpgroup
// owns rows 16·wq + lane / 4 and + 8 from `p_block`, in each 8-column block j columns 2·(lane % 4)
// and the one after; out[p, n] = conv + bias, or with `add` out += conv + bias (a resnet's
// residual add, summed in that order).
template <typename TO, int BN>
__device__ __forceinline__ void conv_store(const float (&acc)[BN / 8][4], long p_block, long pixels, int n0, int cout,
                                           const float* __restrict__ bias, TO* __restrict__ out, long os, int add) {
    const int lane = threadIdx.x & 31, wq = (threadIdx.x >> 5) & 3;
    const bool pairs = ((os | cout) & 1) == 0 && ((unsigned long long)out & (2 * sizeof(TO) - 1)) == 0;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const long p = p_block + wq * 16 + (lane >> 2) + 8 * half;
        if (p >= pixels) continue;
        TO* row = out + p * os;
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
            const int n = n0 + j * 8 + 2 * (lane & 3);
            if (n >= cout) continue;
            const float v0 = (add ? to_f(row[n]) : 0.f) + (acc[j][2 * half] + (bias ? bias[n] : 0.f));
            if (n + 1 < cout) {
                const float v1 = (add ? to_f(row[n + 1]) : 0.f) + (acc[j][2 * half + 1] + (bias ? bias[n + 1] : 0.f));
                if (pairs) {
                    store2(row + n, v0, v1);
                    continue;
                }
                row[n + 1] = from_f<TO>(v1);
            }
            row[n] = from_f<TO>(v0);
        }
    }
}

// Per tile width: stages, the wgmma groups a warpgroup keeps in flight while the next step loads
// (KEEP), and the CTAs a multiprocessor holds. Measured on an H100 (run g10, `bench conv`): 128-
// channel tiles run best three stages deep with two CTAs a multiprocessor, each waiting for every
// step's products (255–260 TFLOP/s at 1024²; five stages, one CTA and KEEP 1 gave 180–190), and
// 256-channel tiles four stages deep with KEEP 1 (285–300; their 193 KB allow one CTA). 144-
// channel tiles take the 128-channel configuration (two CTAs of 103 KB fit a multiprocessor).
// `conv_wgmma_smem` in cuda/image.rs mirrors SMEM (1 KB of slack aligns the stages to the
// swizzle's period).
template <int BN> struct CwCfg {
    static constexpr bool NARROW = BN == 128 || BN == 144;  // the three-stage, two-CTA configuration
    static constexpr int STAGES = NARROW ? 3 : 4, KEEP = NARROW ? 0 : 1, MIN_CTAS = BN == 256 ? 1 : 2;
    static constexpr unsigned A_BYTES = CW_BM * 128, B_BYTES = BN * 128, STAGE = A_BYTES + B_BYTES;
    static constexpr unsigned SMEM = STAGES * STAGE + 1024;
};

template <typename TO, int BN>
__device__ __forceinline__ void conv_wgmma_impl(const bf16* __restrict__ x, long xs, int h, int w, int cin, int k,
                                                int up, int down, int act, const bf16* __restrict__ wt, int cout,
                                                const float* __restrict__ bias, long pixels, TO* __restrict__ out,
                                                long os, int add) {
    typedef CwCfg<BN> C;
    constexpr int BROWS = (BN + 31) / 32;  // weight rows each thread copies per step (the last may be short)
    extern __shared__ unsigned char cw_smem[];
    const u32 base = (smem_addr(cw_smem) + 1023u) & ~1023u;
    const int tid = threadIdx.x, wg = tid >> 7;
    const int ntiles = (cout + BN - 1) / BN;
    const long p0 = (long)(blockIdx.x / ntiles) * CW_BM;
    const int n0 = (int)(blockIdx.x % ntiles) * BN;
    const int vh = h * up, vw = w * up, ow = vw / down, pad = down == 2 ? 0 : k / 2, ush = up == 2;
    const int kk = k * k * cin;  // the reduction's length (an `int`: the host checks)
    const int steps = (kk + 63) / 64;

    // Each thread copies 16-byte chunk lc of rows lr + 32·i (pixels; weight rows).
    const int lr = tid >> 3, lc = tid & 7;
    int yx[4];
#pragma unroll
    for (int i = 0; i < 4; i++) yx[i] = pixel_corner(p0 + lr + 32 * i, pixels, ow, down, pad);
    // Row r's chunk lc sits at chunk lc ^ (r % 8); r % 8 = lr % 8 for every i.
    const u32 at = (u32)lr * 128 + (u32)((lc ^ (lr & 7)) << 4);

    auto load = [&](int slot, int step) {
        // This thread's piece of the reduction: 8 channels of one tap.
        const int kf = step * 64 + lc * 8;
        const ConvPiece pc = conv_piece(kf, kk, cin, k);
        const u32 sa = base + slot * C::STAGE + at, sb = sa + C::A_BYTES;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            bool ok;
            const bf16* src = gather_src(x, xs, w, vh, vw, ush, yx[i], pc.ky, pc.kx, pc.c0, pc.kv, ok);
            cp_async16(sa + i * 32 * 128, src, ok);
        }
#pragma unroll
        for (int i = 0; i < BROWS; i++) {
            if (lr + 32 * i >= BN) break;  // a 144-channel tile's fifth row group: half the threads
            const int n = n0 + lr + 32 * i;
            const bool ok = pc.kv && n < cout;
            const bf16* src = ok ? wt + (long)n * kk + kf : wt;
            cp_async16(sb + i * 32 * 128, src, ok);
        }
        cp_commit();
    };

    float acc[BN / 8][4];
#pragma unroll
    for (int j = 0; j < BN / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[j][e] = 0.f;

    constexpr int AHEAD = C::STAGES - 1 - C::KEEP;  // steps loading while one multiplies
#pragma unroll
    for (int i = 0; i < AHEAD; i++) {
        if (i < steps) load(i, i);
        else cp_commit();  // empty groups keep the count
    }
    for (int step = 0; step < steps; step++) {
        const int slot = step % C::STAGES;
        cp_wait<AHEAD - 1>();  // this step's copies have landed (the next ones may be in flight)
        if (act >= 0) {
#pragma unroll 1
            for (int i = 0; i < 4; i++) {  // a chunk at a time: unrolled, the activations spill
                uint4* chunk = reinterpret_cast<uint4*>(cw_smem + (base - smem_addr(cw_smem)) + slot * C::STAGE + at +
                                                        i * 32 * 128);
                uint4 v = *chunk;  // one 16-byte load and store
                image_act8(act, v);
                *chunk = v;
            }
        }
        fence_async_smem();  // this thread's copies (and rewrites) → the tensor cores' view
        __syncthreads();
        const u32 sa = base + slot * C::STAGE + wg * 64 * 128, sb = base + slot * C::STAGE + C::A_BYTES;
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ks++) wgmma_ss(acc, sw128_desc(sa + ks * 32, 16), sw128_desc(sb + ks * 32, 16), 1);
        wg_commit();
        // The stage this load fills was read by step − 1 − KEEP, done in every warpgroup before the
        // barrier; the copies go out while this step's products run.
        if (step + AHEAD < steps) load((step + AHEAD) % C::STAGES, step + AHEAD);
        else cp_commit();
        wg_wait<C::KEEP>();  // step − KEEP's products are done
    }
    wg_wait<0>();
    wg_keep(acc);
    cp_wait_all();

    conv_store<TO, BN>(acc, p0 + wg * 64, pixels, n0, cout, bias, out, os, add);
}

#define CONV_WGMMA(TO, BN, NAME)                                                                                \
    extern "C" __global__ void __launch_bounds__(CW_THREADS, CwCfg<BN>::MIN_CTAS)                               \
        NAME(const bf16* x, long xs, int h, int w, int cin, int k, int up, int down, int act, const bf16* wt, \
             int cout, const float* bias, long pixels, TO* out, long os, int add) {                             \
        pdl_enter();                                                                                            \
        conv_wgmma_impl<TO, BN>(x, xs, h, w, cin, k, up, down, act, wt, cout, bias, pixels, out, os, add);     \
    }
CONV_WGMMA(float, 144, conv_wgmma144_f32)
CONV_WGMMA(bf16, 144, conv_wgmma144_bf16)
CONV_WGMMA(float, 256, conv_wgmma256_f32)
CONV_WGMMA(bf16, 256, conv_wgmma256_bf16)
CONV_WGMMA(float, 128, conv_wgmma_f32)
CONV_WGMMA(bf16, 128, conv_wgmma_bf16)
CONV_WGMMA(float, 64, conv_wgmma64_f32)
CONV_WGMMA(bf16, 64, conv_wgmma64_bf16)

// ---- conv_ws{BN}_{out}: warp-specialized, the weight tiles by the tensor-memory accelerator ----
//
// The same convolution, for inputs without an activation (the host sends activated ones to
// conv_wgmma), as a CTA of three warpgroups over WsConvCfg::BM output pixels × BN channels:
//   warpgroup 0, the producer: for each step of 64 along the reduction it waits for a free stage,
//     one thread hands the weight tile (BN rows × 64 columns of the weight as a [cout, kk] matrix,
//     zeros past either end) to the tensor-memory accelerator, and every thread gathers its pieces
//     of the pixel tile with cp.async as conv_wgmma does (same zero-fill, same 128-byte swizzle),
//     its copies arriving on the stage's mbarrier as they land — it never waits for a load;
//   warpgroups 1 and 2, the consumers: MT blocks of 64 pixels each × BN, issuing a step's products
//     as soon as its stage is full, keeping one step in flight, and freeing a stage once its
//     products are done.
// conv_wgmma's CTA instead loads and multiplies in lockstep (a barrier per step, the loads' address
// arithmetic on the warps that issue the products, both tiles through L2 for every 128 pixels),
// which left it at 250–300 TFLOP/s (runs g10, g14). Two shapes (mirrored by `WsShape` in
// cuda/image.rs): 256-channel tiles take 128 pixels (their accumulators fill a consumer's
// registers); 144- and 128-channel tiles take 256 pixels (a consumer's two 64-row blocks share each
// weight read: 94 products per byte loaded against 69 at 128 pixels), gathered by two producer
// warpgroups, since one could not keep two consumers of 256 pixels fed. Run g17 (H100, bench conv):
// 256-channel tiles 460–550 TFLOP/s; 144-channel tiles 440–490 with 576 or more input channels,
// level with conv_wgmma below that; one producer warpgroup had run them at 250–390 and 128-pixel
// CTAs (one 64-row block a consumer) at 240–390.
template <int BN, int MT_, int PWG_> struct WsConvCfg {
    static constexpr int MT = MT_;    // 64-pixel blocks per consumer
    static constexpr int PWG = PWG_;  // producer warpgroups
    static constexpr int BM = 128 * MT, THREADS = 128 * (PWG + 2);
    static constexpr unsigned A_BYTES = BM * 128, B_BYTES = BN * 128, STAGE = A_BYTES + B_BYTES;
    // As many stages as the 227 KB a CTA may take hold (at most 8), with their full and free
    // mbarriers and 1 KB of slack that aligns the stages to the swizzle's period.
    static constexpr int STAGES = (232448 - 1024 - 128) / STAGE > 8 ? 8 : (232448 - 1024 - 128) / STAGE;
    static constexpr unsigned SMEM = STAGES * STAGE + 16 * STAGES + 1024;
    // Registers after setmaxnreg: the producers give theirs to the consumers (64K a multiprocessor).
    static constexpr int P_REGS = PWG == 1 ? 56 : 40, C_REGS = PWG == 1 ? 224 : 216;
};

template <typename TO, int BN, int MT_, int PWG_>
__device__ __forceinline__ void conv_ws_impl(const bf16* __restrict__ x, long xs, int h, int w, int cin, int k,
                                             int up, int down, int cout, const float* __restrict__ bias, long pixels,
                                             TO* __restrict__ out, long os, int add, const TmaDesc* wmap) {
    typedef WsConvCfg<BN, MT_, PWG_> C;
    constexpr int MT = C::MT, S = C::STAGES, PWG = C::PWG, PT = 128 * PWG;
    constexpr int ROWS = C::BM / (16 * PWG);  // pixel rows a producer thread gathers
    extern __shared__ unsigned char cw_smem[];
    const u32 base = (smem_addr(cw_smem) + 1023u) & ~1023u;
    const u32 full = base + S * C::STAGE, empty = full + 8 * S;
    const int tid = threadIdx.x;
    const int ntiles = (cout + BN - 1) / BN;
    const long p0 = (long)(blockIdx.x / ntiles) * C::BM;
    const int n0 = (int)(blockIdx.x % ntiles) * BN;
    const int kk = k * k * cin, steps = (kk + 63) / 64;

    if (tid == 0) {
        for (int i = 0; i < S; i++) {
            mbar_init(full + 8 * i, PT + 1);  // every producer thread's copies and the weight's bytes
            mbar_init(empty + 8 * i, 256);     // every consumer thread
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (tid < PT) {
        set_max_regs_dec<C::P_REGS>();
        const int vh = h * up, vw = w * up, ow = vw / down, pad = down == 2 ? 0 : k / 2, ush = up == 2;
        // Thread (lr, lc) copies 16-byte chunk lc of pixel rows lr + PT/8·i: eight threads read
        // one pixel's 128 bytes, as in conv_wgmma.
        const int lr = tid >> 3, lc = tid & 7;
        int yx[ROWS];
#pragma unroll
        for (int i = 0; i < ROWS; i++) yx[i] = pixel_corner(p0 + lr + PT / 8 * i, pixels, ow, down, pad);
        const u32 at = (u32)lr * 128 + (u32)((lc ^ (lr & 7)) << 4);
        for (int step = 0; step < steps; step++) {
            const int slot = step % S;
            mbar_wait(empty + 8 * slot, ((step / S) & 1) ^ 1);
            const u32 sa = base + slot * C::STAGE;
            if (tid == 0) {
                mbar_expect_tx(full + 8 * slot, C::B_BYTES);
                tma_load_2d(sa + C::A_BYTES, wmap, step * 64, n0, full + 8 * slot);
            }
            const ConvPiece pc = conv_piece(step * 64 + lc * 8, kk, cin, k);
#pragma unroll
            for (int i = 0; i < ROWS; i++) {
                bool ok;
                const bf16* src = gather_src(x, xs, w, vh, vw, ush, yx[i], pc.ky, pc.kx, pc.c0, pc.kv, ok);
                cp_async16(sa + at + i * (PT / 8) * 128, src, ok);
            }
            cp_arrive_on(full + 8 * slot);
        }
        cp_wait_all();
        return;
    }

    set_max_regs_inc<C::C_REGS>();
    const int c = (tid >> 7) - PWG;
    float acc[MT][BN / 8][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int j = 0; j < BN / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[m][j][e] = 0.f;
    for (int step = 0; step < steps; step++) {
        const int slot = step % S;
        mbar_wait(full + 8 * slot, (step / S) & 1);
        // The pixels came through cp.async, each thread's copies landed before its arrival; the
        // tensor cores read through the async proxy, which the barrier's completion orders.
        const u32 sa = base + slot * C::STAGE + c * MT * 64 * 128, sb = base + slot * C::STAGE + C::A_BYTES;
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ks++)
#pragma unroll
            for (int m = 0; m < MT; m++)
                wgmma_ss(acc[m], sw128_desc(sa + m * 64 * 128 + ks * 32, 16), sw128_desc(sb + ks * 32, 16), 1);
        wg_commit();
        wg_wait<1>();  // the previous step's products are done: its stage is free
        if (step > 0) mbar_arrive(empty + 8 * ((step - 1) % S));
    }
    wg_wait<0>();
#pragma unroll
    for (int m = 0; m < MT; m++) wg_keep(acc[m]);

#pragma unroll
    for (int m = 0; m < MT; m++) conv_store<TO, BN>(acc[m], p0 + (c * MT + m) * 64, pixels, n0, cout, bias, out, os, add);
}

// conv_wgmma's arguments (`act` must be −1 and `wt` is read through `wmap` instead), then the
// weight's tensor map (tma::matrix_bf16: boxes of 64 columns × BN rows).
#define CONV_WS(TO, BN, MT, PWG, NAME)                                                                             \
    extern "C" __global__ void __launch_bounds__(WsConvCfg<BN, MT, PWG>::THREADS, 1)                              \
        NAME(const bf16* x, long xs, int h, int w, int cin, int k, int up, int down, int act, const bf16* wt,    \
             int cout, const float* bias, long pixels, TO* out, long os, int add,                                 \
             const __grid_constant__ TmaDesc wmap) {                                                               \
        pdl_enter();                                                                                               \
        conv_ws_impl<TO, BN, MT, PWG>(x, xs, h, w, cin, k, up, down, cout, bias, pixels, out, os, add, &wmap);    \
    }
// 256-channel tiles: 128 pixels and one producer warpgroup. 128 and 144: 256 pixels and two.
CONV_WS(float, 256, 1, 1, conv_ws256_f32)
CONV_WS(bf16, 256, 1, 1, conv_ws256_bf16)
CONV_WS(float, 144, 2, 2, conv_ws144_f32)
CONV_WS(bf16, 144, 2, 2, conv_ws144_bf16)
CONV_WS(float, 128, 2, 2, conv_ws128_f32)
CONV_WS(bf16, 128, 2, 2, conv_ws128_bf16)
