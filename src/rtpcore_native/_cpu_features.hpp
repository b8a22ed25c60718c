// What this CPU offers and the OS permits, for the kernel choice of _kernels.cpp.
//
// Features come from CPUID (leaf 1, leaf 7 subleaves 0 and 1) and, for the register state the
// OS saves, from XCR0 (XGETBV): AVX needs the YMM state enabled, AVX-512 the opmask and ZMM
// states, AMX the tile states. An instruction whose state the OS does not save faults, so a
// CPU flag alone never makes a kernel set usable.
//
// AMX needs more: Linux (5.16+) hands a process the large tile-data state only after it asks
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), and a tile instruction before that
// raises SIGILL ("invalid opcode"). llama.cpp's AMX kernels were seen trapping so at
// tileloadd on a VM whose processes that had asked ran tiles fine. So AMX is used only after a
// probe that runs the instructions for real in a child process (fork): the child asks for the
// permission, loads a tile configuration, runs tileloadd, tdpbf16ps and tdpbssd on small
// buffers, checks the products against scalar ones and _exits; the parent reads the verdict
// from a pipe and the child's status from waitpid. A signal, a wrong product or a refused
// permission in the child is a fallback (its reason kept), never a crash of the caller. After
// a good probe the parent asks for the permission itself (a process-wide grant, inherited by
// its threads and by children it forks). The child runs only async-signal-safe code (system
// calls, stack buffers; no core file), so forking a threaded process is safe here.
//
// RTPCORE_AMX_PROBE_FAIL (a test hook): "sigill" makes the child execute ud2, "wrong" makes
// it corrupt a product, so a test can see the fallback of a real failed probe on a CPU with AMX.
#pragma once

#include <string>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

#include <cstdint>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <errno.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#endif

namespace cpu {

struct Probe {
    bool ok = false;
    std::string reason;
};

struct Features {
    // CPUID
    bool avx = false, avx2 = false, fma = false, f16c = false;
    bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
    bool avx512_vnni = false, avx_vnni = false, avx512_bf16 = false, avx512_fp16 = false;
    bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
    // XCR0: the register state the OS saves (YMM; opmask + ZMM; tile config + tile data)
    bool os_avx = false, os_avx512 = false, os_amx = false;
};

#if defined(__x86_64__) || defined(__i386__)

inline Features detect() {
    Features f;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
    const bool osxsave = c & (1u << 27);
    f.fma = c & (1u << 12);
    f.avx = c & (1u << 28);
    f.f16c = c & (1u << 29);
    uint64_t xcr0 = 0;
    if (osxsave) {
        unsigned lo = 0, hi = 0;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
    }
    f.os_avx = (xcr0 & 0x6) == 0x6;                  // SSE and AVX (YMM) state
    f.os_avx512 = f.os_avx && (xcr0 & 0xe0) == 0xe0;  // opmask, ZMM_Hi256, Hi16_ZMM
    f.os_amx = (xcr0 & 0x60000) == 0x60000;           // XTILECFG, XTILEDATA
    if (__get_cpuid_max(0, nullptr) >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        f.avx2 = b & (1u << 5);
        f.avx512f = b & (1u << 16);
        f.avx512dq = b & (1u << 17);
        f.avx512bw = b & (1u << 30);
        f.avx512vl = b & (1u << 31);
        f.avx512_vnni = c & (1u << 11);
        f.amx_bf16 = d & (1u << 22);
        f.avx512_fp16 = d & (1u << 23);
        f.amx_tile = d & (1u << 24);
        f.amx_int8 = d & (1u << 25);
        const unsigned subleaves = a;
        if (subleaves >= 1) {
            __cpuid_count(7, 1, a, b, c, d);
            f.avx_vnni = a & (1u << 4);
            f.avx512_bf16 = a & (1u << 5);
        }
    }
    return f;
}

// CPUID leaf 0's vendor string ("GenuineIntel", "AuthenticAMD", ...).
inline std::string vendor() {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return "";
    char v[13] = {};
    std::memcpy(v, &b, 4);
    std::memcpy(v + 4, &d, 4);
    std::memcpy(v + 8, &c, 4);
    return v;
}

#else

inline Features detect() { return {}; }
inline std::string vendor() { return ""; }

#endif

#if defined(__x86_64__) && defined(__linux__)

constexpr long kArchGetXcompPerm = 0x1022;
constexpr long kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

// Whether this process holds the tile-data permission now.
inline bool amx_permitted() {
    unsigned long mask = 0;
    if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &mask) != 0) return false;
    return mask & (1ul << kXfeatureXtiledata);
}

// 0, or the errno of a refused request.
inline int request_amx() {
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return errno;
    return amx_permitted() ? 0 : EPERM;
}

// The child's verdicts (one byte on the pipe, and its exit status).
enum ProbeCode : unsigned char { kProbeOk = 0, kProbeNoPermission = 2, kProbeWrong = 3 };

struct alignas(64) TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,amx-int8")
// Runs in the child only: tiles of 16 rows x 64 bytes. tmm0 = A (bf16 16 x 32 or int8 16 x 64),
// tmm1 = B (its rows: pairs / quads of K interleaved per column), tmm2 = C (float32 / int32 16 x 16).
// Small integers throughout, so every product and sum is exact in both types.
__attribute__((noinline)) inline unsigned char run_tiles(int fail) {
    TileConfig cfg;
    for (int t = 0; t < 3; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
    alignas(64) uint16_t a16[16 * 32], b16[16 * 32];
    alignas(64) float c32[16 * 16];
    const uint16_t bf16_int[4] = {0x3f80, 0x4000, 0x4040, 0xbf80};  // bf16 1, 2, 3, -1, chosen by position
    auto av = [](int m, int k) { return (m + 3 * k) % 4; };
    auto bv = [](int k, int n) { return (2 * k + n) % 4; };
    const float val[4] = {1, 2, 3, -1};
    for (int m = 0; m < 16; ++m)
        for (int k = 0; k < 32; ++k) a16[m * 32 + k] = bf16_int[av(m, k)];
    for (int k = 0; k < 32; ++k)  // B row k/2 holds (k, n) at column 2n + k%2
        for (int n = 0; n < 16; ++n) b16[(k / 2) * 32 + 2 * n + (k % 2)] = bf16_int[bv(k, n)];
    for (int i = 0; i < 16 * 16; ++i) c32[i] = 0.5f;
    _tile_loadd(0, a16, 64);
    _tile_loadd(1, b16, 64);
    _tile_loadd(2, c32, 64);
    _tile_dpbf16ps(2, 0, 1);
    _tile_stored(2, c32, 64);
    if (fail == 1) __builtin_trap();  // ud2: SIGILL, as a CPU or hypervisor refusing the tiles would
    if (fail == 2) c32[5] += 1.0f;
    for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 16; ++n) {
            float want = 0.5f;
            for (int k = 0; k < 32; ++k) want += val[av(m, k)] * val[bv(k, n)];
            if (c32[m * 16 + n] != want) {
                _tile_release();
                return kProbeWrong;
            }
        }
    alignas(64) int8_t a8[16 * 64], b8[16 * 64];
    alignas(64) int32_t c8[16 * 16];
    auto ai = [](int m, int k) { return static_cast<int8_t>((m * 7 + k * 3) % 11 - 5); };
    auto bi = [](int k, int n) { return static_cast<int8_t>((k * 5 + n * 9) % 13 - 6); };
    for (int m = 0; m < 16; ++m)
        for (int k = 0; k < 64; ++k) a8[m * 64 + k] = ai(m, k);
    for (int k = 0; k < 64; ++k)  // B row k/4 holds (k, n) at column 4n + k%4
        for (int n = 0; n < 16; ++n) b8[(k / 4) * 64 + 4 * n + (k % 4)] = bi(k, n);
    for (int i = 0; i < 16 * 16; ++i) c8[i] = 7;
    _tile_loadd(0, a8, 64);
    _tile_loadd(1, b8, 64);
    _tile_loadd(2, c8, 64);
    _tile_dpbssd(2, 0, 1);
    _tile_stored(2, c8, 64);
    _tile_release();
    for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 16; ++n) {
            int32_t want = 7;
            for (int k = 0; k < 64; ++k) want += ai(m, k) * bi(k, n);
            if (c8[m * 16 + n] != want) return kProbeWrong;
        }
    return kProbeOk;
}
#pragma GCC pop_options

inline std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

// The probe itself (uncached): see the header comment.
inline Probe probe_amx(const Features& f) {
    if (!f.amx_tile || !f.amx_bf16 || !f.amx_int8) {
        std::string missing;
        for (auto [flag, name] : {std::pair<bool, const char*>{f.amx_tile, "amx_tile"}, {f.amx_bf16, "amx_bf16"},
                                  {f.amx_int8, "amx_int8"}})
            if (!flag) missing += std::string(missing.empty() ? "" : ", ") + name;
        return {false, "no CPU flag: the CPU reports no " + missing};
    }
    if (!f.os_amx) return {false, "no OS permission: the OS does not enable the tile state (XCR0 bits 17-18)"};
    int fail = 0;
    if (const char* hook = std::getenv("RTPCORE_AMX_PROBE_FAIL")) {
        if (std::strcmp(hook, "sigill") == 0) fail = 1;
        else if (std::strcmp(hook, "wrong") == 0) fail = 2;
    }
    int fds[2];
    if (pipe(fds) != 0) return {false, "probe not run: pipe() failed: " + errno_text(errno)};
    const pid_t pid = fork();
    if (pid < 0) {
        const int err = errno;
        close(fds[0]);
        close(fds[1]);
        return {false, "probe not run: fork() failed: " + errno_text(err)};
    }
    if (pid == 0) {  // the child: system calls and stack buffers only, then _exit
        close(fds[0]);
        const struct rlimit no_core = {0, 0};  // a trap here leaves no core file behind
        setrlimit(RLIMIT_CORE, &no_core);
        unsigned char code = kProbeNoPermission;
        if (request_amx() == 0) code = run_tiles(fail);
        ssize_t unused = write(fds[1], &code, 1);
        (void)unused;
        _exit(code);
    }
    close(fds[1]);
    unsigned char code = 255;
    ssize_t got;
    do {
        got = read(fds[0], &code, 1);
    } while (got < 0 && errno == EINTR);
    close(fds[0]);
    int status = 0;
    pid_t waited;
    do {
        waited = waitpid(pid, &status, 0);
    } while (waited < 0 && errno == EINTR);
    if (waited == pid && WIFSIGNALED(status)) {
        const int sig = WTERMSIG(status);
        const char* name = sig == SIGILL ? "SIGILL" : sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : nullptr;
        return {false, std::string("probe killed by ") + (name ? name : "signal " + std::to_string(sig)) +
                           " (the tile instructions trap in this process)"};
    }
    if (got != 1) return {false, "probe failed: the child process ended without a verdict"};
    if (code == kProbeNoPermission)
        return {false, "no OS permission: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) refused in the "
                       "probe (Linux 5.16 or later grants it)"};
    if (code == kProbeWrong) return {false, "wrong result: tdpbf16ps / tdpbssd products differ from scalar ones"};
    if (code != kProbeOk) return {false, "probe failed with code " + std::to_string(code)};
    const int err = request_amx();  // the parent's own permission, for its kernels
    if (err != 0)
        return {false, "no OS permission: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) refused: " +
                           errno_text(err)};
    return {true, "ok: tile permission granted, tileloadd / tdpbf16ps / tdpbssd checked in a child process"};
}

#else  // not x86-64 Linux

inline bool amx_permitted() { return false; }
#if defined(__x86_64__)
inline Probe probe_amx(const Features&) { return {false, "no OS permission: rtpcore asks for AMX's tiles on Linux only"}; }
#else
inline Probe probe_amx(const Features&) { return {false, "not x86-64"}; }
#endif

#endif

inline const Features& features() {
    static const Features f = detect();
    return f;
}

// The probe's verdict, run once per process (a child forked later inherits both the verdict
// and the permission).
inline const Probe& amx_probe() {
    static const Probe p = probe_amx(features());
    return p;
}

}  // namespace cpu
