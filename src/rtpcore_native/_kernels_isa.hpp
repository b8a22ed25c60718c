// The float32-activation decode kernels of rtpcore_native._kernels, written once for every
// instruction set. _kernels.cpp includes this file three times, each time inside its own
// namespace and under its own `#pragma GCC target`, with RTPCORE_VBYTES set to the vector
// width in bytes (64: AVX-512, 32: AVX2 + FMA, 16: the x86-64 baseline) and RTPCORE_MT to
// the most activation rows one tile holds (the register file bounds it: 16 vector registers
// before AVX-512, 32 with it). GCC's vector extensions lower to that target's instructions.
//
// Every function here runs single-threaded over the range it is given; _kernels.cpp splits
// the work over its thread pool. Shapes: M activation rows, K inputs, N outputs; W is (N, K),
// float32, bfloat16, IEEE half, or int8 with one float32 scale per output row.

typedef float V __attribute__((vector_size(RTPCORE_VBYTES)));
typedef int32_t I __attribute__((vector_size(RTPCORE_VBYTES)));
constexpr int kLanes = RTPCORE_VBYTES / 4;
// The dot-product tile: kMT activation rows x kNT weight rows, kMT * kNT accumulators + kNT weight
// vectors + one activation vector, so that the register file holds them (16 vector registers
// before AVX-512: 4 x 3, 32 with it: 4 x 4). AMD EPYC (AVX2), one thread, GFLOP/s over 512-wide
// weights streamed from memory at 16 / 32 rows: 2 x 4 (the tile before) 35.7 / 40.1, 4 x 3 48.8
// / 57.4, 3 x 4 40.2 / 54.3, 6 x 2 30.4 / 43.8.
constexpr int kNT = RTPCORE_VBYTES == 64 ? 4 : 3;
constexpr int kMT = 4;

static inline V load(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
// int8 lanes widened to float32: one sign-extending load and one conversion (GCC lowers a
// generic char-to-float vector conversion element by element, so the x86 sets say it).
static inline V load(const int8_t* p) {
#if RTPCORE_VBYTES == 64
    return (V)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif RTPCORE_VBYTES == 32
    return (V)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
    V v;
    for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
    return v;
#endif
}
// bfloat16 lanes (the high half of a float32) widened to float32: zero-extend and shift.
static inline V load(const uint16_t* p) {
#if RTPCORE_VBYTES == 64
    return (V)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#elif RTPCORE_VBYTES == 32
    return (V)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#else
    V v;
    for (int i = 0; i < kLanes; ++i) {
        uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
        std::memcpy(&v[i], &bits, sizeof bits);
    }
    return v;
#endif
}
// IEEE half lanes widened to float32 (F16C / AVX-512F; the baseline converts one by one).
static inline V load(const gguf::f16_t* p) {
#if RTPCORE_VBYTES == 64
    return (V)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif RTPCORE_VBYTES == 32
    return (V)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    V v;
    for (int i = 0; i < kLanes; ++i) v[i] = gguf::f16_to_f32(p[i].bits);
    return v;
#endif
}
static inline float to_f32(float x) { return x; }
static inline float to_f32(gguf::f16_t x) { return gguf::f16_to_f32(x.bits); }
static inline float to_f32(int8_t x) { return static_cast<float>(x); }
static inline float to_f32(uint16_t x) {
    uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}
static inline void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }
// s in every lane (one broadcast: `V{} + s` compiled to an add before it)
static inline V splat(float s) {
#if RTPCORE_VBYTES == 64
    return (V)_mm512_set1_ps(s);
#elif RTPCORE_VBYTES == 32
    return (V)_mm256_set1_ps(s);
#else
    return (V)_mm_set1_ps(s);
#endif
}

// The sum of a vector's lanes, by halving (a lane-by-lane loop costs as much as the products
// of a short row).
static inline float hsum(V v) {
#if RTPCORE_VBYTES == 64
    return _mm512_reduce_add_ps((__m512)v);
#elif RTPCORE_VBYTES == 32
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
#else
    float s = 0.0f;
    for (int i = 0; i < kLanes; ++i) s += v[i];
    return s;
#endif
}

// The largest of a vector's lanes.
static inline float hmax(V v) {
#if RTPCORE_VBYTES == 64
    return _mm512_reduce_max_ps((__m512)v);
#elif RTPCORE_VBYTES == 32
    __m128 s = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
#else
    float m = v[0];
    for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
    return m;
#endif
}

// e^x = 2^n e^r for float32 lanes, n the nearest integer to x / ln2 (passed as `n` with the +-0.5
// already added: truncation rounds it), r = x - n ln2, |r| <= ln2 / 2: a degree-6 polynomial for
// e^r, n added to the exponent. No clamping: the callers know their ranges.
static inline V exp_reduced(V x, V n) {
    I ni = __builtin_convertvector(n, I);
    V nf = __builtin_convertvector(ni, V);
    V r = x - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    V p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    I bits = (ni + 127) << 23;
    V scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// exp(x) for float32 lanes. Relative error under 2e-7 on [-87, 88]; below -87 it returns 0,
// above 88 +inf (as expf does).
static inline V vexp(V x) {
    const V hi = splat(88.3762626647949f), lo = splat(-87.3365478515625f);
    x = x > hi ? hi + 1.0f : x;
    V n = x * 1.44269504088896341f;
    n = n + (n >= 0 ? splat(0.5f) : splat(-0.5f));
    V out = exp_reduced(x, n);
    out = x > hi ? splat(__builtin_inff()) : out;
    out = x < lo ? splat(0.0f) : out;
    return out;
}

// exp(x) for lanes x <= 0 (or -inf, which gives 0): vexp without its upper clamp and sign test,
// for an online softmax's exp(s - max), whose argument is never positive. Prompt attention
// (attend_span) in the setup of benchmarks/bench_prompt_attention.py (one thread, AMD EPYC Zen 4,
// AVX-512, 256 new tokens after 768 / 1792 cached): 7.4 / 16.3 -> 6.7 / 14.7 ms, with the
// rescale skipped where a query's max did not grow.
static inline V vexp_nonpos(V x) {
    const V out = exp_reduced(x, x * 1.44269504088896341f - 0.5f);
    return x < splat(-87.3365478515625f) ? splat(0.0f) : out;
}

static inline float sexp(float x) {
    V v = splat(x);
    return vexp(v)[0];
}

// out[i][j] = dot(x row i, w row j) for MT x NT rows, K inputs. `next`: the next NT weight
// rows, fetched into the cache alongside (null: none).
template <int MT, int NT, typename W>
static inline __attribute__((always_inline)) void dot_tile(
    const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float (&out)[MT][NT], const W* next = nullptr) {
    V acc[MT][NT];
    for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NT; ++j) acc[i][j] = V{};
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) {
        if (next)
            for (int j = 0; j < NT; ++j) __builtin_prefetch(next + j * ldw + k);
        V wv[NT];
        for (int j = 0; j < NT; ++j) wv[j] = load(w + j * ldw + k);
        for (int i = 0; i < MT; ++i) {
            V xv = load(x + i * ldx + k);
            for (int j = 0; j < NT; ++j) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NT; ++j) {
            float s = hsum(acc[i][j]);
            for (int64_t t = k; t < K; ++t) s += x[i * ldx + t] * to_f32(w[j * ldw + t]);
            out[i][j] = s;
        }
}

template <int MT, int NT, typename W>
static inline __attribute__((always_inline)) void tile_rows(
    const float* x, int64_t K, const W* w, const float* scale, const float* bias, float* y, int64_t N,
    bool accumulate, int64_t n, int64_t m, const W* next = nullptr) {
    float out[MT][NT];
    dot_tile<MT, NT>(x + m * K, K, w + n * K, K, K, out, next);
    for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NT; ++j) {
            float v = out[i][j];
            if (scale) v *= scale[n + j];
            if (bias) v += bias[n + j];
            float* dst = y + (m + i) * N + n + j;
            *dst = accumulate ? *dst + v : v;
        }
}

// dot(x, w) over K, four accumulators.
template <typename W>
static inline float dot_row(const float* x, const W* w, int64_t K) {
    V a0 = V{}, a1 = V{}, a2 = V{}, a3 = V{};
    int64_t k = 0;
    for (; k + 4 * kLanes <= K; k += 4 * kLanes) {
        a0 += load(x + k) * load(w + k);
        a1 += load(x + k + kLanes) * load(w + k + kLanes);
        a2 += load(x + k + 2 * kLanes) * load(w + k + 2 * kLanes);
        a3 += load(x + k + 3 * kLanes) * load(w + k + 3 * kLanes);
    }
    for (; k + kLanes <= K; k += kLanes) a0 += load(x + k) * load(w + k);
    float s = hsum((a0 + a1) + (a2 + a3));
    for (; k < K; ++k) s += x[k] * to_f32(w[k]);
    return s;
}

// ---- a GEMM for many activation rows
//
// The weight rows of [n0, n1) in panels of kGemmNR, each packed once per call as float32,
// k-major (pk[k * kGemmNR + j] = w[n + j][k], zeros past n1), then multiplied by kGemmMR
// activation rows at a time as outer products: per k, the panel's kGemmNR values (two vectors)
// against each row's x[k] broadcast, 2 x kGemmMR accumulators that stay in registers over the
// whole of K (in blocks of kGemmKC inputs). A tile of the dot-product kernel below loads every
// activation row again per kNT weight rows and sums horizontally at the end; here each
// activation value loaded feeds kGemmNR products.
constexpr int kGemmNR = 2 * kLanes;
constexpr int kGemmMR = RTPCORE_VBYTES == 64 ? 12 : 6;  // 24 / 12 accumulators of 32 / 16 registers

constexpr int64_t kGemmKC = 256;  // inputs per block: a block of the panel, 16 / 32 KiB, stays in L1
// From this many activation rows on, products over float32 / bf16 / half / int8 weights take the
// GEMM: packing costs one pass over the weight range per call, which fewer rows do not repay.
// AMD EPYC (AVX2), 2 threads, GFLOP/s tiles / GEMM / torch's float32 GEMM over SmolLM2's and
// Llama-1024x16's shapes, with the 2 x 4 tile and the panel packed element by element: 32 rows
// 65-73 / 41-70 / 56-78, 48 rows 71-78 / 53-93 / 62-94, 64 rows 73-78 / 67-102 / 68-90, 128 rows
// 77-86 / 86-127 / 87-114, 256 rows 70-88 / 95-125 / 88-115. With the 4 x 3 tile and the packing
// in 8 x 8 transposes (AVX2 and AVX-512), the float32 products of a decode step of a 56M Llama (8
// layers of 512 x 1376, a 32000-row head; benchmarks/bench_linear.py), five runs alternated, best
// ms tiles / GEMM: 24 rows 20.6 / 21.8, 32 rows 27.3 / 24.8-27.4, 40 rows 35.0 / 28.3, 48 rows
// 35.0 / 29.9.
constexpr int64_t kGemmRows = RTPCORE_VBYTES == 32 ? 40 : 64;

// out (MR, kGemmNR) (+)= x (MR rows of ldx, kc inputs) @ pk (kc, kGemmNR)
template <int MR>
static inline __attribute__((always_inline)) void gemm_tile(const float* x, int64_t ldx, int64_t kc, const float* pk,
                                                            float* out, bool add) {
    V a0[MR], a1[MR];
    for (int i = 0; i < MR; ++i) {
        a0[i] = add ? load(out + i * kGemmNR) : V{};
        a1[i] = add ? load(out + i * kGemmNR + kLanes) : V{};
    }
    for (int64_t k = 0; k < kc; ++k) {
        const V b0 = load(pk + k * kGemmNR), b1 = load(pk + k * kGemmNR + kLanes);
        for (int i = 0; i < MR; ++i) {
            const V a = splat(x[i * ldx + k]);
            a0[i] += a * b0;
            a1[i] += a * b1;
        }
    }
    for (int i = 0; i < MR; ++i) {
        store(out + i * kGemmNR, a0[i]);
        store(out + i * kGemmNR + kLanes, a1[i]);
    }
}

template <int MR>
static void gemm_rows_tile(const float* x, int64_t K, const float* pk, float* out) {
    for (int64_t k0 = 0; k0 < K; k0 += kGemmKC) {
        const int64_t kc = K - k0 < kGemmKC ? K - k0 : kGemmKC;
        gemm_tile<MR>(x + k0, K, kc, pk + k0 * kGemmNR, out, k0 > 0);
    }
}

#if RTPCORE_VBYTES >= 32
// 8 inputs of a weight row widened to float32
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
static inline __m256 load8(const gguf::f16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline __m256 load8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// pk[c * ld + j] = rows[j][k + c] for 8 weight rows j and 8 inputs c: an 8 x 8 transpose in
// registers (the element-by-element packing cost as much as the products below 64 rows).
template <typename W>
static inline void pack8x8(const W* const* rows, int64_t k, float* pk, int64_t ld) {
    const __m256 r0 = load8(rows[0] + k), r1 = load8(rows[1] + k), r2 = load8(rows[2] + k), r3 = load8(rows[3] + k);
    const __m256 r4 = load8(rows[4] + k), r5 = load8(rows[5] + k), r6 = load8(rows[6] + k), r7 = load8(rows[7] + k);
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(pk + 0 * ld, _mm256_permute2f128_ps(s0, s4, 0x20));
    _mm256_storeu_ps(pk + 1 * ld, _mm256_permute2f128_ps(s1, s5, 0x20));
    _mm256_storeu_ps(pk + 2 * ld, _mm256_permute2f128_ps(s2, s6, 0x20));
    _mm256_storeu_ps(pk + 3 * ld, _mm256_permute2f128_ps(s3, s7, 0x20));
    _mm256_storeu_ps(pk + 4 * ld, _mm256_permute2f128_ps(s0, s4, 0x31));
    _mm256_storeu_ps(pk + 5 * ld, _mm256_permute2f128_ps(s1, s5, 0x31));
    _mm256_storeu_ps(pk + 6 * ld, _mm256_permute2f128_ps(s2, s6, 0x31));
    _mm256_storeu_ps(pk + 7 * ld, _mm256_permute2f128_ps(s3, s7, 0x31));
}
#endif

template <typename W>
static void gemm_range(const float* x, int64_t M, int64_t K, const W* w, const float* scale, const float* bias,
                       float* y, int64_t N, bool accumulate, int64_t n0, int64_t n1) {
    thread_local std::vector<float> packed;
    if (static_cast<int64_t>(packed.size()) < K * kGemmNR) packed.resize(K * kGemmNR);
    float* pk = packed.data();
    float out[kGemmMR * kGemmNR];
    for (int64_t n = n0; n < n1; n += kGemmNR) {
        const int64_t nr = n1 - n < kGemmNR ? n1 - n : kGemmNR;
        const W* rows[kGemmNR];
        for (int64_t j = 0; j < kGemmNR; ++j) rows[j] = w + (n + (j < nr ? j : 0)) * K;
        int64_t k = 0;  // (the panel's columns past nr hold copies of row n: never stored)
#if RTPCORE_VBYTES >= 32
        for (; k + 8 <= K; k += 8)
            for (int j = 0; j < kGemmNR; j += 8) pack8x8(rows + j, k, pk + k * kGemmNR + j, kGemmNR);
#endif
        for (; k < K; ++k)
            for (int64_t j = 0; j < kGemmNR; ++j) pk[k * kGemmNR + j] = to_f32(rows[j][k]);
        for (int64_t m = 0; m < M; m += kGemmMR) {
            const int64_t mr = M - m < kGemmMR ? M - m : kGemmMR;
            const float* xm = x + m * K;
            switch (mr) {
                case kGemmMR: gemm_rows_tile<kGemmMR>(xm, K, pk, out); break;
#if RTPCORE_VBYTES == 64
                case 11: gemm_rows_tile<11>(xm, K, pk, out); break;
                case 10: gemm_rows_tile<10>(xm, K, pk, out); break;
                case 9: gemm_rows_tile<9>(xm, K, pk, out); break;
                case 8: gemm_rows_tile<8>(xm, K, pk, out); break;
                case 7: gemm_rows_tile<7>(xm, K, pk, out); break;
                case 6: gemm_rows_tile<6>(xm, K, pk, out); break;
#endif
                case 5: gemm_rows_tile<5>(xm, K, pk, out); break;
                case 4: gemm_rows_tile<4>(xm, K, pk, out); break;
                case 3: gemm_rows_tile<3>(xm, K, pk, out); break;
                case 2: gemm_rows_tile<2>(xm, K, pk, out); break;
                default: gemm_rows_tile<1>(xm, K, pk, out); break;
            }
            for (int64_t i = 0; i < mr; ++i)
                for (int64_t j = 0; j < nr; ++j) {
                    float v = out[i * kGemmNR + j];
                    if (scale) v *= scale[n + j];
                    if (bias) v += bias[n + j];
                    float* dst = y + (m + i) * N + n + j;
                    *dst = accumulate ? *dst + v : v;
                }
        }
    }
}

// Weight rows [n, n + NT) against every activation row, kMT rows at a time; `next` (the next
// tile's weight rows, or null) is fetched alongside the first.
template <int NT, typename W>
static inline void tile_columns(const float* x, int64_t M, int64_t K, const W* w, const float* scale,
                                const float* bias, float* y, int64_t N, bool accumulate, int64_t n,
                                const W* next = nullptr) {
    int64_t m = 0;
    for (; m + kMT <= M; m += kMT)
        tile_rows<kMT, NT>(x, K, w, scale, bias, y, N, accumulate, n, m, m == 0 ? next : nullptr);
    for (; m + 2 <= M; m += 2) tile_rows<2, NT>(x, K, w, scale, bias, y, N, accumulate, n, m, m == 0 ? next : nullptr);
    for (; m < M; ++m) tile_rows<1, NT>(x, K, w, scale, bias, y, N, accumulate, n, m);
}

// Weight rows [n0, n1) in tiles of NT (the last of fewer), against every activation row.
template <int NT, typename W>
static void tiles_range(const float* x, int64_t M, int64_t K, const W* w, const float* scale, const float* bias,
                        float* y, int64_t N, bool accumulate, int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + NT <= n1; n += NT) {
        // With more than one tile of rows, the first tile's weight loads no longer stream from
        // memory as fast as they would alone (each waits behind its products): the next tile's
        // weight rows are fetched while it runs. SmolLM2's float32 decode at batch 8, 2 threads,
        // Intel Xeon (AVX-512): 133-139 -> 173-196 tok/s (weights read at 9 -> 12-13 GB/s); two
        // tiles ahead measured no better.
        const W* next = M > 2 && n + 2 * NT <= n1 ? w + (n + NT) * K : nullptr;
        tile_columns<NT>(x, M, K, w, scale, bias, y, N, accumulate, n, next);
    }
    switch (n1 - n) {  // the last weight rows, fewer than a tile
        case 3: if constexpr (NT > 3) tile_columns<3>(x, M, K, w, scale, bias, y, N, accumulate, n); break;
        case 2: if constexpr (NT > 2) tile_columns<2>(x, M, K, w, scale, bias, y, N, accumulate, n); break;
        case 1: tile_columns<1>(x, M, K, w, scale, bias, y, N, accumulate, n); break;
        default: break;
    }
}

// y[:, n0:n1] (+)= x @ w[n0:n1].T * scale + bias; x (M, K), y (M, N).
template <typename W>
static void linear_range(const float* x, int64_t M, int64_t K, const W* w, const float* scale, const float* bias,
                         float* y, int64_t N, bool accumulate, int64_t n0, int64_t n1) {
    // One row of activations: the weight rows one after another, so that each thread reads its
    // range as one sequential stream (a tile of kNT rows reads kNT interleaved ones). Float32 decode, 2 threads, AMD EPYC (AVX2), GB/s
    // over SmolLM2's matrix shapes, four alternating runs each: tiles 18.3-20.2, tiles with the
    // next tile prefetched 19.0-20.6, rows 19.8-22.2; rows with a software prefetch ahead in
    // the stream (1 or 4 KiB) or of the whole next row measured no better.
    if (M == 1) {
        for (int64_t n = n0; n < n1; ++n) {
            float v = dot_row(x, w + n * K, K);
            if (scale) v *= scale[n];
            if (bias) v += bias[n];
            y[n] = accumulate ? y[n] + v : v;
        }
        return;
    }
    if (M >= kGemmRows) {
        gemm_range(x, M, K, w, scale, bias, y, N, accumulate, n0, n1);
        return;
    }
    // Fewer rows than a tile of kMT: two rows x 4 weight rows (the 4 x 3 tile's columns of two rows
    // measured 4% slower at 2 rows, as fast at 3).
    if (M < kMT)
        tiles_range<4>(x, M, K, w, scale, bias, y, N, accumulate, n0, n1);
    else
        tiles_range<kNT>(x, M, K, w, scale, bias, y, N, accumulate, n0, n1);
}

static void linear_f32(const float* x, int64_t M, int64_t K, const float* w, const float* bias, float* y,
                       int64_t N, bool accumulate, int64_t n0, int64_t n1) {
    linear_range(x, M, K, w, nullptr, bias, y, N, accumulate, n0, n1);
}

static void linear_i8(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scale, const float* bias,
                      float* y, int64_t N, bool accumulate, int64_t n0, int64_t n1) {
    linear_range(x, M, K, w, scale, bias, y, N, accumulate, n0, n1);
}

// out = w * x / sqrt(mean(x^2) + eps), one row of E.
static void rms_norm(const float* x, const float* w, float eps, float* out, int64_t E) {
    V acc = V{};
    int64_t k = 0;
    for (; k + kLanes <= E; k += kLanes) {
        V v = load(x + k);
        acc += v * v;
    }
    float ss = hsum(acc);
    for (; k < E; ++k) ss += x[k] * x[k];
    float inv = 1.0f / std::sqrt(ss / static_cast<float>(E) + eps);
    k = 0;
    for (; k + kLanes <= E; k += kLanes) store(out + k, load(w + k) * (load(x + k) * inv));
    for (; k < E; ++k) out[k] = w[k] * (x[k] * inv);
}

// out[i] = silu(gate[i]) * up[i] = gate / (1 + exp(-gate)) * up, I values.
static void silu_mul(const float* gate, const float* up, float* out, int64_t I_) {
    int64_t k = 0;
    for (; k + kLanes <= I_; k += kLanes) {
        V g = load(gate + k);
        store(out + k, g / (1.0f + vexp(-g)) * load(up + k));
    }
    for (; k < I_; ++k) out[k] = gate[k] / (1.0f + sexp(-gate[k])) * up[k];
}

// Rotate-half RoPE of `heads` heads of D values in place, with this position's cos/sin rows.
static void rope(float* x, int64_t heads, int64_t D, const float* cos, const float* sin) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; ++h) {
        float* v = x + h * D;
        for (int64_t i = 0; i < half; ++i) {
            float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

// Attention of the query heads of KV heads [h0, h1) of one sequence (G query heads each) over its
// context positions [start, ctx), read in place from the pools (slot rows of Hkv x D) through its
// block table. q: those heads' queries ((h1 - h0) G, D) -> out (same shape); scores: scratch of
// (h1 - h0) G (ctx - start) floats; rows: scratch of 2 (ctx - start) row pointers.
//
// The keys and values are read a few positions at a time for every KV head of the range, so that
// a position's rows of all those heads (adjacent in the pool) are read together: attending one KV
// head at a time read every position's row of Hkv heads Hkv times, a D-value piece each time, and
// read the pools from memory at 7.2-7.7 GB/s against 12.8 with one KV head (16 rows decoding at
// 800 positions, AMD EPYC (AVX2), 2 threads). Scores: kAttendKeys keys at a time per query head
// (as many independent sums as keys: each key's is one accumulator over D, summed across its
// lanes, then the tail). Output: per kValueKeys positions, each run of 4 vectors of D of a query
// head (two heads of a KV group at a time, sharing each value row loaded) in registers across
// the positions, added to what the positions before left in `out`; every output element sums
// over the positions in order, whichever way it is reached.
constexpr int kAttendKeys = 8;
constexpr int64_t kValueKeys = 16;

template <typename T>
static void attend_heads(const float* q, int64_t G, int64_t D, const T* kc, const T* vc, int64_t h0, int64_t h1,
                         int64_t Hkv, const int64_t* table, int64_t tpb, int64_t start, int64_t ctx, float scale,
                         float* scores, const void** rows, float* out) {
    const int64_t L = ctx - start, NH = (h1 - h0) * G;
    const T** krows = reinterpret_cast<const T**>(rows);  // position t's row of KV head h0
    const T** vrows = krows + L;
    for (int64_t t = 0; t < L; ++t) {
        const int64_t pos = start + t, slot = table[pos / tpb] * tpb + pos % tpb;
        krows[t] = kc + (slot * Hkv + h0) * D;
        vrows[t] = vc + (slot * Hkv + h0) * D;
    }
    const int64_t dv = D - D % kLanes;  // the head dimension in whole vectors
    auto score = [&](int64_t t, int64_t n, int64_t h) {  // positions [t, t + n) for KV head h0 + h
        for (int64_t g = 0; g < G; ++g) {
            const float* qg = q + (h * G + g) * D;
            float* sg = scores + (h * G + g) * L + t;
            if (n == kAttendKeys) {
                const T* kr[kAttendKeys];
                for (int j = 0; j < kAttendKeys; ++j) kr[j] = krows[t + j] + h * D;
                V acc[kAttendKeys];
                for (int j = 0; j < kAttendKeys; ++j) acc[j] = V{};
                for (int64_t k = 0; k < dv; k += kLanes) {
                    const V qv = load(qg + k);
                    for (int j = 0; j < kAttendKeys; ++j) acc[j] += qv * load(kr[j] + k);
                }
                for (int j = 0; j < kAttendKeys; ++j) {
                    float s = hsum(acc[j]);
                    for (int64_t k = dv; k < D; ++k) s += qg[k] * to_f32(kr[j][k]);
                    sg[j] = s * scale;
                }
                continue;
            }
            for (int64_t j = 0; j < n; ++j) {
                const T* kr = krows[t + j] + h * D;
                V acc = V{};
                for (int64_t k = 0; k < dv; k += kLanes) acc += load(qg + k) * load(kr + k);
                float s = hsum(acc);
                for (int64_t k = dv; k < D; ++k) s += qg[k] * to_f32(kr[k]);
                sg[j] = s * scale;
            }
        }
    };
    for (int64_t t = 0; t < L; t += kAttendKeys) {
        const int64_t n = L - t < kAttendKeys ? L - t : kAttendKeys;
        for (int64_t h = 0; h < h1 - h0; ++h) score(t, n, h);
    }
    for (int64_t g = 0; g < NH; ++g) {
        float* sg = scores + g * L;
        float mx = -__builtin_inff();
        for (int64_t i = 0; i < L; ++i) mx = sg[i] > mx ? sg[i] : mx;
        float sum = 0.0f;
        int64_t i = 0;
        for (; i + kLanes <= L; i += kLanes) {
            V e = vexp(load(sg + i) - mx);
            store(sg + i, e);
            sum += hsum(e);
        }
        for (; i < L; ++i) {
            sg[i] = sexp(sg[i] - mx);
            sum += sg[i];
        }
        float inv = 1.0f / sum;
        for (i = 0; i < L; ++i) sg[i] *= inv;
    }
    for (int64_t i = 0; i < NH * D; ++i) out[i] = 0.0f;
    // positions [t0, t1) of KV head h into query head g's outputs from d0 on, one head at a time
    auto runs = [&](int64_t t0, int64_t t1, int64_t h, int64_t g, int64_t d0) {
        const float* pg = scores + (h * G + g) * L;
        float* og = out + (h * G + g) * D;
        const int64_t off = h * D;
        for (; d0 + 4 * kLanes <= D; d0 += 4 * kLanes) {
            V a[4];
            for (int c = 0; c < 4; ++c) a[c] = load(og + d0 + c * kLanes);
            for (int64_t i = t0; i < t1; ++i) {
                const V p = splat(pg[i]);
                for (int c = 0; c < 4; ++c) a[c] += p * load(vrows[i] + off + d0 + c * kLanes);
            }
            for (int c = 0; c < 4; ++c) store(og + d0 + c * kLanes, a[c]);
        }
        for (; d0 + kLanes <= D; d0 += kLanes) {
            V a = load(og + d0);
            for (int64_t i = t0; i < t1; ++i) a += splat(pg[i]) * load(vrows[i] + off + d0);
            store(og + d0, a);
        }
        for (; d0 < D; ++d0) {
            float a = og[d0];
            for (int64_t i = t0; i < t1; ++i) a += pg[i] * to_f32(vrows[i][off + d0]);
            og[d0] = a;
        }
    };
    for (int64_t t0 = 0; t0 < L; t0 += kValueKeys) {
        const int64_t t1 = L - t0 < kValueKeys ? L : t0 + kValueKeys;
        for (int64_t h = 0; h < h1 - h0; ++h) {
            const int64_t off = h * D;
            int64_t g = 0;
            for (; g + 2 <= G; g += 2) {
                const float *p0 = scores + (h * G + g) * L, *p1 = p0 + L;
                float *o0 = out + (h * G + g) * D, *o1 = o0 + D;
                int64_t d0 = 0;
                for (; d0 + 4 * kLanes <= D; d0 += 4 * kLanes) {
                    V a[4], b[4];
                    for (int c = 0; c < 4; ++c) {
                        a[c] = load(o0 + d0 + c * kLanes);
                        b[c] = load(o1 + d0 + c * kLanes);
                    }
                    for (int64_t i = t0; i < t1; ++i) {
                        const V s0 = splat(p0[i]), s1 = splat(p1[i]);
                        for (int c = 0; c < 4; ++c) {
                            const V v = load(vrows[i] + off + d0 + c * kLanes);
                            a[c] += s0 * v;
                            b[c] += s1 * v;
                        }
                    }
                    for (int c = 0; c < 4; ++c) {
                        store(o0 + d0 + c * kLanes, a[c]);
                        store(o1 + d0 + c * kLanes, b[c]);
                    }
                }
                if (d0 < D) {
                    runs(t0, t1, h, g, d0);
                    runs(t0, t1, h, g + 1, d0);
                }
            }
            for (; g < G; ++g) runs(t0, t1, h, g, 0);
        }
    }
}

static void attend_f32(const float* q, int64_t G, int64_t D, const void* kc, const void* vc, int64_t h0, int64_t h1,
                       int64_t Hkv, const int64_t* table, int64_t tpb, int64_t start, int64_t ctx, float scale,
                       float* scores, const void** rows, float* out) {
    attend_heads(q, G, D, static_cast<const float*>(kc), static_cast<const float*>(vc), h0, h1, Hkv, table, tpb, start,
                 ctx, scale, scores, rows, out);
}

static void attend_bf16(const float* q, int64_t G, int64_t D, const void* kc, const void* vc, int64_t h0,
                        int64_t h1, int64_t Hkv, const int64_t* table, int64_t tpb, int64_t start, int64_t ctx,
                        float scale, float* scores, const void** rows, float* out) {
    attend_heads(q, G, D, static_cast<const uint16_t*>(kc), static_cast<const uint16_t*>(vc), h0, h1, Hkv, table, tpb,
                 start, ctx, scale, scores, rows, out);
}

// ---- attention of a span of new tokens (a prompt chunk, a speculative verification)
//
// The queries of up to kSpanRows consecutive rows of one sequence (positions pos0, pos0 + 1, ...)
// for the G query heads of one KV head, against its keys read in place from the pools, in
// blocks of kSpanKeys keys with an online softmax (the running max and sum per query, the
// partial output rescaled when the max grows), causal: a query at position p sees the keys
// [p + 1 - window, p] (window > 0) or [0, p]. Per key block, the scores are a small product of
// the queries (R = rows x G, pre-scaled) with the block's keys transposed, kLanes keys per
// vector (the query values broadcast: no horizontal sums), and the output the product of the
// probabilities with the block's values, the head dimension across the lanes.
constexpr int64_t kSpanRows = 64;
constexpr int64_t kSpanKeys = 32;
constexpr int kSpanNV = static_cast<int>(kSpanKeys / kLanes);  // vectors per row of scores
// queries per register tile: of the scores (kSpanNV accumulators each) and of the outputs (4)
constexpr int kSpanQT = RTPCORE_VBYTES == 64 ? 8 : RTPCORE_VBYTES == 32 ? 2 : 1;
constexpr int kSpanVT = RTPCORE_VBYTES == 64 ? 4 : 2;

// sc (RT, keys) = q (RT, D) @ kt (D, keys)
template <int RT>
static inline void span_scores(const float* q, int64_t D, const float* kt, float* sc) {
    V a[RT][kSpanNV];
    for (int t = 0; t < RT; ++t)
        for (int v = 0; v < kSpanNV; ++v) a[t][v] = V{};
    for (int64_t d = 0; d < D; ++d) {
        V kv[kSpanNV];
        for (int v = 0; v < kSpanNV; ++v) kv[v] = load(kt + d * kSpanKeys + v * kLanes);
        for (int t = 0; t < RT; ++t) {
            const V b = splat(q[t * D + d]);
            for (int v = 0; v < kSpanNV; ++v) a[t][v] += b * kv[v];
        }
    }
    for (int t = 0; t < RT; ++t)
        for (int v = 0; v < kSpanNV; ++v) store(sc + t * kSpanKeys + v * kLanes, a[t][v]);
}

// acc (RT, D) += p (RT, keys; the first nk) @ vb (keys, D)
template <int RT>
static inline void span_values(const float* p, int64_t nk, const float* vb, int64_t D, float* acc) {
    int64_t d0 = 0;
    for (; d0 + 4 * kLanes <= D; d0 += 4 * kLanes) {
        V a[RT][4];
        for (int t = 0; t < RT; ++t)
            for (int c = 0; c < 4; ++c) a[t][c] = load(acc + t * D + d0 + c * kLanes);
        for (int64_t j = 0; j < nk; ++j) {
            V vv[4];
            for (int c = 0; c < 4; ++c) vv[c] = load(vb + j * D + d0 + c * kLanes);
            for (int t = 0; t < RT; ++t) {
                const V b = splat(p[t * kSpanKeys + j]);
                for (int c = 0; c < 4; ++c) a[t][c] += b * vv[c];
            }
        }
        for (int t = 0; t < RT; ++t)
            for (int c = 0; c < 4; ++c) store(acc + t * D + d0 + c * kLanes, a[t][c]);
    }
    for (; d0 + kLanes <= D; d0 += kLanes)
        for (int t = 0; t < RT; ++t) {
            V a = load(acc + t * D + d0);
            for (int64_t j = 0; j < nk; ++j) a += splat(p[t * kSpanKeys + j]) * load(vb + j * D + d0);
            store(acc + t * D + d0, a);
        }
    for (; d0 < D; ++d0)
        for (int t = 0; t < RT; ++t) {
            float a = acc[t * D + d0];
            for (int64_t j = 0; j < nk; ++j) a += p[t * kSpanKeys + j] * vb[j * D + d0];
            acc[t * D + d0] = a;
        }
}

// Scratch floats attend_span needs for G query heads of D.
inline int64_t span_scratch(int64_t G, int64_t D) {
    const int64_t R = kSpanRows * G;
    return 2 * R * D + D * kSpanKeys + R * kSpanKeys + kSpanKeys * D + 2 * R;
}

template <typename T>
static void attend_span(const float* q, int64_t q_ld, int64_t n, int64_t G, int64_t D, const T* kc, const T* vc,
                        int64_t kvh, int64_t Hkv, const int64_t* table, int64_t tpb, int64_t pos0, int64_t window,
                        float scale, float* out, int64_t out_ld, float* scratch) {
    const int64_t R = n * G;
    float* qs = scratch;               // (R, D) the queries, scaled
    float* acc = qs + R * D;           // (R, D) the unnormalised outputs
    float* kt = acc + R * D;           // (D, kSpanKeys) the block's keys, transposed
    float* sc = kt + D * kSpanKeys;    // (R, kSpanKeys) scores, then probabilities
    float* vb = sc + R * kSpanKeys;    // (kSpanKeys, D) the block's values
    float* mx = vb + kSpanKeys * D;    // (R,) running max
    float* sum = mx + R;               // (R,) running sum
    for (int64_t i = 0; i < n; ++i)
        for (int64_t g = 0; g < G; ++g) {
            const float* src = q + i * q_ld + g * D;
            float* dst = qs + (i * G + g) * D;
            int64_t d = 0;
            for (; d + kLanes <= D; d += kLanes) store(dst + d, load(src + d) * scale);
            for (; d < D; ++d) dst[d] = src[d] * scale;
        }
    std::memset(acc, 0, sizeof(float) * R * D);
    for (int64_t r = 0; r < R; ++r) {
        mx[r] = -__builtin_inff();
        sum[r] = 0.0f;
    }
    // Key blocks start at multiples of kSpanKeys whatever the window: a query's sums run over the
    // same blocks in the same order however its prompt was split into chunks.
    const int64_t lo = window > 0 && pos0 + 1 > window ? pos0 + 1 - window : 0, hi = pos0 + n;
    for (int64_t kb = lo - lo % kSpanKeys; kb < hi; kb += kSpanKeys) {
        const int64_t nk = hi - kb < kSpanKeys ? hi - kb : kSpanKeys;
        // A whole block's keys are transposed 8 x 8 in registers below (they were copied element
        // by element: a third of the kernel's own time outside the two products, by perf, with
        // AVX2); the values are copied a row at a time. The setup of
        // benchmarks/bench_prompt_attention.py (one thread, AMD EPYC Zen 4, 256 new tokens after
        // 768 / 1792 cached), three runs alternated with the exp change below in both: AVX-512
        // 6.7-6.8 / 13.9-15.1 -> 6.4 / 13.6-13.8 ms; AVX2 within this host's noise at 768, 25.4
        // -> 23.4-23.7 ms at 1792.
        const bool packed = RTPCORE_VBYTES >= 32 && nk == kSpanKeys && D % 8 == 0;
        [[maybe_unused]] const T* krows[kSpanKeys];  // read by the 8 x 8 transposes only
        for (int64_t j = 0; j < kSpanKeys; ++j) {
            if (j < nk) {
                const int64_t pos = kb + j, slot = table[pos / tpb] * tpb + pos % tpb;
                const T* krow = kc + (slot * Hkv + kvh) * D;
                const T* vrow = vc + (slot * Hkv + kvh) * D;
                krows[j] = krow;
                if (!packed)
                    for (int64_t d = 0; d < D; ++d) kt[d * kSpanKeys + j] = to_f32(krow[d]);
                int64_t d = 0;
                for (; d + kLanes <= D; d += kLanes) store(vb + j * D + d, load(vrow + d));
                for (; d < D; ++d) vb[j * D + d] = to_f32(vrow[d]);
            } else {
                for (int64_t d = 0; d < D; ++d) kt[d * kSpanKeys + j] = vb[j * D + d] = 0.0f;
            }
        }
#if RTPCORE_VBYTES >= 32
        if (packed)
            for (int64_t d = 0; d < D; d += 8)
                for (int64_t j = 0; j < kSpanKeys; j += 8) pack8x8(krows + j, d, kt + d * kSpanKeys + j, kSpanKeys);
#endif
        // every query of the span sees every key of this block: no rule to apply
        const int64_t last = pos0 + n - 1;
        const bool whole = nk == kSpanKeys && kb + nk - 1 <= pos0 && (window <= 0 || kb >= last + 1 - window);
        // the queries before the block's first key see none of it: rows from rb on
        const int64_t rb = (kb > pos0 ? kb - pos0 : 0) * G;
        // scores: sc (R, keys) = qs (R, D) @ kt (D, keys)
        {
            int64_t r0 = rb;
            for (; r0 + kSpanQT <= R; r0 += kSpanQT) span_scores<kSpanQT>(qs + r0 * D, D, kt, sc + r0 * kSpanKeys);
            for (; r0 < R; ++r0) span_scores<1>(qs + r0 * D, D, kt, sc + r0 * kSpanKeys);
        }
        // the causal (and window) rule, then the online softmax per query
        for (int64_t r = rb; r < R; ++r) {
            const int64_t p = pos0 + r / G, first = window > 0 && p + 1 > window ? p + 1 - window : 0;
            float* s = sc + r * kSpanKeys;
            if (!whole)
                for (int64_t j = 0; j < kSpanKeys; ++j)
                    if (j >= nk || kb + j > p || kb + j < first) s[j] = -__builtin_inff();
            V mv = load(s);
            for (int v = 1; v < kSpanNV; ++v) {
                const V x = load(s + v * kLanes);
                mv = x > mv ? x : mv;
            }
            const float m = hmax(mv);
            if (m == -__builtin_inff()) {  // no key of this block is visible to this query
                std::memset(s, 0, sizeof(float) * kSpanKeys);
                continue;
            }
            const float m_new = m > mx[r] ? m : mx[r];
            // 0 for the first visible block; exactly 1 (exp(0)) when the max did not grow
            const float corr = m_new == mx[r] ? 1.0f : sexp(mx[r] - m_new);
            mx[r] = m_new;
            V tot = V{};
            for (int v = 0; v < kSpanNV; ++v) {
                const V e = vexp_nonpos(load(s + v * kLanes) - m_new);  // -inf: 0
                store(s + v * kLanes, e);
                tot += e;
            }
            sum[r] = sum[r] * corr + hsum(tot);
            if (corr != 1.0f) {
                int64_t d = 0;
                for (; d + kLanes <= D; d += kLanes) store(acc + r * D + d, load(acc + r * D + d) * corr);
                for (; d < D; ++d) acc[r * D + d] *= corr;
            }
        }
        // acc (R, D) += sc (R, keys) @ vb (keys, D), D across the lanes
        {
            int64_t r0 = rb;
            for (; r0 + kSpanVT <= R; r0 += kSpanVT) span_values<kSpanVT>(sc + r0 * kSpanKeys, nk, vb, D, acc + r0 * D);
            for (; r0 < R; ++r0) span_values<1>(sc + r0 * kSpanKeys, nk, vb, D, acc + r0 * D);
        }
    }
    for (int64_t i = 0; i < n; ++i)
        for (int64_t g = 0; g < G; ++g) {
            const int64_t r = i * G + g;
            const float inv = 1.0f / sum[r];  // the query's own key is always visible: sum >= 1
            for (int64_t d = 0; d < D; ++d) out[i * out_ld + g * D + d] = acc[r * D + d] * inv;
        }
}

static void attend_span_f32(const float* q, int64_t q_ld, int64_t n, int64_t G, int64_t D, const void* kc,
                            const void* vc, int64_t kvh, int64_t Hkv, const int64_t* table, int64_t tpb, int64_t pos0,
                            int64_t window, float scale, float* out, int64_t out_ld, float* scratch) {
    attend_span(q, q_ld, n, G, D, static_cast<const float*>(kc), static_cast<const float*>(vc), kvh, Hkv, table, tpb,
                pos0, window, scale, out, out_ld, scratch);
}

static void attend_span_bf16(const float* q, int64_t q_ld, int64_t n, int64_t G, int64_t D, const void* kc,
                             const void* vc, int64_t kvh, int64_t Hkv, const int64_t* table, int64_t tpb, int64_t pos0,
                             int64_t window, float scale, float* out, int64_t out_ld, float* scratch) {
    attend_span(q, q_ld, n, G, D, static_cast<const uint16_t*>(kc), static_cast<const uint16_t*>(vc), kvh, Hkv, table,
                tpb, pos0, window, scale, out, out_ld, scratch);
}

static void linear_bf16(const float* x, int64_t M, int64_t K, const uint16_t* w, const float* bias, float* y,
                        int64_t N, bool accumulate, int64_t n0, int64_t n1) {
    linear_range(x, M, K, w, nullptr, bias, y, N, accumulate, n0, n1);
}

static void linear_f16(const float* x, int64_t M, int64_t K, const gguf::f16_t* w, const float* bias, float* y,
                       int64_t N, bool accumulate, int64_t n0, int64_t n1) {
    linear_range(x, M, K, w, nullptr, bias, y, N, accumulate, n0, n1);
}

// ---- bfloat16 weights in the blocked layout (bf16p, _kernels.cpp), widened to float32
//
// A block row holds 16 output rows' pairs of inputs: read as uint32 lanes, each lane's low half
// is input 2p (a shift widens it) and its high half input 2p + 1 (a mask does), so a row
// multiplies two broadcast activations. The activations stay float32: the products are those
// of the row layout's linear_bf16, summed in another order.
constexpr int kBV = bf16p::kRows / kLanes;  // vectors per block row
constexpr int kBNB = kBV == 1 ? 2 : 1;      // blocks per tile

template <int MT, int NB>
static inline __attribute__((always_inline)) void bf16p_tile(const float* x, int64_t K, const uint16_t* w,
                                                             int64_t bstride, V (&acc)[MT][NB * kBV]) {
    for (int i = 0; i < MT; ++i)
        for (int c = 0; c < NB * kBV; ++c) acc[i][c] = V{};
    const I hi = I{} + static_cast<int32_t>(0xffff0000u);
    const int64_t pairs = K / 2;
    for (int64_t p = 0; p < pairs; ++p) {
        V ev[NB * kBV], od[NB * kBV];
        for (int j = 0; j < NB; ++j)
            for (int v = 0; v < kBV; ++v) {
                I u;
                std::memcpy(&u, w + j * bstride + p * 32 + v * kLanes * 2, sizeof u);
                ev[j * kBV + v] = (V)(u << 16);
                od[j * kBV + v] = (V)(u & hi);
            }
        for (int i = 0; i < MT; ++i) {
            const V x0 = splat(x[i * K + 2 * p]), x1 = splat(x[i * K + 2 * p + 1]);
            for (int c = 0; c < NB * kBV; ++c) {
                acc[i][c] += x0 * ev[c];
                acc[i][c] += x1 * od[c];
            }
        }
    }
    if (K & 1) {  // the last input, alone in its pair
        for (int j = 0; j < NB; ++j)
            for (int v = 0; v < kBV; ++v) {
                I u;
                std::memcpy(&u, w + j * bstride + pairs * 32 + v * kLanes * 2, sizeof u);
                const V last = (V)(u << 16);
                for (int i = 0; i < MT; ++i) acc[i][j * kBV + v] += splat(x[i * K + K - 1]) * last;
            }
    }
}

// Row m's outputs [n, n + kLanes) (those below N): + bias, then stored or added (Out).
static inline void bf16p_store(V v, int64_t m, int64_t n, int64_t N, const float* bias, const Out& y) {
    if (!y.h && N - n >= kLanes) {
        if (bias) v += load(bias + n);
        float* dst = y.f + m * y.ld + n;
        store(dst, y.accumulate ? load(dst) + v : v);
        return;
    }
    float lanes[kLanes];
    store(lanes, v);
    const int64_t count = N - n < kLanes ? N - n : kLanes;
    for (int64_t c = 0; c < count; ++c) {
        float s = lanes[c] + (bias ? bias[n + c] : 0.0f);
        if (y.h) {
            y.h[m * y.ld + n + c] = f32_to_bf16(s);
        } else {
            float* dst = y.f + m * y.ld + n + c;
            *dst = y.accumulate ? *dst + s : s;
        }
    }
}

template <int MT, int NB>
static inline __attribute__((always_inline)) void bf16p_rows(const float* x, int64_t K, const uint16_t* w,
                                                             const float* bias, const Out& y, int64_t N,
                                                             int64_t blk, int64_t m) {
    const int64_t bstride = bf16p::padded_depth(K) * bf16p::kRows;
    V acc[MT][NB * kBV];
    bf16p_tile<MT, NB>(x + m * K, K, w + blk * bstride, bstride, acc);
    for (int i = 0; i < MT; ++i)
        for (int c = 0; c < NB * kBV; ++c) bf16p_store(acc[i][c], m + i, blk * bf16p::kRows + c * kLanes, N, bias, y);
}

// y[:, n0:n1] = x @ w[n0:n1].T + bias for bf16p weights w of logical shape (N, K), x (M, K)
// float32; n0 a multiple of 16.
static void linear_bf16p(const float* x, int64_t M, int64_t K, const uint16_t* w, const float* bias, const Out& y,
                         int64_t N, int64_t n0, int64_t n1) {
    const int64_t b1 = (n1 + bf16p::kRows - 1) / bf16p::kRows;
    int64_t b = n0 / bf16p::kRows;
    for (; b + kBNB <= b1; b += kBNB) {
        int64_t m = 0;
        if constexpr (RTPCORE_MT >= 4)
            for (; m + 4 <= M; m += 4) bf16p_rows<4, kBNB>(x, K, w, bias, y, N, b, m);
        for (; m + 2 <= M; m += 2) bf16p_rows<2, kBNB>(x, K, w, bias, y, N, b, m);
        for (; m < M; ++m) bf16p_rows<1, kBNB>(x, K, w, bias, y, N, b, m);
    }
    for (; b < b1; ++b) {
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) bf16p_rows<2, 1>(x, K, w, bias, y, N, b, m);
        for (; m < M; ++m) bf16p_rows<1, 1>(x, K, w, bias, y, N, b, m);
    }
}
