// The quantized GGUF matrix kernels of rtpcore_native._kernels (DESIGN §20), written once for
// every instruction set: _kernels.cpp includes this file five times, each inside its own
// namespace and `#pragma GCC target`, with
//   RTPCORE_Q_SIMD  1: x86 AVX2 intrinsics for the byte products; 0: portable scalar C++
//   RTPCORE_Q_VNNI  2: AVX512-VNNI (EVEX vpdpbusd), 1: AVX-VNNI (VEX vpdpbusd), 0: none
//   RTPCORE_Q_MT    activation rows per tile: 8 with AVX-512 (32 vector registers hold two
//                   accumulators per row and the operands), 4 with AVX2 (16 registers), 2 in
//                   the baseline
// The rest is GCC vector extensions over 32-byte vectors (one 32-element block, or a 32-element
// sub-block of a K type, per vector), which lower to that target's instructions.
//
// y (M, N) (+)= x (M, K) @ dequant(W).T + bias, with x already quantized to 8-bit blocks
// (gguf::QActs: q8_0-style blocks of 32 for q8_0 / q4_0 / q5_0 / q5_1, q8_K-style blocks of 256
// for the K types). Per block, the weights' small unsigned integers u (or signed q8_0 values)
// meet the activations' int8 q in exact integer dot products; their offsets and mins multiply
// the activation block's sum of q; floats enter once per block:
//   q8_0:  d_w d_x sum(q_w q_x)
//   q4_0:  d_w d_x sum(u q_x) - 8 d_w s_x             (s_x = d_x sum q_x)
//   q5_0:  d_w d_x sum(u q_x) - 16 d_w s_x
//   q5_1:  d_w d_x sum(u q_x) + m_w s_x
//   q4_k, q5_k:  d d_x sum_j sc_j sum(u q_x)_j - dmin d_x sum_j m_j sum(q_x)_j  (j: 32-sub-blocks)
//   q6_k:  d d_x (sum_j sc_j sum(u q_x)_j - 32 sum_j sc_j sum(q_x)_j)         (j: 16-sub-blocks)
// so every instruction set computes the same integers and differs only in float summation
// order. Each function runs single-threaded over the weight rows [n0, n1) it is given.

typedef uint8_t U8 __attribute__((vector_size(32)));
typedef int8_t S8 __attribute__((vector_size(32)));
typedef int16_t I16 __attribute__((vector_size(32)));
typedef int32_t I32 __attribute__((vector_size(32)));
typedef float F32 __attribute__((vector_size(32)));
constexpr int kQMT = RTPCORE_Q_MT;
constexpr int64_t kPrefetchRows = 8;  // weight rows read ahead (see tile)

// Every helper is inlined: none passes a 32-byte vector in a call (whose ABI without AVX
// differs, and GCC would say so).
#define RTPCORE_QINLINE static inline __attribute__((always_inline))

RTPCORE_QINLINE U8 ld32(const void* p) {
    U8 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// The IEEE half at p (F16C's conversion where there is one).
RTPCORE_QINLINE float half(const uint8_t* p) {
#if RTPCORE_Q_SIMD
    uint16_t h;
    std::memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
#else
    return gguf::f16_at(p);
#endif
}

// 16 bytes of packed nibbles -> 32 bytes: the low nibbles, then the high ones.
RTPCORE_QINLINE U8 nibbles(const uint8_t* p) {
#if RTPCORE_Q_SIMD
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(h), _mm_srli_epi16(h, 4), 1);
    return (U8)_mm256_and_si256(v, _mm256_set1_epi8(0x0f));
#else
    U8 v;
    for (int i = 0; i < 16; ++i) {
        v[i] = p[i] & 0xf;
        v[i + 16] = p[i] >> 4;
    }
    return v;
#endif
}

// Byte j = 0x10 where bit j of qh is set, else 0 (the fifth bit of q5_0 / q5_1 element j).
RTPCORE_QINLINE U8 fifth_bits(uint32_t qh) {
#if RTPCORE_Q_SIMD
    // Byte j takes byte j / 8 of qh, then tests its bit j % 8.
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
                                    _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return (U8)_mm256_and_si256(v, _mm256_set1_epi8(0x10));
#else
    U8 v;
    for (int j = 0; j < 32; ++j) v[j] = static_cast<uint8_t>(((qh >> j) & 1) << 4);
    return v;
#endif
}

// acc + the sums of every 4 consecutive products u[i] * s[i] (u unsigned, at most 128, s signed).
RTPCORE_QINLINE I32 dot_us(const I32& acc, const U8& u, const S8& s) {
#if RTPCORE_Q_VNNI == 2
    return (I32)_mm256_dpbusd_epi32((__m256i)acc, (__m256i)u, (__m256i)s);
#elif RTPCORE_Q_VNNI == 1
    return (I32)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)u, (__m256i)s);
#elif RTPCORE_Q_SIMD
    // u * s pairs fit int16 (128 * 127 * 2 < 2^15), so maddubs does not saturate.
    return acc + (I32)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)u, (__m256i)s), _mm256_set1_epi16(1));
#else
    I32 r = acc;
    for (int i = 0; i < 8; ++i)
        for (int k = 0; k < 4; ++k) r[i] += static_cast<int32_t>(u[4 * i + k]) * static_cast<int32_t>(s[4 * i + k]);
    return r;
#endif
}

// The same for two signed operands: |a| times b with a's sign (the byte product takes one
// unsigned operand).
RTPCORE_QINLINE I32 dot_ss(const I32& acc, const S8& a, const S8& b) {
#if RTPCORE_Q_SIMD
    return dot_us(acc, (U8)_mm256_sign_epi8((__m256i)a, (__m256i)a), (S8)_mm256_sign_epi8((__m256i)b, (__m256i)a));
#else
    I32 r = acc;
    for (int i = 0; i < 8; ++i)
        for (int k = 0; k < 4; ++k) r[i] += static_cast<int32_t>(a[4 * i + k]) * static_cast<int32_t>(b[4 * i + k]);
    return r;
#endif
}

// Lane i: sum over bytes 4i..4i+3 of u * s * sc16[byte / 2] (u at most 63: the pairs fit int16).
RTPCORE_QINLINE I32 dot_us_scaled(const U8& u, const S8& s, const I16& sc16) {
#if RTPCORE_Q_SIMD
    return (I32)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)u, (__m256i)s), (__m256i)sc16);
#else
    I32 r;
    for (int i = 0; i < 8; ++i) {
        int32_t t = 0;
        for (int k = 0; k < 4; ++k)
            t += static_cast<int32_t>(u[4 * i + k]) * static_cast<int32_t>(s[4 * i + k]) * sc16[(4 * i + k) / 2];
        r[i] = t;
    }
    return r;
#endif
}

// Lane i: a[2i] b[2i] + a[2i+1] b[2i+1] in int32.
RTPCORE_QINLINE I32 madd16(const I16& a, const I16& b) {
#if RTPCORE_Q_SIMD
    return (I32)_mm256_madd_epi16((__m256i)a, (__m256i)b);
#else
    I32 r;
    for (int i = 0; i < 8; ++i) r[i] = static_cast<int32_t>(a[2 * i]) * b[2 * i] + static_cast<int32_t>(a[2 * i + 1]) * b[2 * i + 1];
    return r;
#endif
}

RTPCORE_QINLINE F32 to_f32(const I32& v) { return __builtin_convertvector(v, F32); }

RTPCORE_QINLINE float hsum8(const F32& v) {
#if RTPCORE_Q_SIMD
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
#else
    float s = 0.0f;
    for (int i = 0; i < 8; ++i) s += v[i];
    return s;
#endif
}

// ---- weight blocks decoded into registers

// A 32-element block: its integers, its scale and the coefficient c of the activation
// block's s (the offset or min term).
struct Block32 {
    U8 q;
    float d, c;
};

template <gguf::Type T>
RTPCORE_QINLINE Block32 decode32(const uint8_t* p) {
    Block32 b;
    b.d = half(p);
    if constexpr (T == gguf::Type::q8_0) {
        b.q = ld32(p + 2);
        b.c = 0.0f;
    } else if constexpr (T == gguf::Type::q4_0) {
        b.q = nibbles(p + 2);
        b.c = -8.0f * b.d;
    } else if constexpr (T == gguf::Type::q5_0) {
        uint32_t qh;
        std::memcpy(&qh, p + 2, sizeof qh);
        b.q = nibbles(p + 6) | fifth_bits(qh);
        b.c = -16.0f * b.d;
    } else {  // q5_1
        uint32_t qh;
        std::memcpy(&qh, p + 4, sizeof qh);
        b.q = nibbles(p + 8) | fifth_bits(qh);
        b.c = half(p + 2);
    }
    return b;
}

// A 256-element K block: eight 32-element sub-blocks of integers, each with its int16 scales
// (one per 16 elements, as lanes of the madd that applies them), the 16 per-16 coefficients
// of the activations' per-16 sums, and the float scales of both terms (dmin = d for q6_k,
// whose offset term folds into the main sum).
struct BlockK {
    U8 q[8];
    I16 sc[8];
    I16 mn;
    float d, dmin;
};

RTPCORE_QINLINE I16 two_scales(int lo, int hi) {
#if RTPCORE_Q_SIMD
    return (I16)_mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(hi)), _mm_set1_epi16(static_cast<int16_t>(lo)));
#else
    I16 v;
    for (int i = 0; i < 8; ++i) {
        v[i] = static_cast<int16_t>(lo);
        v[i + 8] = static_cast<int16_t>(hi);
    }
    return v;
#endif
}

template <gguf::Type T>
RTPCORE_QINLINE void decodeK(const uint8_t* p, BlockK& b) {
    if constexpr (T == gguf::Type::q6_k) {
        const auto* sc = reinterpret_cast<const int8_t*>(p + 192);
        b.d = b.dmin = half(p + 208);
        for (int h = 0; h < 2; ++h) {
            const U8 ql0 = ld32(p + 64 * h), ql1 = ld32(p + 64 * h + 32), qh = ld32(p + 128 + 32 * h);
            b.q[4 * h + 0] = (ql0 & 0xf) | ((qh & 0x03) << 4);
            b.q[4 * h + 1] = (ql1 & 0xf) | ((qh & 0x0c) << 2);
            b.q[4 * h + 2] = (ql0 >> 4) | (qh & 0x30);
            b.q[4 * h + 3] = (ql1 >> 4) | ((qh & 0xc0) >> 2);
        }
        for (int c = 0; c < 8; ++c) b.sc[c] = two_scales(sc[2 * c], sc[2 * c + 1]);
        int16_t mn[16];
        for (int g = 0; g < 16; ++g) mn[g] = static_cast<int16_t>(32 * sc[g]);
        std::memcpy(&b.mn, mn, sizeof mn);
    } else {  // q4_k, q5_k
        constexpr bool five = T == gguf::Type::q5_k;
        b.d = half(p);
        b.dmin = half(p + 2);
        const uint8_t* qs = p + (five ? 48 : 16);
        U8 qh{};
        if constexpr (five) qh = ld32(p + 16);
        for (int j = 0; j < 4; ++j) {
            const U8 raw = ld32(qs + 32 * j);
            b.q[2 * j] = raw & 0xf;
            b.q[2 * j + 1] = raw >> 4;
            if constexpr (five) {
                b.q[2 * j] |= (U8)((qh & static_cast<uint8_t>(1u << (2 * j))) != 0) & 0x10;
                b.q[2 * j + 1] |= (U8)((qh & static_cast<uint8_t>(2u << (2 * j))) != 0) & 0x10;
            }
        }
        int16_t mn[16];
        for (int j = 0; j < 8; ++j) {
            int sc, m;
            gguf::scale_min_k4(j, p + 4, sc, m);
            b.sc[j] = I16{} + static_cast<int16_t>(sc);
            mn[2 * j] = mn[2 * j + 1] = static_cast<int16_t>(m);
        }
        std::memcpy(&b.mn, mn, sizeof mn);
    }
}

// ---- the products

// out[i] = dot(activation row m0 + i, weight row w) for MT rows, 32-element block types.
template <gguf::Type T, int MT>
RTPCORE_QINLINE void dot_rows32(const gguf::QActs& a, int64_t m0, const uint8_t* w,
                                                            float (&out)[kQMT]) {
    constexpr int bytes = gguf::info(T).bytes;
    const int64_t K = a.K, nb = K / 32;
    F32 acc[MT];
    float sacc[MT];
    for (int i = 0; i < MT; ++i) {
        acc[i] = F32{};
        sacc[i] = 0.0f;
    }
    for (int64_t b = 0; b < nb; ++b) {
        const Block32 wb = decode32<T>(w + b * bytes);
        for (int i = 0; i < MT; ++i) {
            const int64_t r = m0 + i;
            const S8 xq = (S8)ld32(a.qs + r * K + 32 * b);
            I32 isum = I32{};
            if constexpr (T == gguf::Type::q8_0) {
                isum = dot_ss(isum, (S8)wb.q, xq);
            } else {
                isum = dot_us(isum, wb.q, xq);
                sacc[i] += wb.c * a.s[r * nb + b];
            }
            acc[i] += to_f32(isum) * (wb.d * a.d[r * nb + b]);
        }
    }
    for (int i = 0; i < MT; ++i) out[i] = hsum8(acc[i]) + sacc[i];
}

// The same for the 256-element K types.
template <gguf::Type T, int MT>
RTPCORE_QINLINE void dot_rowsK(const gguf::QActs& a, int64_t m0, const uint8_t* w,
                                                           float (&out)[kQMT]) {
    constexpr int bytes = gguf::info(T).bytes;
    const int64_t K = a.K, nb = K / 256;
    F32 acc[MT], macc[MT];
    for (int i = 0; i < MT; ++i) acc[i] = macc[i] = F32{};
    BlockK wb;
    for (int64_t b = 0; b < nb; ++b) {
        decodeK<T>(w + b * bytes, wb);
        for (int i = 0; i < MT; ++i) {
            const int64_t r = m0 + i;
            const int8_t* xq = a.qs + r * K + 256 * b;
            I32 isum = dot_us_scaled(wb.q[0], (S8)ld32(xq), wb.sc[0]);
            for (int c = 1; c < 8; ++c) isum += dot_us_scaled(wb.q[c], (S8)ld32(xq + 32 * c), wb.sc[c]);
            I16 bs;
            std::memcpy(&bs, a.bsum + r * (K / 16) + 16 * b, sizeof bs);
            const I32 corr = madd16(wb.mn, bs);
            const float dx = a.d[r * nb + b];
            if constexpr (T == gguf::Type::q6_k) {
                acc[i] += to_f32(isum - corr) * (wb.d * dx);
            } else {
                acc[i] += to_f32(isum) * (wb.d * dx);
                macc[i] += to_f32(corr) * (wb.dmin * dx);
            }
        }
    }
    for (int i = 0; i < MT; ++i) out[i] = hsum8(acc[i] - macc[i]);
}

// Rows [m0, m0 + MT) of y for weight rows [n0, n1).
template <gguf::Type T, int MT>
static void tile(const gguf::QActs& a, int64_t m0, const uint8_t* w, int64_t row_bytes, const float* bias, float* y,
                 int64_t N, bool accumulate, int64_t n0, int64_t n1) {
    float out[kQMT];
    for (int64_t n = n0; n < n1; ++n) {
#if RTPCORE_Q_SIMD
        // The weight row kPrefetchRows ahead, into L1: the hardware prefetcher stops at each 4 KiB
        // page, and a decode step reads every weight once from memory (measured on a Q8_0 decode
        // step of SmolLM2's shape, 2 threads: 15.8 -> 9.0 ms).
        if (n + kPrefetchRows < n1) {
            const char* ahead = reinterpret_cast<const char*>(w + (n + kPrefetchRows) * row_bytes);
            for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
        }
#endif
        if constexpr (gguf::info(T).block == 32)
            dot_rows32<T, MT>(a, m0, w + n * row_bytes, out);
        else
            dot_rowsK<T, MT>(a, m0, w + n * row_bytes, out);
        const float bn = bias ? bias[n] : 0.0f;
        for (int i = 0; i < MT; ++i) {
            float* dst = y + (m0 + i) * N + n;
            *dst = accumulate ? *dst + (out[i] + bn) : out[i] + bn;
        }
    }
}

// y[:, n0:n1] (+)= x @ dequant(W[n0:n1]).T + bias for quantized activations `a` of M rows.
// Weight rows are taken in groups of about 64 KiB (kept in L2 while every tile of activation
// rows passes over them); each weight block is decoded once per tile of rows.
template <gguf::Type T>
static void qlinear(const gguf::QActs& a, int64_t M, const uint8_t* w, const float* bias, float* y, int64_t N,
                    bool accumulate, int64_t n0, int64_t n1) {
    const int64_t row_bytes = gguf::row_bytes(T, a.K);
    int64_t group = (int64_t{1} << 16) / row_bytes;
    group = group < 1 ? 1 : group;
    for (int64_t g0 = n0; g0 < n1; g0 += group) {
        const int64_t g1 = g0 + group < n1 ? g0 + group : n1;
        int64_t m = 0;
        for (; m + kQMT <= M; m += kQMT) tile<T, kQMT>(a, m, w, row_bytes, bias, y, N, accumulate, g0, g1);
        if constexpr (kQMT > 4)
            for (; m + 4 <= M; m += 4) tile<T, 4>(a, m, w, row_bytes, bias, y, N, accumulate, g0, g1);
        if constexpr (kQMT > 2)
            for (; m + 2 <= M; m += 2) tile<T, 2>(a, m, w, row_bytes, bias, y, N, accumulate, g0, g1);
        for (; m < M; ++m) tile<T, 1>(a, m, w, row_bytes, bias, y, N, accumulate, g0, g1);
    }
}

typedef void (*QLinearFn)(const gguf::QActs&, int64_t, const uint8_t*, const float*, float*, int64_t, bool, int64_t,
                          int64_t);

// The kernels by gguf::Type (f16 is a float32 kernel of _kernels_isa.hpp: none here).
constexpr QLinearFn kQLinear[7] = {
    qlinear<gguf::Type::q8_0>, qlinear<gguf::Type::q4_0>, qlinear<gguf::Type::q5_0>, qlinear<gguf::Type::q5_1>,
    qlinear<gguf::Type::q4_k>, qlinear<gguf::Type::q5_k>, qlinear<gguf::Type::q6_k>,
};

#undef RTPCORE_QINLINE
