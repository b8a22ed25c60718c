// GGUF block formats for rtpcore_native._kernels, independent of the instruction set: the
// byte layout of each block type (as ggml's ggml-common.h defines it and .gguf files store
// it), a row's size, scalar dequantization (the reference the SIMD kernels must match, and
// the embedding lookup of a quantized token_embd) and the quantization of float32
// activations to 8-bit blocks that the integer dot products consume.
//
// A row of K weights is K / block consecutive blocks; every multi-byte field is little-endian.
//   q8_0  (32, 34 B): f16 d; int8 q[32]                       w = d * q
//   q4_0  (32, 18 B): f16 d; u8 qs[16]                         w = d * (nibble - 8); low nibbles
//                      are elements 0-15, high nibbles 16-31
//   q5_0  (32, 22 B): f16 d; u8 qh[4]; u8 qs[16]               w = d * ((nibble | bit << 4) - 16);
//                      bit j of the 32-bit qh is element j's fifth bit
//   q5_1  (32, 24 B): f16 d, m; u8 qh[4]; u8 qs[16]            w = d * (nibble | bit << 4) + m
//   q4_k (256, 144 B): f16 d, dmin; u8 scales[12]; u8 qs[128] eight sub-blocks of 32 with 6-bit
//                      scale s and min m: w = d * s * nibble - dmin * m; each 32 bytes of qs hold
//                      two sub-blocks (low nibbles, then high)
//   q5_k (256, 176 B): f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]  as q4_k, with the
//                      fifth bit of element l of sub-block j in bit j of qh[l]
//   q6_k (256, 210 B): u8 ql[128]; u8 qh[64]; int8 scales[16]; f16 d  sixteen sub-blocks of 16:
//                      w = d * s * (q - 32), q 6 bits (4 in ql, 2 in qh; see dequantize_row)
//   f16   (1, 2 B)   : IEEE half
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace gguf {

// An IEEE half-precision weight (a distinct type, so the float kernels' loads pick its conversion).
struct f16_t {
    uint16_t bits;
};

enum class Type { q8_0, q4_0, q5_0, q5_1, q4_k, q5_k, q6_k, f16 };

struct TypeInfo {
    Type type;
    const char* name;
    int block;  // elements per block
    int bytes;  // bytes per block
};

constexpr TypeInfo kTypes[] = {
    {Type::q8_0, "q8_0", 32, 34},   {Type::q4_0, "q4_0", 32, 18},   {Type::q5_0, "q5_0", 32, 22},
    {Type::q5_1, "q5_1", 32, 24},   {Type::q4_k, "q4_k", 256, 144}, {Type::q5_k, "q5_k", 256, 176},
    {Type::q6_k, "q6_k", 256, 210}, {Type::f16, "f16", 1, 2},
};

constexpr const TypeInfo& info(Type t) { return kTypes[static_cast<int>(t)]; }

// The type named `name`, or false.
inline bool parse(const std::string& name, Type& out) {
    for (const TypeInfo& t : kTypes)
        if (name == t.name) {
            out = t.type;
            return true;
        }
    return false;
}

inline std::string names() {
    std::string s;
    for (const TypeInfo& t : kTypes) s += std::string(s.empty() ? "" : ", ") + "'" + t.name + "'";
    return s;
}

// Bytes of a row of K elements; std::invalid_argument naming the type and K when K is not a
// positive multiple of the block size.
inline int64_t row_bytes(Type t, int64_t K) {
    const TypeInfo& i = info(t);
    if (K <= 0 || K % i.block != 0)
        throw std::invalid_argument(std::string(i.name) + " rows need a positive multiple of " +
                                    std::to_string(i.block) + " elements, got K=" + std::to_string(K));
    return K / i.block * i.bytes;
}

// IEEE half -> float32, exactly (subnormals, infinities and NaN included).
inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        exp = 113;
        while (!(man & 0x400u)) {
            man <<= 1;
            --exp;
        }
        bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline float f16_at(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, sizeof h);
    return f16_to_f32(h);
}

// The 6-bit scale and min of sub-block j (0-7) of a q4_k / q5_k block's 12 scale bytes.
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// out[0:K] = the K weights of one row (K a multiple of the block size), scalar.
inline void dequantize_row(Type t, const uint8_t* row, int64_t K, float* out) {
    const TypeInfo& ti = info(t);
    const int64_t blocks = K / ti.block;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* p = row + b * ti.bytes;
        float* y = out + b * ti.block;
        switch (t) {
            case Type::f16:
                *y = f16_at(p);
                break;
            case Type::q8_0: {
                const float d = f16_at(p);
                for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>(static_cast<int8_t>(p[2 + i]));
                break;
            }
            case Type::q4_0: {
                const float d = f16_at(p);
                for (int i = 0; i < 16; ++i) {
                    y[i] = d * static_cast<float>((p[2 + i] & 0xf) - 8);
                    y[i + 16] = d * static_cast<float>((p[2 + i] >> 4) - 8);
                }
                break;
            }
            case Type::q5_0:
            case Type::q5_1: {
                const bool one = t == Type::q5_1;
                const float d = f16_at(p), m = one ? f16_at(p + 2) : 0.0f;
                uint32_t qh;
                std::memcpy(&qh, p + (one ? 4 : 2), sizeof qh);
                const uint8_t* qs = p + (one ? 8 : 6);
                const int off = one ? 0 : 16;
                for (int i = 0; i < 16; ++i) {
                    const int lo = (qs[i] & 0xf) | (((qh >> i) & 1) << 4);
                    const int hi = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
                    y[i] = d * static_cast<float>(lo - off) + m;
                    y[i + 16] = d * static_cast<float>(hi - off) + m;
                }
                break;
            }
            case Type::q4_k:
            case Type::q5_k: {
                const bool five = t == Type::q5_k;
                const float d = f16_at(p), dmin = f16_at(p + 2);
                const uint8_t* scales = p + 4;
                const uint8_t* qh = p + 16;
                const uint8_t* qs = p + (five ? 48 : 16);
                for (int j = 0; j < 8; ++j) {
                    int sc, m;
                    scale_min_k4(j, scales, sc, m);
                    const float dj = d * static_cast<float>(sc), mj = dmin * static_cast<float>(m);
                    const uint8_t* q = qs + 32 * (j / 2);
                    for (int l = 0; l < 32; ++l) {
                        int v = (j % 2) ? q[l] >> 4 : q[l] & 0xf;
                        if (five) v |= ((qh[l] >> j) & 1) << 4;
                        y[32 * j + l] = dj * static_cast<float>(v) - mj;
                    }
                }
                break;
            }
            case Type::q6_k: {
                const float d = f16_at(p + 208);
                const auto* sc = reinterpret_cast<const int8_t*>(p + 192);
                for (int h = 0; h < 2; ++h) {
                    const uint8_t* ql = p + 64 * h;
                    const uint8_t* qh = p + 128 + 32 * h;
                    for (int l = 0; l < 32; ++l) {
                        const int q[4] = {(ql[l] & 0xf) | ((qh[l] & 3) << 4),
                                          (ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4),
                                          (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                                          (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)};
                        for (int c = 0; c < 4; ++c) {
                            const int e = 128 * h + 32 * c + l;  // element; its scale is sc[e / 16]
                            y[e] = d * static_cast<float>(sc[e / 16]) * static_cast<float>(q[c] - 32);
                        }
                    }
                }
                break;
            }
        }
    }
}

// ---- activations quantized to 8 bits per block

// Activation rows quantized as llama.cpp quantizes them for its integer dot products: blocks
// of `block` values (32: q8_0, for the 32-element weight types; 256: q8_K, for the K types)
// with one float scale d = max|x| / 127 and q = round(x / d) in [-127, 127] (ties to even),
// plus the sum of every 16 consecutive q (the weights' offsets and mins multiply it) and, for
// 32-blocks, s = d * (sum of the block's q). Row m of K values: qs[m * K ...], d[m * K / block
// ...], s[m * K / 32 ...], bsum[m * K / 16 ...]. |x - d q| <= d / 2 = max|x| / 254 per block.
struct QActs {
    int block = 32;
    int64_t K = 0;
    int8_t* qs = nullptr;
    float* d = nullptr;
    float* s = nullptr;
    int16_t* bsum = nullptr;
    // q + 128 as unsigned bytes, (M, K), for the 32-element blocks of a product of many rows
    // (the VNNI GEMM of _gguf_isa.hpp; AVX2's takes q signed); null when not made.
    const uint8_t* qu = nullptr;
};

// Round to nearest, ties to even, for |v| < 2^22 (adding 1.5 * 2^23 leaves the integer in the
// low mantissa bits); the same on every instruction set.
inline int32_t round_nearest(float v) {
    const float r = v + 12582912.0f;
    int32_t i;
    std::memcpy(&i, &r, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

// Quantizes one row of K values (K a multiple of a.block) into row m of `a`.
inline void quantize_row(const float* x, int64_t m, QActs& a) {
    const int64_t K = a.K, nb = K / a.block;
    int8_t* qs = a.qs + m * K;
    for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + b * a.block;
        float amax = 0.0f;
        for (int i = 0; i < a.block; ++i) amax = std::fabs(xb[i]) > amax ? std::fabs(xb[i]) : amax;
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < a.block; ++i) {
            int32_t q = round_nearest(xb[i] * id);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            qs[b * a.block + i] = static_cast<int8_t>(q);
        }
        a.d[m * nb + b] = d;
    }
    for (int64_t g = 0; g < K / 16; ++g) {
        int s = 0;
        for (int i = 0; i < 16; ++i) s += qs[16 * g + i];
        a.bsum[m * (K / 16) + g] = static_cast<int16_t>(s);
    }
    if (a.block == 32)
        for (int64_t b = 0; b < nb; ++b)
            a.s[m * nb + b] = a.d[m * nb + b] * static_cast<float>(a.bsum[m * (K / 16) + 2 * b] +
                                                                   a.bsum[m * (K / 16) + 2 * b + 1]);
}

// One instruction set's activation quantizer, dequantizer and int8 product (_gguf_isa.hpp),
// beside its GGUF products.
struct QKernels {
    // Rows [0, M) of x (M, a.K) into a, exactly as quantize_row.
    void (*quantize)(const float* x, int64_t M, QActs& a);
    // out[0:K] = one row's weights, exactly as dequantize_row.
    void (*dequantize)(Type t, const uint8_t* row, int64_t K, float* out);
    // y[:, n0:n1] (+)= scale[n] * (x @ w[n].T) + bias[n] for int8 w (N, K), K a multiple of 32,
    // over x quantized to blocks of 32.
    void (*linear_i8)(const QActs& a, int64_t M, const int8_t* w, const float* scale, const float* bias, float* y,
                      int64_t N, bool accumulate, int64_t n0, int64_t n1);
    // From this many rows q8_0, q4_0, q5_0, q5_1 and int8 weights multiply as a GEMM over repacked
    // weights (byte dot products: VNNI's or AVX2's); 0: this set has no such GEMM (the baseline).
    int64_t gemm_rows;
    // Whether that GEMM takes the activations as q + 128 (QActs::qu: VNNI's unsigned operand).
    bool gemm_unsigned;
};

}  // namespace gguf
