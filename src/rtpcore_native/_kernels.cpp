// rtpcore_native._kernels: CPU decode kernels for float32 activations.
//
// A decode step at small batch sizes reads every weight once and does little else, so its
// speed is memory bandwidth plus the cost of launching its small operations. This module
// runs a whole Llama-family decode step (embedding, every layer, the final norm and the
// head) in one call without the GIL: matrix-vector products over float32 or int8 weights
// (one scale per output row) tiled for the registers of the CPU it runs on, RMSNorm, RoPE,
// the KV write, attention read in place from the paged pools, SwiGLU. `linear` exposes the
// product alone (rtpcore.models.layers.Linear's int8 kernel).
//
// Instruction sets: the kernels are compiled three times (AVX-512, AVX2 + FMA, the x86-64
// baseline; _kernels_isa.hpp), the quantized ones also with each byte dot product, and grouped
// into kernel sets, best first: amx, avx512_bf16, avx512_vnni, avx512, avx2_vnni, avx2,
// baseline. The best set the CPU and the OS support (_cpu_features.hpp: CPUID, XCR0, and for
// amx the tile permission and a probe in a child process) is chosen at the first kernel call,
// at or below two caps: RTPCORE_CPU_ISA (avx2 | avx512 | avx512_bf16 | amx, rtpcore's
// --cpu-isa: at most avx2_vnni, avx512_vnni, avx512_bf16, amx; a value the CPU cannot run, or
// an unknown one, is an error, never a silent fallback) and ONEDNN_MAX_CPU_ISA, read as oneDNN
// reads it, so one variable makes a machine behave as an older CPU for torch and for us.
// `set_isa` chooses any supported set for tests, whatever the caps. Other architectures get
// the baseline code only.
// The sets avx512_bf16 and amx add bf16 dot products (_bf16_isa.hpp: vdpbf16ps, AMX tiles) for
// bf16 weights in the blocked layout (bf16p below).
//
// Threads: a pool of its own (std::thread), sized by `set_num_threads` (rtpcore passes
// torch's thread count). Workers spin briefly between the parallel regions of a step and
// then sleep; a pool inherited through fork is rebuilt in the child.
//
// Pointers cross the boundary as integers (torch's data_ptr()); the Python caller
// (rtpcore.models.native) checks dtypes, shapes and contiguity and keeps the tensors alive.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;

#if defined(__x86_64__) || defined(__i386__)
#define RTPCORE_X86 1
#endif

#include "_cpu_features.hpp"
#include "_gguf_blocks.hpp"

// ---- bfloat16

inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// Round to nearest, ties to even, as torch's float32 -> bfloat16 conversion (NaN stays NaN).
inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

// The blocked bfloat16 layout ("bfloat16_packed"), the one form a bf16 weight keeps where the
// bf16 kernels run: an (N, K) weight padded with zeros to (Np, Kp), Np a multiple of 16 and Kp
// of 32, then stored block by block of 16 output rows, each block as Kp / 2 rows of 32 values,
// the pairs (w[n][2p], w[n][2p + 1]) of its 16 rows n:
//   packed[((n / 16) * (Kp / 2) + p) * 32 + (n % 16) * 2 + e] = w[n][2p + e]
// It is what vdpbf16ps multiplies with one broadcast pair of activations (16 outputs per
// instruction, no horizontal sums), AMX's B tile layout (16 pair-rows of 64 bytes per tile), and
// what the widening kernels read as 16 uint32 lanes (input 2p in the low half, 2p + 1 in the
// high half). In torch: w.view(Np / 16, 16, Kp / 2, 2).permute(0, 2, 1, 3) of the padded weight.
namespace bf16p {
constexpr int64_t kRows = 16;   // output rows per block
constexpr int64_t kDepth = 32;  // K padding (one AMX tile of activations is 16 rows x 32 values)
inline int64_t padded_rows(int64_t N) { return (N + kRows - 1) / kRows * kRows; }
inline int64_t padded_depth(int64_t K) { return (K + kDepth - 1) / kDepth * kDepth; }
}  // namespace bf16p

// Where a product over bf16p weights writes: (M, ld) float32, added to when `accumulate`, or
// bfloat16 (rounded to nearest even; never accumulated).
struct Out {
    float* f = nullptr;
    uint16_t* h = nullptr;
    int64_t ld = 0;
    bool accumulate = false;
};

#ifdef RTPCORE_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12: false alarms in its own
#pragma GCC diagnostic ignored "-Wuninitialized"       // _mm512_cvtepi32_ps and _mm512_reduce_add_ps
namespace isa_avx512 {
#define RTPCORE_VBYTES 64
#define RTPCORE_MT 4
#include "_kernels_isa.hpp"
#undef RTPCORE_VBYTES
#undef RTPCORE_MT
}  // namespace isa_avx512
namespace q_avx512 {
#define RTPCORE_Q_SIMD 1
#define RTPCORE_Q_VNNI 0
#define RTPCORE_Q_MT 8
#include "_gguf_isa.hpp"
#undef RTPCORE_Q_VNNI
#undef RTPCORE_Q_MT
}  // namespace q_avx512
#pragma GCC diagnostic pop
#pragma GCC pop_options

// The quantized kernels again with AVX512-VNNI's byte dot product.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
namespace q_avx512_vnni {
#define RTPCORE_Q_VNNI 2
#define RTPCORE_Q_MT 8
#include "_gguf_isa.hpp"
#undef RTPCORE_Q_VNNI
#undef RTPCORE_Q_MT
}  // namespace q_avx512_vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
#define RTPCORE_VBYTES 32
#define RTPCORE_MT 2
#include "_kernels_isa.hpp"
#undef RTPCORE_VBYTES
#undef RTPCORE_MT
}  // namespace isa_avx2
namespace q_avx2 {
#define RTPCORE_Q_VNNI 0
#define RTPCORE_Q_MT 4
#include "_gguf_isa.hpp"
#undef RTPCORE_Q_VNNI
#undef RTPCORE_Q_MT
}  // namespace q_avx2
#pragma GCC pop_options

// The bf16 dot-product kernels (_bf16_isa.hpp): AVX512-BF16's vdpbf16ps, and with AMX-BF16's
// tiles from a few rows on. Their sets reuse the AVX-512 float kernels and the VNNI quantized ones.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
namespace bf16_avx512 {
#define RTPCORE_AMX 0
#include "_bf16_isa.hpp"
#undef RTPCORE_AMX
}  // namespace bf16_avx512
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")
namespace bf16_amx {
#define RTPCORE_AMX 1
#include "_bf16_isa.hpp"
#undef RTPCORE_AMX
}  // namespace bf16_amx
#pragma GCC pop_options

// And with AVX-VNNI (the VEX-encoded byte dot product of CPUs with AVX-VNNI but maybe no AVX-512).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace q_avx2_vnni {
#define RTPCORE_Q_VNNI 1
#define RTPCORE_Q_MT 4
#include "_gguf_isa.hpp"
#undef RTPCORE_Q_VNNI
#undef RTPCORE_Q_MT
}  // namespace q_avx2_vnni
#pragma GCC pop_options
#undef RTPCORE_Q_SIMD
#endif

namespace isa_base {
#define RTPCORE_VBYTES 16
#define RTPCORE_MT 2
#include "_kernels_isa.hpp"
#undef RTPCORE_VBYTES
#undef RTPCORE_MT
}  // namespace isa_base
// 32-byte vectors without AVX: GCC warns at every function taking or returning one that its
// ABI differs, which concerns only calls across objects (these helpers are static and all
// inlined). Ignored to the end of the file: GCC reports some of them there.
#pragma GCC diagnostic ignored "-Wpsabi"
namespace q_base {
#define RTPCORE_Q_SIMD 0
#define RTPCORE_Q_VNNI 0
#define RTPCORE_Q_MT 2
#include "_gguf_isa.hpp"
#undef RTPCORE_Q_SIMD
#undef RTPCORE_Q_VNNI
#undef RTPCORE_Q_MT
}  // namespace q_base

namespace {

// ---- instruction sets

struct Kernels {
    const char* name;
    void (*linear_f32)(const float*, int64_t, int64_t, const float*, const float*, float*, int64_t, bool, int64_t,
                       int64_t);
    void (*linear_i8)(const float*, int64_t, int64_t, const int8_t*, const float*, const float*, float*, int64_t,
                      bool, int64_t, int64_t);
    void (*linear_bf16)(const float*, int64_t, int64_t, const uint16_t*, const float*, float*, int64_t, bool, int64_t,
                        int64_t);
    void (*linear_f16)(const float*, int64_t, int64_t, const gguf::f16_t*, const float*, float*, int64_t, bool,
                       int64_t, int64_t);
    // bf16p weights (the blocked layout): float32 activations widened in registers ...
    void (*linear_bf16p)(const float*, int64_t, int64_t, const uint16_t*, const float*, const Out&, int64_t, int64_t,
                         int64_t);
    // ... or, in the sets with bf16 dot products (null elsewhere), activations rounded to bfloat16
    // first (to_bf16: rows of Kp values), by vdpbf16ps or, from g_amx_rows rows on, AMX tiles
    // (more than 16 rows rounded up to a multiple of 16)
    void (*linear_bf16p_dot)(const uint16_t*, int64_t, int64_t, const uint16_t*, const float*, const Out&, int64_t,
                             int64_t, int64_t);
    void (*linear_bf16p_amx)(const uint16_t*, int64_t, int64_t, const uint16_t*, const float*, const Out&, int64_t,
                             int64_t, int64_t);
    void (*to_bf16)(const float*, int64_t, int64_t, uint16_t*, int64_t);
    // the quantized GGUF products by gguf::Type (q8_0 ... q6_k), over quantized activations
    const q_base::QLinearFn* qlinear;
    void (*rms_norm)(const float*, const float*, float, float*, int64_t);
    void (*silu_mul)(const float*, const float*, float*, int64_t);
    void (*rope)(float*, int64_t, int64_t, const float*, const float*);
    // attention over float32 / bfloat16 pools
    void (*attend[2])(const float*, int64_t, int64_t, const void*, const void*, int64_t, int64_t, int64_t,
                      const int64_t*, int64_t, int64_t, int64_t, float, float*, const void**, float*);
    // the activation quantizer, dequantizer and int8 product beside the quantized products
    const gguf::QKernels* q;
    // attention of a span of new tokens over float32 / bfloat16 pools (attend_span)
    void (*attend_span[2])(const float*, int64_t, int64_t, int64_t, int64_t, const void*, const void*, int64_t,
                           int64_t, const int64_t*, int64_t, int64_t, int64_t, float, float*, int64_t, float*);
};

#define RTPCORE_KERNELS_DOT(ns, qns, label, dot, amx, to_bf16)                                              \
    Kernels{label,           ns::linear_f32, ns::linear_i8, ns::linear_bf16, ns::linear_f16, ns::linear_bf16p, \
            dot,             amx,            to_bf16,       qns::kQLinear,   ns::rms_norm,   ns::silu_mul,     \
            ns::rope,        {ns::attend_f32, ns::attend_bf16}, &qns::kQKernels,                              \
            {ns::attend_span_f32, ns::attend_span_bf16}}
#define RTPCORE_KERNELS(ns, qns, label) RTPCORE_KERNELS_DOT(ns, qns, label, nullptr, nullptr, nullptr)

// The sets, best first: the float kernels differ by vector width, the quantized ones also by
// the byte dot product (VNNI's vpdpbusd, or AVX2's vpmaddubsw + vpmaddwd); avx512_bf16 and amx
// add the bf16 dot products (vdpbf16ps) and, for amx, the tiles.
const Kernels kBase = RTPCORE_KERNELS(isa_base, q_base, "baseline");
#ifdef RTPCORE_X86
const Kernels kAvx2 = RTPCORE_KERNELS(isa_avx2, q_avx2, "avx2");
const Kernels kAvx2Vnni = RTPCORE_KERNELS(isa_avx2, q_avx2_vnni, "avx2_vnni");
const Kernels kAvx512 = RTPCORE_KERNELS(isa_avx512, q_avx512, "avx512");
const Kernels kAvx512Vnni = RTPCORE_KERNELS(isa_avx512, q_avx512_vnni, "avx512_vnni");
const Kernels kAvx512Bf16 = RTPCORE_KERNELS_DOT(isa_avx512, q_avx512_vnni, "avx512_bf16", bf16_avx512::linear_dot,
                                                nullptr, bf16_avx512::to_bf16);
const Kernels kAmx = RTPCORE_KERNELS_DOT(isa_avx512, q_avx512_vnni, "amx", bf16_amx::linear_dot, bf16_amx::linear_amx,
                                         bf16_amx::to_bf16);
const Kernels* const kAll[] = {&kAmx, &kAvx512Bf16, &kAvx512Vnni, &kAvx512, &kAvx2Vnni, &kAvx2, &kBase};
#else
const Kernels* const kAll[] = {&kBase};
#endif

// Every set's name, best first, on every architecture (a set not compiled here is never supported).
const char* const kLadder[] = {"amx", "avx512_bf16", "avx512_vnni", "avx512", "avx2_vnni", "avx2", "baseline"};
constexpr int kLadderSize = sizeof(kLadder) / sizeof(kLadder[0]);

int ladder_rank(const std::string& isa) {
    for (int i = 0; i < kLadderSize; ++i)
        if (isa == kLadder[i]) return i;
    return -1;
}

bool supported(const std::string& isa) {
    if (isa == "baseline") return true;
#ifdef RTPCORE_X86
    const cpu::Features& f = cpu::features();
    const bool avx2 = f.os_avx && f.avx && f.avx2 && f.fma && f.f16c;
    const bool avx512 = avx2 && f.os_avx512 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
    const bool avx512_vnni = avx512 && f.avx512_vnni;
    const bool avx512_bf16 = avx512_vnni && f.avx512_bf16;
    if (isa == "avx2") return avx2;
    if (isa == "avx2_vnni") return avx2 && f.avx_vnni;
    if (isa == "avx512") return avx512;
    if (isa == "avx512_vnni") return avx512_vnni;
    if (isa == "avx512_bf16") return avx512_bf16;
    if (isa == "amx") return avx512_bf16 && cpu::amx_probe().ok;  // flags, XCR0, permission, probe
#endif
    return false;
}

const Kernels* by_name(const std::string& isa) {
    for (const Kernels* k : kAll)
        if (isa == k->name) return k;
    std::string known;
    for (const Kernels* k : kAll) known += std::string(known.empty() ? "" : ", ") + "'" + k->name + "'";
    throw std::invalid_argument("unknown instruction set '" + isa + "' (known: " + known + ")");
}

// rtpcore's --cpu-isa values (RTPCORE_CPU_ISA): the lowest set a value needs (a CPU without it
// cannot run the value) and the highest it allows.
struct CpuIsa {
    const char* value;
    const char* lowest;
    const char* highest;
};
const CpuIsa kCpuIsas[] = {
    {"avx2", "avx2", "avx2_vnni"},
    {"avx512", "avx512", "avx512_vnni"},
    {"avx512_bf16", "avx512_bf16", "avx512_bf16"},
    {"amx", "amx", "amx"},
};

const CpuIsa& cpu_isa(const std::string& value) {
    for (const CpuIsa& c : kCpuIsas)
        if (value == c.value) return c;
    std::string known;
    for (const CpuIsa& c : kCpuIsas) known += std::string(known.empty() ? "" : ", ") + c.value;
    throw std::invalid_argument("cpu_isa '" + value + "' is not one of " + known);
}

// The values this CPU (and OS) can run, in kCpuIsas order.
std::vector<std::string> supported_cpu_isas() {
    std::vector<std::string> out;
    for (const CpuIsa& c : kCpuIsas)
        if (supported(c.lowest)) out.emplace_back(c.value);
    return out;
}

// `value` checked: known, and runnable here; std::invalid_argument naming it, what this CPU
// runs and (for amx) why the probe failed.
const CpuIsa& checked_cpu_isa(const std::string& value, const char* what) {
    const CpuIsa* c;
    try {
        c = &cpu_isa(value);
    } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(std::string(what) + ": " + e.what());
    }
    if (!supported(c->lowest)) {
        std::string runs;
        for (const std::string& v : supported_cpu_isas()) runs += std::string(runs.empty() ? "" : ", ") + v;
        std::string why = value == "amx" ? " (AMX: " + cpu::amx_probe().reason + ")" : "";
        throw std::invalid_argument(std::string(what) + ": this CPU cannot run the '" + value + "' kernels" + why +
                                    "; it runs: " + (runs.empty() ? "none of them (the baseline only)" : runs));
    }
    return *c;
}

// The highest set ONEDNN_MAX_CPU_ISA allows, read as oneDNN reads it: unset, DEFAULT, ALL or
// an AMX name: no cap; AVX512_CORE_BF16, AVX10_1_512 / AVX512_CORE_FP16: avx512_bf16;
// AVX512_CORE_VNNI: avx512_vnni; AVX512_CORE: avx512; AVX2_VNNI*: avx2_vnni; AVX2: avx2;
// SSE41 / AVX: the baseline. A name oneDNN does not know caps nothing (oneDNN ignores it).
std::string onednn_cap() {
    std::string cap;
    if (const char* env = std::getenv("ONEDNN_MAX_CPU_ISA")) {
        for (const char* p = env; *p; ++p) cap.push_back(static_cast<char>(std::toupper(static_cast<unsigned char>(*p))));
    }
    if (cap == "AVX512_CORE_BF16" || cap == "AVX10_1_512" || cap == "AVX512_CORE_FP16") return "avx512_bf16";
    if (cap == "AVX512_CORE_VNNI") return "avx512_vnni";
    if (cap == "AVX512_CORE") return "avx512";
    if (cap.rfind("AVX2_VNNI", 0) == 0) return "avx2_vnni";
    if (cap.rfind("AVX2", 0) == 0) return "avx2";
    if (cap.rfind("SSE", 0) == 0 || cap == "AVX") return "baseline";
    return "amx";
}

// The highest set both caps allow (RTPCORE_CPU_ISA checked: see checked_cpu_isa).
std::string isa_cap() {
    std::string cap = onednn_cap();
    const char* env = std::getenv("RTPCORE_CPU_ISA");
    if (env && *env) {
        const CpuIsa& c = checked_cpu_isa(env, (std::string("RTPCORE_CPU_ISA=") + env).c_str());
        if (ladder_rank(c.highest) > ladder_rank(cap)) cap = c.highest;
    }
    return cap;
}

// The best supported set at or below the caps.
std::string default_isa() {
    const int cap = ladder_rank(isa_cap());
    for (const Kernels* k : kAll)
        if (ladder_rank(k->name) >= cap && supported(k->name)) return k->name;
    return "baseline";
}

const Kernels* g_kernels = nullptr;
// From how many activation rows on the amx set multiplies bf16 weights with AMX tiles rather than
// vdpbf16ps (set_amx_rows; benchmarks/bench_bf16_kernels.py measures where they cross).
int64_t g_amx_rows = 2;

const Kernels& kernels() {
    if (!g_kernels) g_kernels = by_name(default_isa());
    return *g_kernels;
}

// ---- the thread pool
//
// Built with OpenMP (setup.py), a region runs on OpenMP's threads: the extension then shares
// torch's libgomp (one OpenMP runtime per process: the SONAME libgomp.so.1 is loaded once),
// so a step that alternates torch's ops and these kernels keeps one set of threads on the
// cores. With threads of the extension's own, OpenMP's threads spin for a while after each
// torch op and took the cores from them (measured on an AVX2-only EPYC, 2 vCPUs, a Q8_0 512-token
// prefill: 270-286 tok/s with the pool's own threads, 373-382 on OpenMP's, medians of 7; the
// all-native decode step unchanged). The chunks are claimed one at a time in both.

// A region is cut into chunks that the caller and the workers claim one at a time, so a
// worker the OS has not scheduled (a core shared with another process) delays nothing: the
// caller claims what is left and waits only for chunks already running. A claim is a
// compare-and-swap of (region, next chunk) packed in one word, so a worker arriving late
// cannot claim a chunk of a region that has ended; a region's job and size sit in one of two
// slots, which stay put while their region may still be claimed from.
#ifdef _OPENMP
constexpr bool kOpenMP = true;
#else
constexpr bool kOpenMP = false;
#endif

class Pool {
  public:
    explicit Pool(int threads, bool openmp) : threads_(threads < 1 ? 1 : threads), pid_(getpid()), openmp_(openmp) {
        if (!openmp_)
            for (int t = 1; t < threads_; ++t) workers_.emplace_back([this] { work(); });
    }
    ~Pool() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stop_ = true;
            epoch_.fetch_add(1, std::memory_order_release);
        }
        cv_.notify_all();
        for (auto& w : workers_) w.join();
    }
    int threads() const { return threads_; }
    pid_t pid() const { return pid_; }

    // Runs fn(c) for every chunk c in [0, chunks) and returns when all have.
    void run(int64_t chunks, const std::function<void(int64_t)>& fn) {
        if (threads_ == 1 || chunks <= 1) {
            for (int64_t c = 0; c < chunks; ++c) fn(c);
            return;
        }
#ifdef _OPENMP
        if (openmp_) {
            std::atomic<int64_t> next{0};
            const int team = static_cast<int>(chunks < threads_ ? chunks : threads_);
#pragma omp parallel num_threads(team)
            for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
                 c = next.fetch_add(1, std::memory_order_relaxed))
                fn(c);
            return;
        }
#endif
        const uint64_t region = ++regions_;
        Slot& slot = slots_[region & 1];
        slot.job = &fn;
        slot.chunks = chunks;
        done_.store(0, std::memory_order_relaxed);
        state_.store(region << 32, std::memory_order_release);
        {
            std::lock_guard<std::mutex> lock(mutex_);
            epoch_.fetch_add(1, std::memory_order_release);
        }
        if (sleeping_.load(std::memory_order_acquire) > 0) cv_.notify_all();
        drain(region);
        while (done_.load(std::memory_order_acquire) != chunks) pause();
    }

  private:
    struct Slot {
        const std::function<void(int64_t)>* job = nullptr;
        int64_t chunks = 0;
    };

    static void pause() {
#ifdef RTPCORE_X86
        __builtin_ia32_pause();
#endif
    }

    // Claims and runs chunks of `region` until none is left (or another region began).
    void drain(uint64_t region) {
        const Slot& slot = slots_[region & 1];
        uint64_t v = state_.load(std::memory_order_acquire);
        for (;;) {
            if ((v >> 32) != region) return;
            const int64_t chunk = static_cast<int64_t>(v & 0xffffffffu);
            if (chunk >= slot.chunks) return;
            if (!state_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire))
                continue;
            (*slot.job)(chunk);
            done_.fetch_add(1, std::memory_order_acq_rel);
            v = state_.load(std::memory_order_acquire);
        }
    }

    void work() {
        uint64_t seen = 0;
        for (;;) {
            // Spin a while for the next region of the same step, then sleep.
            uint64_t now = epoch_.load(std::memory_order_acquire);
            for (int i = 0; now == seen && i < 4000; ++i) {
                pause();
                now = epoch_.load(std::memory_order_acquire);
            }
            if (now == seen) {
                std::unique_lock<std::mutex> lock(mutex_);
                sleeping_.fetch_add(1, std::memory_order_acq_rel);
                cv_.wait(lock, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
                sleeping_.fetch_sub(1, std::memory_order_acq_rel);
                now = epoch_.load(std::memory_order_acquire);
            }
            seen = now;
            if (stop_) return;
            drain(state_.load(std::memory_order_acquire) >> 32);
        }
    }

    const int threads_;
    const pid_t pid_;
    const bool openmp_;
    std::vector<std::thread> workers_;
    std::atomic<uint64_t> epoch_{0};     // bumped per region: wakes the workers
    std::atomic<uint64_t> state_{0};     // (region << 32) | next unclaimed chunk
    std::atomic<int64_t> done_{0};       // chunks of the current region finished
    std::atomic<int> sleeping_{0};
    uint64_t regions_ = 0;               // the caller's count (one caller at a time)
    Slot slots_[2];
    bool stop_ = false;
    std::mutex mutex_;
    std::condition_variable cv_;
};

int g_threads = 1;
Pool* g_pool = nullptr;
const pid_t g_load_pid = getpid();  // the process that loaded the module

// Whether the pool's regions run on OpenMP's threads: where the extension is built with OpenMP
// (it then shares torch's runtime, libgomp.so.1, loaded once per process), unless
// RTPCORE_NATIVE_POOL=threads asks for the pool's own threads, and never in a child forked
// after the module loaded (libgomp's threads are gone there and its first region would hang).
bool use_openmp() {
    const char* own = std::getenv("RTPCORE_NATIVE_POOL");
    return kOpenMP && getpid() == g_load_pid && !(own && std::string(own) == "threads");
}
// One native call at a time (engines in several threads take turns; they would share the
// cores anyway): the pool, its size and the kernel choice change only between calls.
std::mutex g_call_mutex;

Pool& pool() {
    if (g_pool && g_pool->pid() != getpid()) g_pool = nullptr;  // inherited through fork: its threads are gone
    if (!g_pool || g_pool->threads() != g_threads) {
        if (g_pool && g_pool->pid() == getpid()) delete g_pool;
        g_pool = new Pool(g_threads, use_openmp());
    }
    return *g_pool;
}

// Chunks of `total` items, in multiples of `align`, a few per thread.
inline int64_t chunk_size(int64_t total, int threads, int64_t align) {
    int64_t per = (total + 4 * threads - 1) / (4 * threads);
    per = (per + align - 1) / align * align;
    return per < align ? align : per;
}

// fn(r) for every row r in [0, rows) of `width` values each, over the pool in chunks of rows
// (one thread below 16K values: a small call does not pay for waking the pool).
template <typename Fn>
void for_rows(int64_t rows, int64_t width, Fn fn) {
    Pool& p = pool();
    if (rows * width < (1 << 14) || p.threads() == 1) {
        for (int64_t r = 0; r < rows; ++r) fn(r);
        return;
    }
    const int64_t per = chunk_size(rows, p.threads(), 1);
    p.run((rows + per - 1) / per, [&](int64_t c) {
        const int64_t r1 = (c + 1) * per < rows ? (c + 1) * per : rows;
        for (int64_t r = c * per; r < r1; ++r) fn(r);
    });
}

// ---- linear layers

// float32, int8 (one scale per output row), bfloat16 rows, bfloat16 in the blocked layout
// (bf16p), then the GGUF types in gguf::Type order (f16 last): a GGUF kind is gguf_first + its
// gguf::Type.
enum class WeightKind { f32, i8, bf16, bf16p, gguf_first };

WeightKind gguf_kind(gguf::Type t) { return static_cast<WeightKind>(static_cast<int>(WeightKind::gguf_first) + static_cast<int>(t)); }
bool is_gguf(WeightKind k) { return static_cast<int>(k) >= static_cast<int>(WeightKind::gguf_first); }
gguf::Type gguf_type(WeightKind k) { return static_cast<gguf::Type>(static_cast<int>(k) - static_cast<int>(WeightKind::gguf_first)); }

struct LinearW {
    const void* w = nullptr;  // (N, K) float32, int8 or bfloat16; (Np, Kp) bf16p; or N rows of GGUF blocks
    WeightKind kind = WeightKind::f32;
    const float* scale = nullptr;  // (N,) int8 only
    const float* bias = nullptr;   // (N,) or null
    int64_t N = 0, K = 0;
};

// Activations quantized for the GGUF kernels: one buffer, reused by every call (calls run one
// at a time under g_call_mutex; a decode step's products run one after another). Rows are
// quantized over the pool when there are several.
gguf::QActs quantize_acts(const Kernels& k, const float* x, int64_t M, int64_t K, int block) {
    static std::vector<int8_t> qs;
    static std::vector<float> d, s;
    static std::vector<int16_t> bsum;
    qs.resize(M * K);
    d.resize(M * (K / block));
    s.resize(M * (K / 32));
    bsum.resize(M * (K / 16));
    gguf::QActs a;
    a.block = block;
    a.K = K;
    a.qs = qs.data();
    a.d = d.data();
    a.s = s.data();
    a.bsum = bsum.data();
    if (M * K < (1 << 14)) {
        k.q->quantize(x, M, a);
    } else {
        const int64_t per = chunk_size(M, pool().threads(), 1);
        pool().run((M + per - 1) / per, [&](int64_t c) {
            const int64_t m0 = c * per, m1 = m0 + per < M ? m0 + per : M;
            gguf::QActs part = a;  // rows m0.. of a, as rows 0.. of part
            part.qs += m0 * K;
            part.d += m0 * (K / block);
            part.s += m0 * (K / 32);
            part.bsum += m0 * (K / 16);
            k.q->quantize(x + m0 * K, m1 - m0, part);
        });
    }
    if (block == 32 && k.q->gemm_unsigned && M >= k.q->gemm_rows) {  // for the VNNI GEMM: once per product
        static std::vector<uint8_t> qu;
        qu.resize(M * K);
        for (int64_t i = 0; i < M * K; ++i) qu[i] = static_cast<uint8_t>(qs[i]) ^ 0x80u;
        a.qu = qu.data();
    }
    return a;
}

bool uses_amx(const Kernels& k, int64_t M) { return k.linear_bf16p_amx && M >= g_amx_rows; }

// The bfloat16 activations of a product over bf16p weights with bf16 dot products: one buffer,
// reused by every call (as quantize_acts'), M rows of Kp values, and where AMX runs on more than
// 16 rows, zero rows up to a multiple of 16. `fill` writes rows [0, M) of it.
template <typename Fill>
const uint16_t* bf16_acts(const Kernels& k, int64_t M, int64_t Kp, Fill fill) {
    static std::vector<uint16_t> xb;
    const int64_t rows = uses_amx(k, M) && M > 16 ? (M + 15) / 16 * 16 : M;
    xb.resize(rows * Kp);
    fill(xb.data());
    std::memset(xb.data() + M * Kp, 0, sizeof(uint16_t) * (rows - M) * Kp);
    return xb.data();
}

// The product over bf16p weights, y as `out` says, over the pool by blocks of 16 output rows: with
// bf16 dot products on activations rounded to bf16 (xb: bf16_acts), else widening the weights
// against float32 activations x.
void linear_bf16p_parallel(const Kernels& k, const LinearW& l, const float* x, const uint16_t* xb, int64_t M,
                           const Out& out) {
    Pool& p = pool();
    const int64_t size = (M * l.N * l.K < (1 << 15)) ? l.N : chunk_size(l.N, p.threads(), bf16p::kRows);
    const auto* w = static_cast<const uint16_t*>(l.w);
    const int64_t Kp = bf16p::padded_depth(l.K);
    const auto dot = uses_amx(k, M) ? k.linear_bf16p_amx : k.linear_bf16p_dot;
    p.run((l.N + size - 1) / size, [&](int64_t c) {
        const int64_t n0 = c * size, n1 = n0 + size < l.N ? n0 + size : l.N;
        if (xb)
            dot(xb, M, Kp, w, l.bias, out, l.N, n0, n1);
        else
            k.linear_bf16p(x, M, l.K, w, l.bias, out, l.N, n0, n1);
    });
}

// rtpcore's int8 weights take the integer kernel (activations quantized to blocks of 32, as for
// q8_0; VNNI where the CPU has it) below this many rows when K is a multiple of 32, the float32
// kernel (weights widened in registers, activations float32) from it on: the float kernel's
// 4 x 4 register tiles reuse each weight load for four rows, the integer one pays a float
// conversion per block and row. Measured single-threaded (CPU time, Intel Xeon, AVX-512 VNNI,
// benchmarks/bench_gguf_kernels.py --dtype int8): 2816 x 1024 at 1 row 0.11-0.13 ms against
// 0.15, at 2 rows 0.13-0.15 against 0.16-0.17, at 4 rows 0.23-0.27 against 0.22.
constexpr int64_t kInt8QuantizedRows = 4;

// From the set's gemm_rows on (every vector set), the activations are quantized again: the GEMM
// over repacked int8 weights (_gguf_isa.hpp) is 2-3x the float kernel there with VNNI, 1.5-1.6x
// with AVX2's byte products (AVX2-only EPYC, 64 rows).
bool int8_quantized(const Kernels& k, const LinearW& l, int64_t M) {
    if (l.kind != WeightKind::i8 || l.K % 32 != 0) return false;
    return M < kInt8QuantizedRows || (k.q->gemm_rows > 0 && M >= k.q->gemm_rows);
}

// y (M, N) (+)= x (M, K) @ W.T (* scale) + bias over the pool, split by output rows. For a
// quantized GGUF weight the activations are quantized first (all M rows, once), to blocks of
// 32 or of 256 (the K types) as llama.cpp quantizes them; for an int8 weight at few rows, to
// blocks of 32 (int8_quantized).
void linear_parallel(const LinearW& l, const float* x, int64_t M, float* y, bool accumulate) {
    const Kernels& k = kernels();
    if (l.kind == WeightKind::bf16p) {
        Out out;
        out.f = y;
        out.ld = l.N;
        out.accumulate = accumulate;
        const uint16_t* xb = nullptr;
        if (k.linear_bf16p_dot) {
            const int64_t Kp = bf16p::padded_depth(l.K);
            xb = bf16_acts(k, M, Kp, [&](uint16_t* dst) { k.to_bf16(x, M, l.K, dst, Kp); });
        }
        linear_bf16p_parallel(k, l, x, xb, M, out);
        return;
    }
    Pool& p = pool();
    gguf::QActs acts;
    const bool quantized = is_gguf(l.kind) && gguf_type(l.kind) != gguf::Type::f16;
    const bool i8q = int8_quantized(k, l, M);
    if (quantized) acts = quantize_acts(k, x, M, l.K, gguf::info(gguf_type(l.kind)).block);
    if (i8q) acts = quantize_acts(k, x, M, l.K, 32);
    // Small products do not pay for waking the pool.
    const int64_t size = (M * l.N * l.K < (1 << 15)) ? l.N : chunk_size(l.N, p.threads(), 16);
    p.run((l.N + size - 1) / size, [&](int64_t c) {
        const int64_t n0 = c * size, n1 = n0 + size < l.N ? n0 + size : l.N;
        if (quantized) {
            k.qlinear[static_cast<int>(gguf_type(l.kind))](acts, M, static_cast<const uint8_t*>(l.w), l.bias, y, l.N,
                                                          accumulate, n0, n1);
            return;
        }
        switch (l.kind) {
            case WeightKind::i8:
                if (i8q)
                    k.q->linear_i8(acts, M, static_cast<const int8_t*>(l.w), l.scale, l.bias, y, l.N, accumulate, n0, n1);
                else
                    k.linear_i8(x, M, l.K, static_cast<const int8_t*>(l.w), l.scale, l.bias, y, l.N, accumulate, n0, n1);
                break;
            case WeightKind::bf16:
                k.linear_bf16(x, M, l.K, static_cast<const uint16_t*>(l.w), l.bias, y, l.N, accumulate, n0, n1);
                break;
            case WeightKind::f32:
                k.linear_f32(x, M, l.K, static_cast<const float*>(l.w), l.bias, y, l.N, accumulate, n0, n1);
                break;
            default:  // f16
                k.linear_f16(x, M, l.K, static_cast<const gguf::f16_t*>(l.w), l.bias, y, l.N, accumulate, n0, n1);
                break;
        }
    });
}

template <typename T>
T* as_ptr(uintptr_t p) {
    return reinterpret_cast<T*>(p);
}

WeightKind weight_kind(const std::string& dtype) {
    if (dtype == "float32") return WeightKind::f32;
    if (dtype == "int8") return WeightKind::i8;
    if (dtype == "bfloat16") return WeightKind::bf16;
    if (dtype == "bfloat16_packed") return WeightKind::bf16p;
    gguf::Type t;
    if (gguf::parse(dtype, t)) return gguf_kind(t);
    throw std::invalid_argument("weight dtype must be 'float32', 'int8', 'bfloat16', 'bfloat16_packed' or a GGUF type (" +
                                gguf::names() + "), got '" + dtype + "'");
}

// The GGUF kind named `dtype`; std::invalid_argument listing them otherwise.
WeightKind weight_kind_gguf(const std::string& dtype) {
    gguf::Type t;
    if (!gguf::parse(dtype, t))
        throw std::invalid_argument("GGUF dtype must be one of " + gguf::names() + ", got '" + dtype + "'");
    return gguf_kind(t);
}

std::string kind_name(WeightKind k) {
    if (is_gguf(k)) return gguf::info(gguf_type(k)).name;
    return k == WeightKind::i8     ? "int8"
           : k == WeightKind::bf16  ? "bfloat16"
           : k == WeightKind::bf16p ? "bfloat16_packed"
                                    : "float32";
}

LinearW make_linear(uintptr_t w, const std::string& dtype, uintptr_t scale, uintptr_t bias, int64_t N, int64_t K) {
    const WeightKind kind = weight_kind(dtype);
    if (!w) throw std::invalid_argument("linear weight pointer is null");
    if (N <= 0 || K <= 0) throw std::invalid_argument("linear shape must be positive, got (" + std::to_string(N) + ", " + std::to_string(K) + ")");
    if (kind == WeightKind::i8 && !scale) throw std::invalid_argument("an int8 linear needs its per-row scales");
    if (kind != WeightKind::i8 && scale) throw std::invalid_argument("only an int8 linear takes scales");
    if (is_gguf(kind)) gguf::row_bytes(gguf_type(kind), K);  // throws for a K that is no whole number of blocks
    LinearW l;
    l.w = as_ptr<const void>(w);
    l.kind = kind;
    l.scale = as_ptr<const float>(scale);
    l.bias = as_ptr<const float>(bias);
    l.N = N;
    l.K = K;
    return l;
}

// ---- paged attention of one-token rows (the decode step's and paged_decode_attention's)

// Checks what attending a context of `ctx` positions through `table` dereferences: it fits the
// table's `width` blocks and every block it reads lies in the pool of `slots` rows;
// std::out_of_range starting with name() otherwise.
template <typename Name>
void check_table(Name name, int64_t ctx, const int64_t* table, int64_t width, int64_t tpb, int64_t slots) {
    if (ctx < 1 || (ctx + tpb - 1) / tpb > width)
        throw std::out_of_range(name() + ": context length " + std::to_string(ctx) + " does not fit its block table of " +
                                std::to_string(width) + " blocks of " + std::to_string(tpb));
    for (int64_t j = 0; j < (ctx + tpb - 1) / tpb; ++j) {
        const int64_t blk = table[j];
        if (blk < 0 || (blk + 1) * tpb > slots)
            throw std::out_of_range(name() + ": block " + std::to_string(blk) + " outside the KV pools");
    }
}

// check_table for row b of a batch: the sequence's context length ctx[b], its table row b.
void check_context(int64_t b, const int64_t* ctx, const int64_t* tables, int64_t width, int64_t tpb, int64_t slots) {
    check_table([b] { return "sequence " + std::to_string(b); }, ctx[b], tables + b * width, width, tpb, slots);
}

// out row b (heads of D, row stride out_ld) = attention of q row b (stride q_ld) over its
// sequence's ctx[b] cached positions (the last `window` when window > 0), read in place from the
// pools; over the pool, one task per row with all its KV heads (attend_heads reads a position's
// rows of all of them at once), or one per (row, KV head) where whole rows would leave threads
// idle: fewer than two rows per thread, or a row holding more than a thread's share of the
// positions (a task runs on one thread). `longest`: the largest ctx[b].
void attend_rows(const Kernels& k, int64_t B, int64_t H, int64_t Hkv, int64_t D, const float* q, int64_t q_ld,
                 const void* k_pool, const void* v_pool, bool bf16, const int64_t* tables, int64_t width, int64_t tpb,
                 const int64_t* ctx, int64_t longest, int64_t window, float scale, float* out, int64_t out_ld) {
    const int64_t G = H / Hkv;
    const int64_t threads = pool().threads();
    int64_t total = 0;
    for (int64_t b = 0; b < B; ++b) total += ctx[b];
    const bool whole = B >= 2 * threads && longest * threads <= total;
    const int64_t per = whole ? Hkv : 1;  // KV heads per task
    const int64_t tasks_per_row = Hkv / per;
    pool().run(B * tasks_per_row, [&](int64_t task) {
        thread_local std::vector<float> scores;
        thread_local std::vector<const void*> rows;  // each position's key and value rows
        const int64_t b = task / tasks_per_row, h0 = task % tasks_per_row * per;
        const int64_t h1 = h0 + per < Hkv ? h0 + per : Hkv;
        const int64_t start = (window > 0 && ctx[b] > window) ? ctx[b] - window : 0;
        if (static_cast<int64_t>(scores.size()) < per * G * longest) scores.resize(per * G * longest);
        if (static_cast<int64_t>(rows.size()) < 2 * longest) rows.resize(2 * longest);
        k.attend[bf16](q + b * q_ld + h0 * G * D, G, D, k_pool, v_pool, h0, h1, Hkv, tables + b * width, tpb, start,
                       ctx[b], scale, scores.data(), rows.data(), out + b * out_ld + h0 * G * D);
    });
}

// out rows of each span s (rows starts[s] .. starts[s] + counts[s], heads of D, stride H D) =
// causal attention of its queries (q, same layout) over its sequence's cache: the span's new
// tokens sit at positions ctx[s] - counts[s] .. ctx[s] - 1 and their keys are in the pools
// already; table row rows[s] of `tables`. Over the pool, one task per (span, KV head, block of
// kSpanRows rows), the longest first.
void attend_spans(const Kernels& k, int64_t S, const int64_t* starts, const int64_t* counts, const int64_t* ctx,
                  const int64_t* rows, int64_t H, int64_t Hkv, int64_t D, const float* q, const void* k_pool,
                  const void* v_pool, bool bf16, const int64_t* tables, int64_t width, int64_t tpb, int64_t window,
                  float scale, float* out) {
    constexpr int64_t QB = isa_avx2::kSpanRows;
    const int64_t G = H / Hkv;
    struct Task {
        int64_t s, kvh, r0, n;
    };
    std::vector<Task> tasks;
    for (int64_t s = 0; s < S; ++s)
        for (int64_t r0 = 0; r0 < counts[s]; r0 += QB)
            for (int64_t kvh = 0; kvh < Hkv; ++kvh)
                tasks.push_back({s, kvh, r0, counts[s] - r0 < QB ? counts[s] - r0 : QB});
    // later blocks see more keys: claimed first, the short ones fill in behind them
    std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
        return ctx[a.s] - counts[a.s] + a.r0 > ctx[b.s] - counts[b.s] + b.r0;
    });
    // the largest of the sets' scratch: each set sizes its own blocks of keys and rows
    const int64_t scratch = std::max({isa_avx512::span_scratch(G, D), isa_avx2::span_scratch(G, D),
                                      isa_base::span_scratch(G, D)});
    pool().run(static_cast<int64_t>(tasks.size()), [&](int64_t i) {
        thread_local std::vector<float> buf;
        if (static_cast<int64_t>(buf.size()) < scratch) buf.resize(scratch);
        const Task& t = tasks[i];
        const int64_t row = starts[t.s] + t.r0;
        k.attend_span[bf16](q + row * H * D + t.kvh * G * D, H * D, t.n, G, D, k_pool, v_pool, t.kvh, Hkv,
                            tables + rows[t.s] * width, tpb, ctx[t.s] - counts[t.s] + t.r0, window, scale,
                            out + row * H * D + t.kvh * G * D, H * D, buf.data());
    });
}

// ---- the Llama-family decode step

struct Layer {
    const float* norm1 = nullptr;
    LinearW qkv, o;
    const float* norm2 = nullptr;
    LinearW gate_up, down;
    // set_layer_parts: q, k, v and gate, up as separate products (a GGUF file may store them in
    // different types), written into the fused layouts; qkv and gate_up are then unused.
    bool parts = false;
    LinearW q, k, v, gate, up;
    int64_t window = 0;  // 0: none
    // set_qk_norm (Qwen3): RMSNorm weights (D,) applied to each query and key head before RoPE.
    const float* q_norm = nullptr;
    const float* k_norm = nullptr;
    void* k_pool = nullptr;  // (slots, Hkv, D) float32 or bfloat16
    void* v_pool = nullptr;
    bool pool_bf16 = false;
    int64_t slots = 0;  // the pools' rows
};

class LlamaDecoder {
  public:
    LlamaDecoder(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
                 int64_t vocab, double eps, int64_t num_layers)
        : E_(hidden), H_(heads), Hkv_(kv_heads), D_(head_dim), I_(intermediate), V_(vocab),
          eps_(static_cast<float>(eps)), layers_(num_layers) {
        if (hidden <= 0 || heads <= 0 || kv_heads <= 0 || head_dim <= 0 || intermediate <= 0 || vocab <= 0 ||
            num_layers <= 0)
            throw std::invalid_argument("LlamaDecoder sizes must be positive");
        if (heads % kv_heads != 0)
            throw std::invalid_argument("heads (" + std::to_string(heads) + ") must be a multiple of kv_heads (" +
                                        std::to_string(kv_heads) + ")");
        if (head_dim % 2 != 0) throw std::invalid_argument("head_dim must be even for RoPE, got " + std::to_string(head_dim));
    }

    void set_layer(int64_t i, uintptr_t norm1, const LinearW& qkv, const LinearW& o, uintptr_t norm2,
                   const LinearW& gate_up, const LinearW& down, int64_t window) {
        Layer& l = at(i);
        expect(qkv, (H_ + 2 * Hkv_) * D_, E_, "qkv");
        expect(o, E_, H_ * D_, "o");
        expect(gate_up, 2 * I_, E_, "gate_up");
        expect(down, E_, I_, "down");
        l.norm1 = as_ptr<const float>(norm1);
        l.norm2 = as_ptr<const float>(norm2);
        l.qkv = qkv;
        l.o = o;
        l.gate_up = gate_up;
        l.down = down;
        l.window = window;
        l.parts = false;
    }

    // set_layer with the projections unfused: q (H D, E), k and v (Hkv D, E), gate and up (I, E).
    void set_layer_parts(int64_t i, uintptr_t norm1, const LinearW& q, const LinearW& k, const LinearW& v,
                         const LinearW& o, uintptr_t norm2, const LinearW& gate, const LinearW& up, const LinearW& down,
                         int64_t window) {
        Layer& l = at(i);
        expect(q, H_ * D_, E_, "q");
        expect(k, Hkv_ * D_, E_, "k");
        expect(v, Hkv_ * D_, E_, "v");
        expect(o, E_, H_ * D_, "o");
        expect(gate, I_, E_, "gate");
        expect(up, I_, E_, "up");
        expect(down, E_, I_, "down");
        l.norm1 = as_ptr<const float>(norm1);
        l.norm2 = as_ptr<const float>(norm2);
        l.q = q;
        l.k = k;
        l.v = v;
        l.o = o;
        l.gate = gate;
        l.up = up;
        l.down = down;
        l.window = window;
        l.parts = true;
    }

    // Per-head RMSNorm of the queries and keys before RoPE (Qwen3): q_norm, k_norm (D,) float32;
    // 0 for both switches it off again.
    void set_qk_norm(int64_t i, uintptr_t q_norm, uintptr_t k_norm) {
        if ((q_norm == 0) != (k_norm == 0)) throw std::invalid_argument("q_norm and k_norm are set together");
        Layer& l = at(i);
        l.q_norm = as_ptr<const float>(q_norm);
        l.k_norm = as_ptr<const float>(k_norm);
    }

    // The embedding (vocab_rows, E) is float32, bfloat16, bf16p (a tied head's blocks) or a GGUF
    // type (its rows dequantized as they are looked up).
    void set_head(uintptr_t embed, int64_t vocab_rows, const std::string& embed_dtype, uintptr_t norm,
                  const LinearW& head) {
        expect(head, V_, E_, "lm_head");
        if (embed_dtype == "float32" || embed_dtype == "bfloat16" || embed_dtype == "bfloat16_packed") {
            embed_kind_ = weight_kind(embed_dtype);
        } else {
            gguf::Type t;
            if (!gguf::parse(embed_dtype, t))
                throw std::invalid_argument("embedding dtype must be 'float32', 'bfloat16', 'bfloat16_packed' or a GGUF "
                                            "type (" + gguf::names() + "), got '" + embed_dtype + "'");
            embed_row_bytes_ = gguf::row_bytes(t, E_);
            embed_kind_ = gguf_kind(t);
        }
        vocab_rows_ = vocab_rows;
        embed_ = as_ptr<const void>(embed);
        norm_ = as_ptr<const float>(norm);
        head_ = head;
    }

    void set_pools(int64_t i, uintptr_t k, uintptr_t v, int64_t slots, const std::string& dtype) {
        if (slots <= 0) throw std::invalid_argument("a KV pool needs at least one slot");
        if (dtype != "float32" && dtype != "bfloat16")
            throw std::invalid_argument("KV pool dtype must be 'float32' or 'bfloat16', got '" + dtype + "'");
        Layer& l = at(i);
        l.k_pool = as_ptr<void>(k);
        l.v_pool = as_ptr<void>(v);
        l.pool_bf16 = dtype == "bfloat16";
        l.slots = slots;
    }

    // One decode step of B sequences (one new token each): ids, positions, slots (B,) int64;
    // tables (B, width) int64; ctx (B,) int64 context lengths after the step; cos/sin (P, D)
    // float32 tables covering every position; logits (B, V) out, float32 or (logits_bf16)
    // bfloat16 (rounded here: a bf16 model's caller then needs no conversion of its own).
    void decode(int64_t B, uintptr_t ids_p, uintptr_t pos_p, uintptr_t slots_p, uintptr_t tables_p, int64_t width,
                uintptr_t ctx_p, int64_t tpb, uintptr_t cos_p, uintptr_t sin_p, int64_t positions, uintptr_t logits_p,
                bool logits_bf16) {
        if (tpb <= 0 || width <= 0) throw std::invalid_argument("decode needs positive tokens_per_block and table width");
        if (B <= 0) throw std::invalid_argument("decode needs at least one sequence");
        for (const Layer& l : layers_)
            if (!l.norm1 || !l.k_pool) throw std::logic_error("LlamaDecoder: a layer's weights or pools are not set");
        if (!embed_) throw std::logic_error("LlamaDecoder: the head is not set");
        const Kernels& k = kernels();
        const auto* ids = as_ptr<const int64_t>(ids_p);
        const auto* pos = as_ptr<const int64_t>(pos_p);
        const auto* slots = as_ptr<const int64_t>(slots_p);
        const auto* tables = as_ptr<const int64_t>(tables_p);
        const auto* ctx = as_ptr<const int64_t>(ctx_p);
        const auto* cos = as_ptr<const float>(cos_p);
        const auto* sin = as_ptr<const float>(sin_p);
        const int64_t Q = H_ * D_, KV = Hkv_ * D_;
        // Every index this step dereferences, checked once (the torch modules would raise too).
        int64_t longest = 0, slots_n = layers_[0].slots;
        for (const Layer& l : layers_) slots_n = l.slots < slots_n ? l.slots : slots_n;
        for (int64_t b = 0; b < B; ++b) {
            auto row = [b] { return "sequence " + std::to_string(b); };  // built only for an error
            if (ids[b] < 0 || ids[b] >= vocab_rows_) throw std::out_of_range(row() + ": token id " + std::to_string(ids[b]) + " outside the embedding's " + std::to_string(vocab_rows_) + " rows");
            if (pos[b] < 0 || pos[b] >= positions) throw std::out_of_range(row() + ": position " + std::to_string(pos[b]) + " outside the RoPE table's " + std::to_string(positions) + " rows");
            if (slots[b] < 0 || slots[b] >= slots_n) throw std::out_of_range(row() + ": slot " + std::to_string(slots[b]) + " outside the KV pools' " + std::to_string(slots_n) + " slots");
            check_context(b, ctx, tables, width, tpb, slots_n);
            longest = ctx[b] > longest ? ctx[b] : longest;
        }
        x_.resize(B * E_);
        h_.resize(B * E_);
        qkv_.resize(B * (Q + 2 * KV));
        attn_.resize(B * Q);
        gu_.resize(B * 2 * I_);
        act_.resize(B * I_);
        for (int64_t b = 0; b < B; ++b) {
            if (is_gguf(embed_kind_)) {
                gguf::dequantize_row(gguf_type(embed_kind_), static_cast<const uint8_t*>(embed_) + ids[b] * embed_row_bytes_,
                                     E_, &x_[b * E_]);
            } else if (embed_kind_ == WeightKind::bf16) {
                const uint16_t* row = static_cast<const uint16_t*>(embed_) + ids[b] * E_;
                for (int64_t e = 0; e < E_; ++e) x_[b * E_ + e] = bf16_to_f32(row[e]);
            } else if (embed_kind_ == WeightKind::bf16p) {  // row n: every pair-row of its block, 2 values each
                const int64_t Kp = bf16p::padded_depth(E_);
                const uint16_t* row = static_cast<const uint16_t*>(embed_) + (ids[b] / bf16p::kRows) * Kp * bf16p::kRows +
                                      (ids[b] % bf16p::kRows) * 2;
                for (int64_t e = 0; e < E_; ++e) x_[b * E_ + e] = bf16_to_f32(row[(e / 2) * 32 + e % 2]);
            } else {
                std::memcpy(&x_[b * E_], static_cast<const float*>(embed_) + ids[b] * E_, sizeof(float) * E_);
            }
        }
        Pool& p = pool();
        for (Layer& l : layers_) {
            for (int64_t b = 0; b < B; ++b) k.rms_norm(&x_[b * E_], l.norm1, eps_, &h_[b * E_], E_);
            if (l.parts) {
                linear_into(l.q, B, Q + 2 * KV, 0);
                linear_into(l.k, B, Q + 2 * KV, Q);
                linear_into(l.v, B, Q + 2 * KV, Q + KV);
            } else {
                linear_parallel(l.qkv, h_.data(), B, qkv_.data(), false);
            }
            for (int64_t b = 0; b < B; ++b) {
                float* row = &qkv_[b * (Q + 2 * KV)];
                const float* c = cos + pos[b] * D_;
                const float* s = sin + pos[b] * D_;
                if (l.q_norm) {  // in place: rms_norm reads x[k] before writing out[k]
                    for (int64_t h = 0; h < H_; ++h) k.rms_norm(row + h * D_, l.q_norm, eps_, row + h * D_, D_);
                    for (int64_t h = 0; h < Hkv_; ++h)
                        k.rms_norm(row + Q + h * D_, l.k_norm, eps_, row + Q + h * D_, D_);
                }
                k.rope(row, H_ + Hkv_, D_, c, s);  // q and k are adjacent
                if (l.pool_bf16) {
                    uint16_t* kd = static_cast<uint16_t*>(l.k_pool) + slots[b] * KV;
                    uint16_t* vd = static_cast<uint16_t*>(l.v_pool) + slots[b] * KV;
                    for (int64_t e = 0; e < KV; ++e) {
                        kd[e] = f32_to_bf16(row[Q + e]);
                        vd[e] = f32_to_bf16(row[Q + KV + e]);
                    }
                } else {
                    std::memcpy(static_cast<float*>(l.k_pool) + slots[b] * KV, row + Q, sizeof(float) * KV);
                    std::memcpy(static_cast<float*>(l.v_pool) + slots[b] * KV, row + Q + KV, sizeof(float) * KV);
                }
            }
            attend_rows(k, B, H_, Hkv_, D_, qkv_.data(), Q + 2 * KV, l.k_pool, l.v_pool, l.pool_bf16, tables, width, tpb,
                        ctx, longest, l.window, scale(), attn_.data(), Q);
            linear_parallel(l.o, attn_.data(), B, x_.data(), true);
            for (int64_t b = 0; b < B; ++b) k.rms_norm(&x_[b * E_], l.norm2, eps_, &h_[b * E_], E_);
            if (l.parts) {
                linear_into(l.gate, B, 2 * I_, 0, gu_);
                linear_into(l.up, B, 2 * I_, I_, gu_);
            } else {
                linear_parallel(l.gate_up, h_.data(), B, gu_.data(), false);
            }
            for (int64_t b = 0; b < B; ++b) k.silu_mul(&gu_[b * 2 * I_], &gu_[b * 2 * I_ + I_], &act_[b * I_], I_);
            linear_parallel(l.down, act_.data(), B, x_.data(), true);
        }
        for (int64_t b = 0; b < B; ++b) k.rms_norm(&x_[b * E_], norm_, eps_, &h_[b * E_], E_);
        if (!logits_bf16) {
            linear_parallel(head_, h_.data(), B, as_ptr<float>(logits_p), false);
        } else if (head_.kind == WeightKind::bf16p) {  // rounded as the product stores them
            Out out;
            out.h = as_ptr<uint16_t>(logits_p);
            out.ld = head_.N;
            const uint16_t* xb = nullptr;
            if (k.linear_bf16p_dot) {
                const int64_t Kp = bf16p::padded_depth(E_);
                xb = bf16_acts(k, B, Kp, [&](uint16_t* dst) { k.to_bf16(h_.data(), B, E_, dst, Kp); });
            }
            linear_bf16p_parallel(k, head_, h_.data(), xb, B, out);
        } else {
            part_.resize(B * V_);
            linear_parallel(head_, h_.data(), B, part_.data(), false);
            auto* dst = as_ptr<uint16_t>(logits_p);
            const int64_t size = chunk_size(B * V_, p.threads(), 1024);
            p.run((B * V_ + size - 1) / size, [&](int64_t c) {
                const int64_t end = (c + 1) * size < B * V_ ? (c + 1) * size : B * V_;
                for (int64_t i = c * size; i < end; ++i) dst[i] = f32_to_bf16(part_[i]);
            });
        }
    }

  private:
    // Columns [col, col + l.N) of `dst` (B rows of `width`) = h_ @ l: the product of one unfused
    // projection, through a scratch buffer when rows are not contiguous there (B > 1).
    void linear_into(const LinearW& l, int64_t B, int64_t width, int64_t col, std::vector<float>& dst) {
        if (B == 1) {
            linear_parallel(l, h_.data(), 1, dst.data() + col, false);
            return;
        }
        part_.resize(B * l.N);
        linear_parallel(l, h_.data(), B, part_.data(), false);
        for (int64_t b = 0; b < B; ++b)
            std::memcpy(dst.data() + b * width + col, part_.data() + b * l.N, sizeof(float) * l.N);
    }
    void linear_into(const LinearW& l, int64_t B, int64_t width, int64_t col) { linear_into(l, B, width, col, qkv_); }

    Layer& at(int64_t i) {
        if (i < 0 || i >= static_cast<int64_t>(layers_.size()))
            throw std::out_of_range("layer " + std::to_string(i) + " of " + std::to_string(layers_.size()));
        return layers_[i];
    }
    static void expect(const LinearW& l, int64_t N, int64_t K, const char* what) {
        if (l.N != N || l.K != K)
            throw std::invalid_argument(std::string(what) + " must be (" + std::to_string(N) + ", " + std::to_string(K) +
                                        "), got (" + std::to_string(l.N) + ", " + std::to_string(l.K) + ")");
    }
    float scale() const { return 1.0f / std::sqrt(static_cast<float>(D_)); }

    const int64_t E_, H_, Hkv_, D_, I_, V_;
    const float eps_;
    std::vector<Layer> layers_;
    const void* embed_ = nullptr;
    WeightKind embed_kind_ = WeightKind::f32;
    int64_t embed_row_bytes_ = 0;  // GGUF embeddings
    int64_t vocab_rows_ = 0;
    const float* norm_ = nullptr;
    LinearW head_;
    std::vector<float> x_, h_, qkv_, attn_, gu_, act_, part_;
};

}  // namespace

PYBIND11_MODULE(_kernels, m) {
    m.doc() = "CPU decode kernels for float32 activations (rtpcore.models.native drives them)";

    m.def("gemm_rows", [] { return kernels().q->gemm_rows; },
          "From how many rows q8_0, q4_0, q5_0, q5_1 and int8 weights multiply as a GEMM over repacked weights with "
          "the byte dot products of VNNI, activations quantized per block of 32 (0: this kernel set has none).");
    m.attr("INT8_QUANTIZED_ROWS") = kInt8QuantizedRows;  // int8 weights: integer kernel below this many rows
    m.def("isa", [] { return std::string(kernels().name); }, "The instruction set the kernels run with.");
    m.def("default_isa", &default_isa, "The best supported kernel set at or below the caps (isa_cap); "
          "ValueError for a RTPCORE_CPU_ISA this CPU cannot run or that is unknown.");
    m.def("isa_cap", &isa_cap, "The highest kernel set RTPCORE_CPU_ISA and ONEDNN_MAX_CPU_ISA allow together.");
    m.def("kernel_sets", [] { return std::vector<std::string>(kLadder, kLadder + kLadderSize); },
          "Every kernel set's name, best first (those this build or CPU lacks included).");
    m.def("cpu_isas", [] {
        std::vector<std::tuple<std::string, std::string, std::string>> out;
        for (const CpuIsa& c : kCpuIsas) out.emplace_back(c.value, c.lowest, c.highest);
        return out;
    }, "The --cpu-isa values (RTPCORE_CPU_ISA) as (value, lowest set it needs, highest set it allows).");
    m.def("supported_cpu_isas", &supported_cpu_isas, "The --cpu-isa values this CPU (and OS) can run.");
    m.def("check_cpu_isa", [](const std::string& value, const std::string& what) {
        checked_cpu_isa(value, what.c_str());
    }, py::arg("value"), py::arg("what"), "ValueError, starting with `what`, unless this CPU can run the --cpu-isa "
       "value (it names what the CPU runs).");
    m.def("cpu_features", [] {
        const cpu::Features& f = cpu::features();
        py::dict d;
        d["avx"] = f.avx;
        d["avx2"] = f.avx2;
        d["fma"] = f.fma;
        d["f16c"] = f.f16c;
        d["avx512f"] = f.avx512f;
        d["avx512bw"] = f.avx512bw;
        d["avx512vl"] = f.avx512vl;
        d["avx512dq"] = f.avx512dq;
        d["avx512_vnni"] = f.avx512_vnni;
        d["avx_vnni"] = f.avx_vnni;
        d["avx512_bf16"] = f.avx512_bf16;
        d["avx512_fp16"] = f.avx512_fp16;
        d["amx_tile"] = f.amx_tile;
        d["amx_bf16"] = f.amx_bf16;
        d["amx_int8"] = f.amx_int8;
        d["os_avx"] = f.os_avx;
        d["os_avx512"] = f.os_avx512;
        d["os_amx"] = f.os_amx;
        d["amx_permitted"] = cpu::amx_permitted();
        return d;
    }, "CPUID flags, the register state the OS saves (XCR0: os_avx, os_avx512, os_amx) and whether this "
       "process holds AMX's tile-data permission now (amx_permitted; amx_probe asks for it). Runs no probe.");
    m.def("cpu_vendor", [] { return cpu::vendor(); },
          "CPUID's vendor string ('GenuineIntel', 'AuthenticAMD'; '' off x86-64).");
    m.def("amx_probe", [] {
        const cpu::Probe& p = cpu::amx_probe();
        return std::make_tuple(p.ok, p.reason);
    }, "(ok, reason): whether AMX runs here, probed once per process in a child process (see _cpu_features.hpp); "
       "after a good probe this process holds the tile permission.");
    m.def("supported_isas", [] {
        std::vector<std::string> out;
        for (const Kernels* k : kAll)
            if (supported(k->name)) out.emplace_back(k->name);
        return out;
    }, "The instruction sets this CPU (and OS) can run, best first.");
    m.def("set_isa", [](const std::string& isa) {
        const Kernels* k = by_name(isa);
        if (!supported(isa)) throw std::invalid_argument("this CPU cannot run the '" + isa + "' kernels");
        std::lock_guard<std::mutex> lock(g_call_mutex);
        g_kernels = k;
    }, py::arg("isa"), "Use the named instruction set's kernels (one of supported_isas()).");
    m.def("set_num_threads", [](int n) {
        if (n < 1) throw std::invalid_argument("threads must be >= 1, got " + std::to_string(n));
        std::lock_guard<std::mutex> lock(g_call_mutex);
        g_threads = n;
    }, py::arg("threads"));
    m.def("num_threads", [] { return g_threads; });
    m.def("pool_kind", [] { return std::string(use_openmp() ? "openmp" : "threads"); },
          "Where the kernels' parallel regions run: 'openmp' (torch's OpenMP threads, shared with its "
          "ops) or 'threads' (the extension's own: a build without OpenMP, RTPCORE_NATIVE_POOL=threads, "
          "or a child forked after the module loaded).");

    py::class_<LinearW>(m, "LinearWeights")
        .def(py::init(&make_linear), py::arg("weight"), py::arg("dtype"), py::arg("scale"), py::arg("bias"),
             py::arg("out_features"), py::arg("in_features"))
        .def_readonly("out_features", &LinearW::N)
        .def_readonly("in_features", &LinearW::K)
        .def_property_readonly("dtype", [](const LinearW& l) { return kind_name(l.kind); });

    m.def("linear", [](const LinearW& l, uintptr_t x, int64_t rows, uintptr_t y, bool accumulate) {
        if (rows <= 0) throw std::invalid_argument("linear needs at least one row, got " + std::to_string(rows));
        py::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(g_call_mutex);
        linear_parallel(l, as_ptr<const float>(x), rows, as_ptr<float>(y), accumulate);
    }, py::arg("weights"), py::arg("x"), py::arg("rows"), py::arg("y"), py::arg("accumulate") = false,
       "y (rows, N) (+)= x (rows, K) @ W.T (* scale) + bias, float32.");

    m.def("paged_decode_attention", [](uintptr_t q_p, int64_t B, int64_t H, int64_t Hkv, int64_t D, uintptr_t k_pool,
                                       uintptr_t v_pool, const std::string& dtype, int64_t slots, uintptr_t tables_p,
                                       int64_t width, int64_t tpb, uintptr_t ctx_p, int64_t window, double scale,
                                       uintptr_t out_p) {
        if (B <= 0 || H <= 0 || Hkv <= 0 || D <= 0 || H % Hkv != 0)
            throw std::invalid_argument("paged_decode_attention: bad shape (rows " + std::to_string(B) + ", heads " +
                                        std::to_string(H) + ", kv heads " + std::to_string(Hkv) + ", head dim " +
                                        std::to_string(D) + ")");
        if (dtype != "float32" && dtype != "bfloat16")
            throw std::invalid_argument("paged_decode_attention reads float32 and bfloat16 pools, got '" + dtype + "'");
        const auto* tables = as_ptr<const int64_t>(tables_p);
        const auto* ctx = as_ptr<const int64_t>(ctx_p);
        int64_t longest = 0;
        for (int64_t b = 0; b < B; ++b) {  // every index dereferenced, checked first
            check_context(b, ctx, tables, width, tpb, slots);
            longest = ctx[b] > longest ? ctx[b] : longest;
        }
        py::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(g_call_mutex);
        attend_rows(kernels(), B, H, Hkv, D, as_ptr<const float>(q_p), H * D, reinterpret_cast<const void*>(k_pool),
                    reinterpret_cast<const void*>(v_pool), dtype == "bfloat16", tables, width, tpb, ctx, longest, window,
                    static_cast<float>(scale), as_ptr<float>(out_p), H * D);
    }, py::arg("q"), py::arg("rows"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("k_pool"),
       py::arg("v_pool"), py::arg("dtype"), py::arg("slots"), py::arg("tables"), py::arg("width"),
       py::arg("tokens_per_block"), py::arg("context_lens"), py::arg("window"), py::arg("scale"), py::arg("out"),
       "out (rows, heads, head_dim) = attention of each row's one query (q, float32, same shape) over its "
       "sequence's context_lens[b] cached positions (the last `window` of them when window > 0), read in place "
       "from the paged pools (slot rows of kv_heads x head_dim, float32 or bfloat16) through tables "
       "(rows x width, int64).");

    // The element-wise work around a multi-token step's products (rtpcore.models.llama_modules's
    // fused path): the decode step's per-row kernels over many rows, split over the pool by rows.
    m.def("rms_norm_rows", [](uintptr_t x_p, int64_t rows, int64_t E, uintptr_t w_p, double eps, uintptr_t out_p) {
        if (rows <= 0 || E <= 0)
            throw std::invalid_argument("rms_norm_rows: rows and width must be positive, got (" + std::to_string(rows) +
                                        ", " + std::to_string(E) + ")");
        py::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(g_call_mutex);
        const Kernels& k = kernels();
        const auto* x = as_ptr<const float>(x_p);
        const auto* w = as_ptr<const float>(w_p);
        auto* out = as_ptr<float>(out_p);
        for_rows(rows, E, [&](int64_t r) { k.rms_norm(x + r * E, w, static_cast<float>(eps), out + r * E, E); });
    }, py::arg("x"), py::arg("rows"), py::arg("width"), py::arg("weight"), py::arg("eps"), py::arg("out"),
       "out (rows, width) = weight * x / sqrt(mean(x^2) + eps) per row, float32 (out may be x).");

    m.def("rope_rows", [](uintptr_t x_p, int64_t rows, int64_t row_stride, int64_t heads, int64_t D, uintptr_t cos_p,
                          uintptr_t sin_p, int64_t positions, uintptr_t pos_p) {
        if (rows <= 0 || heads <= 0 || D <= 0 || D % 2 != 0 || row_stride < heads * D)
            throw std::invalid_argument("rope_rows: bad shape (rows " + std::to_string(rows) + ", stride " +
                                        std::to_string(row_stride) + ", heads " + std::to_string(heads) +
                                        ", head dim " + std::to_string(D) + "; an even head dim, heads * head dim "
                                        "within the stride)");
        const auto* pos = as_ptr<const int64_t>(pos_p);
        for (int64_t r = 0; r < rows; ++r)
            if (pos[r] < 0 || pos[r] >= positions)
                throw std::out_of_range("rope_rows: row " + std::to_string(r) + ": position " + std::to_string(pos[r]) +
                                        " outside the RoPE table's " + std::to_string(positions) + " rows");
        py::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(g_call_mutex);
        const Kernels& k = kernels();
        auto* x = as_ptr<float>(x_p);
        const auto* cos = as_ptr<const float>(cos_p);
        const auto* sin = as_ptr<const float>(sin_p);
        for_rows(rows, heads * D, [&](int64_t r) { k.rope(x + r * row_stride, heads, D, cos + pos[r] * D, sin + pos[r] * D); });
    }, py::arg("x"), py::arg("rows"), py::arg("row_stride"), py::arg("heads"), py::arg("head_dim"), py::arg("cos"),
       py::arg("sin"), py::arg("positions"), py::arg("row_positions"),
       "Rotate-half RoPE in place of the first heads * head_dim values of each row of x (row_stride apart), with "
       "the rows of cos / sin (positions, head_dim) float32 that row_positions (rows,) int64 name.");

    m.def("silu_mul_rows", [](uintptr_t gu_p, int64_t rows, int64_t I, uintptr_t out_p) {
        if (rows <= 0 || I <= 0)
            throw std::invalid_argument("silu_mul_rows: rows and width must be positive, got (" + std::to_string(rows) +
                                        ", " + std::to_string(I) + ")");
        py::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(g_call_mutex);
        const Kernels& k = kernels();
        const auto* gu = as_ptr<const float>(gu_p);
        auto* out = as_ptr<float>(out_p);
        for_rows(rows, I, [&](int64_t r) { k.silu_mul(gu + r * 2 * I, gu + r * 2 * I + I, out + r * I, I); });
    }, py::arg("gate_up"), py::arg("rows"), py::arg("width"), py::arg("out"),
       "out (rows, width) = silu(gate) * up, gate and up the halves of each row of gate_up (rows, 2 width), float32.");

    m.def("paged_span_attention", [](uintptr_t q_p, int64_t T, int64_t H, int64_t Hkv, int64_t D, uintptr_t k_pool,
                                     uintptr_t v_pool, const std::string& dtype, int64_t slots, uintptr_t tables_p,
                                     int64_t table_rows, int64_t width, int64_t tpb, int64_t S, uintptr_t starts_p,
                                     uintptr_t counts_p, uintptr_t ctx_p, uintptr_t rows_p, int64_t window, double scale,
                                     uintptr_t out_p) {
        if (T <= 0 || S <= 0 || H <= 0 || Hkv <= 0 || D <= 0 || H % Hkv != 0 || tpb <= 0 || width <= 0)
            throw std::invalid_argument("paged_span_attention: bad shape (rows " + std::to_string(T) + ", spans " +
                                        std::to_string(S) + ", heads " + std::to_string(H) + ", kv heads " +
                                        std::to_string(Hkv) + ", head dim " + std::to_string(D) + ")");
        if (dtype != "float32" && dtype != "bfloat16")
            throw std::invalid_argument("paged_span_attention reads float32 and bfloat16 pools, got '" + dtype + "'");
        const auto* tables = as_ptr<const int64_t>(tables_p);
        const auto* starts = as_ptr<const int64_t>(starts_p);
        const auto* counts = as_ptr<const int64_t>(counts_p);
        const auto* ctx = as_ptr<const int64_t>(ctx_p);
        const auto* rows = as_ptr<const int64_t>(rows_p);
        for (int64_t s = 0; s < S; ++s) {  // every index dereferenced, checked first
            auto span = [s] { return "span " + std::to_string(s); };
            if (counts[s] < 1 || starts[s] < 0 || starts[s] + counts[s] > T)
                throw std::out_of_range(span() + ": rows " + std::to_string(starts[s]) + " + " + std::to_string(counts[s]) +
                                        " outside the " + std::to_string(T) + " rows of q");
            if (counts[s] > ctx[s])
                throw std::out_of_range(span() + ": " + std::to_string(counts[s]) + " new tokens in a context of " +
                                        std::to_string(ctx[s]));
            if (rows[s] < 0 || rows[s] >= table_rows)
                throw std::out_of_range(span() + ": table row " + std::to_string(rows[s]) + " outside the " +
                                        std::to_string(table_rows) + " rows of tables");
            check_table(span, ctx[s], tables + rows[s] * width, width, tpb, slots);
        }
        py::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(g_call_mutex);
        attend_spans(kernels(), S, starts, counts, ctx, rows, H, Hkv, D, as_ptr<const float>(q_p),
                     reinterpret_cast<const void*>(k_pool), reinterpret_cast<const void*>(v_pool), dtype == "bfloat16",
                     tables, width, tpb, window, static_cast<float>(scale), as_ptr<float>(out_p));
    }, py::arg("q"), py::arg("rows"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("k_pool"),
       py::arg("v_pool"), py::arg("dtype"), py::arg("slots"), py::arg("tables"), py::arg("table_rows"), py::arg("width"),
       py::arg("tokens_per_block"), py::arg("spans"), py::arg("starts"), py::arg("counts"), py::arg("context_lens"),
       py::arg("table_index"), py::arg("window"), py::arg("scale"), py::arg("out"),
       "out rows of each span (rows starts[s] .. starts[s] + counts[s] of q and out, (rows, heads, head_dim) "
       "float32) = causal attention of the span's new tokens (positions context_lens[s] - counts[s] onwards, their "
       "keys already in the pools) over their sequence's cache, read in place through row table_index[s] of tables "
       "(table_rows x width, int64); within the last `window` positions when window > 0.");

    m.def("linear_bf16", [](const LinearW& l, uintptr_t x, int64_t rows, uintptr_t y) {
        if (rows <= 0) throw std::invalid_argument("linear_bf16 needs at least one row, got " + std::to_string(rows));
        if (l.kind != WeightKind::bf16p)
            throw std::invalid_argument("linear_bf16 multiplies 'bfloat16_packed' weights, got '" + kind_name(l.kind) + "'");
        py::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(g_call_mutex);
        const Kernels& k = kernels();
        const auto* xs = as_ptr<const uint16_t>(x);
        Out out;
        out.h = as_ptr<uint16_t>(y);
        out.ld = l.N;
        const int64_t K = l.K, Kp = bf16p::padded_depth(K);
        if (k.linear_bf16p_dot) {
            const bool as_is = K == Kp && !(uses_amx(k, rows) && rows > 16 && rows % 16 != 0);
            const uint16_t* xb = as_is ? xs : bf16_acts(k, rows, Kp, [&](uint16_t* dst) {
                for (int64_t m = 0; m < rows; ++m) {
                    std::memcpy(dst + m * Kp, xs + m * K, sizeof(uint16_t) * K);
                    std::memset(dst + m * Kp + K, 0, sizeof(uint16_t) * (Kp - K));
                }
            });
            linear_bf16p_parallel(k, l, nullptr, xb, rows, out);
        } else {
            static std::vector<float> xf;
            xf.resize(rows * K);
            for (int64_t i = 0; i < rows * K; ++i) xf[i] = bf16_to_f32(xs[i]);
            linear_bf16p_parallel(k, l, xf.data(), nullptr, rows, out);
        }
    }, py::arg("weights"), py::arg("x"), py::arg("rows"), py::arg("y"),
       "y (rows, N) = x (rows, K) @ W.T + bias, bfloat16 in and out, W 'bfloat16_packed'.");
    m.def("bf16_kernel", [](int64_t rows) {
        const Kernels& k = kernels();
        if (!k.linear_bf16p_dot) return std::string("widened to float32");
        return std::string(uses_amx(k, rows) ? "amx tiles" : "vdpbf16ps");
    }, py::arg("rows"), "The kernel a product of `rows` rows over 'bfloat16_packed' weights runs now.");
    m.def("amx_rows", [] { return g_amx_rows; },
          "From how many rows on the amx set multiplies 'bfloat16_packed' weights with AMX tiles.");
    m.def("set_amx_rows", [](int64_t rows) {
        if (rows < 1) throw std::invalid_argument("amx rows must be >= 1, got " + std::to_string(rows));
        std::lock_guard<std::mutex> lock(g_call_mutex);
        g_amx_rows = rows;
    }, py::arg("rows"), "Run AMX tiles from `rows` rows on (the amx set; for measurements and tests).");
    m.def("bf16_dot", [] { return kernels().linear_bf16p_dot != nullptr; },
          "Whether the kernels in use multiply bf16 weights with bf16 dot products (avx512_bf16, amx).");

    m.def("gguf_dtypes", [] {
        std::vector<std::string> out;
        for (const gguf::TypeInfo& t : gguf::kTypes) out.emplace_back(t.name);
        return out;
    }, "The GGUF weight types LinearWeights and gguf_dequantize_rows take.");
    m.def("gguf_row_bytes", [](const std::string& dtype, int64_t K) {
        return gguf::row_bytes(gguf_type(weight_kind_gguf(dtype)), K);
    }, py::arg("dtype"), py::arg("K"), "Bytes of one row of K weights of a GGUF type; ValueError unless K is a "
       "positive multiple of its block size.");
    m.def("gguf_dequantize_rows", [](const std::string& dtype, uintptr_t weight, int64_t K, uintptr_t row_ids,
                                     int64_t n, uintptr_t out) {
        const gguf::Type t = gguf_type(weight_kind_gguf(dtype));
        const int64_t bytes = gguf::row_bytes(t, K);
        if (!weight || (n > 0 && (!row_ids || !out))) throw std::invalid_argument("gguf_dequantize_rows: null pointer");
        if (n < 0) throw std::invalid_argument("gguf_dequantize_rows: n must be >= 0, got " + std::to_string(n));
        const auto* ids = as_ptr<const int64_t>(row_ids);
        for (int64_t i = 0; i < n; ++i)
            if (ids[i] < 0) throw std::out_of_range("gguf_dequantize_rows: row id " + std::to_string(ids[i]) + " < 0");
        py::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(g_call_mutex);
        const Kernels& k = kernels();
        // Rows over the pool when there are many (a weight dequantized for torch's GEMM).
        const int64_t per = n * K < (1 << 16) ? (n > 0 ? n : 1) : chunk_size(n, pool().threads(), 1);
        pool().run((n + per - 1) / per, [&](int64_t c) {
            for (int64_t i = c * per; i < n && i < (c + 1) * per; ++i)
                k.q->dequantize(t, as_ptr<const uint8_t>(weight) + ids[i] * bytes, K, as_ptr<float>(out) + i * K);
        });
    }, py::arg("dtype"), py::arg("weight"), py::arg("K"), py::arg("row_ids"), py::arg("n"), py::arg("out"),
       "out (n, K) float32 = the rows row_ids (n,) int64 of the GGUF matrix at weight (the embedding lookup of a "
       "quantized token_embd; the caller keeps ids below its row count).");

    py::class_<LlamaDecoder>(m, "LlamaDecoder")
        .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t>(), py::arg("hidden"),
             py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"), py::arg("vocab"),
             py::arg("eps"), py::arg("num_layers"))
        .def("set_layer", &LlamaDecoder::set_layer, py::arg("index"), py::arg("norm1"), py::arg("qkv"), py::arg("o"),
             py::arg("norm2"), py::arg("gate_up"), py::arg("down"), py::arg("window"))
        .def("set_layer_parts", &LlamaDecoder::set_layer_parts, py::arg("index"), py::arg("norm1"), py::arg("q"),
             py::arg("k"), py::arg("v"), py::arg("o"), py::arg("norm2"), py::arg("gate"), py::arg("up"),
             py::arg("down"), py::arg("window"))
        .def("set_qk_norm", &LlamaDecoder::set_qk_norm, py::arg("index"), py::arg("q_norm"), py::arg("k_norm"))
        .def("set_head", &LlamaDecoder::set_head, py::arg("embed"), py::arg("vocab_rows"), py::arg("embed_dtype"),
             py::arg("norm"), py::arg("head"))
        .def("set_pools", &LlamaDecoder::set_pools, py::arg("index"), py::arg("k"), py::arg("v"), py::arg("slots"),
             py::arg("dtype"))
        .def("decode", [](LlamaDecoder& d, int64_t B, uintptr_t ids, uintptr_t pos, uintptr_t slots, uintptr_t tables,
                          int64_t width, uintptr_t ctx, int64_t tpb, uintptr_t cos, uintptr_t sin, int64_t positions,
                          uintptr_t logits, const std::string& logits_dtype) {
            if (logits_dtype != "float32" && logits_dtype != "bfloat16")
                throw std::invalid_argument("logits dtype must be 'float32' or 'bfloat16', got '" + logits_dtype + "'");
            py::gil_scoped_release release;
            std::lock_guard<std::mutex> lock(g_call_mutex);
            d.decode(B, ids, pos, slots, tables, width, ctx, tpb, cos, sin, positions, logits,
                     logits_dtype == "bfloat16");
        }, py::arg("batch"), py::arg("ids"), py::arg("positions"), py::arg("slots"), py::arg("tables"),
           py::arg("width"), py::arg("context_lens"), py::arg("tokens_per_block"), py::arg("cos"), py::arg("sin"),
           py::arg("rope_positions"), py::arg("logits"), py::arg("logits_dtype") = "float32",
           "One decode step (see LlamaDecoder::decode); IndexError for an index outside its table.");
}
