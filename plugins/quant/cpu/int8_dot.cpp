// int8 activations times int4 or int8 weights on x86 CPUs, accumulated in int32: each row
// of activations is quantized in blocks of 32 (one float scale a block), each block's 32
// products summed exactly by the CPU's integer dot-product instructions (AVX2's vpmaddubsw
// and vpmaddwd, or VNNI's vpdpbusd on AVX-512 VNNI and AVX-VNNI), then scaled in float32.
//
// The instruction set is chosen once, by CPUID, among the variants this file compiles
// (each in its own `#pragma GCC target` region, so one build runs on any x86-64 CPU and
// uses what it finds). Without AVX2 `isa()` is "" and the Python side keeps torch's path.
//
// Ops (torch.ops.tessellm_cpu.*), float32 activations x [M, K], K a multiple of 32, in
// `digits` int8 digits a value (1: llama.cpp's Q8 activations; 2: a second int8 digit for
// the first's rounding, about 15 bits, twice the integer products):
//   int4_matmul(x, packed uint8 [N, K/2], scale [N, G], offset [N, G], group, digits) -> [M, N]
//   int8_matmul(x, qw int8 [N, K], scale [N, G], digits) -> [M, N]
//   quantize_rows(x, deinterleave, digits) -> (q1, q2 int8 [M, K], d [M, K/32], sums [M, K/32])
//   isa() -> the instruction set the kernels run ("avx512-vnni", "avx-vnni", "avx2" or "")
//
// Built as a plain shared library (no Python module): loading it registers the ops.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include <cstdint>
#include <cstdlib>
#include <string>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TESSELLM_X86 1
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define DOT_U8S8(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1))
#define DOT2_U8S8(u1, s1, u2, s2) \
    _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16((u1), (s1)), _mm256_maddubs_epi16((u2), (s2))), \
                      _mm256_set1_epi16(1))
#include "int8_dot_body.h"
#undef DOT_U8S8
#undef DOT2_U8S8
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace avx_vnni {
#define DOT_U8S8(u, s) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (u), (s))
#define DOT2_U8S8(u1, s1, u2, s2) _mm256_dpbusd_avx_epi32(DOT_U8S8(u1, s1), (u2), (s2))
#include "int8_dot_body.h"
#undef DOT_U8S8
#undef DOT2_U8S8
}  // namespace avx_vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
namespace avx512_vnni {
#define DOT_U8S8(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (s))
#define DOT2_U8S8(u1, s1, u2, s2) _mm256_dpbusd_epi32(DOT_U8S8(u1, s1), (u2), (s2))
#include "int8_dot_body.h"
#undef DOT_U8S8
#undef DOT2_U8S8
}  // namespace avx512_vnni
#pragma GCC pop_options
#endif

namespace {

enum class Isa { none, avx2, avx_vnni, avx512_vnni };

// The most capable variant allowed: TESSELLM_CPU_ISA ("avx2" or "avx-vnni") caps the choice,
// so a CPU with VNNI can run (and tests can compare) the variants below its own; unset or
// anything else allows all. Python (build.py) refuses values other than these names.
Isa cap() {
    const char* value = std::getenv("TESSELLM_CPU_ISA");
    const std::string name = value ? value : "";
    if (name == "avx2") return Isa::avx2;
    if (name == "avx-vnni") return Isa::avx_vnni;
    return Isa::avx512_vnni;
}

Isa detect() {
#ifdef TESSELLM_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return Isa::none;
    const Isa limit = cap();
    if (limit >= Isa::avx512_vnni && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw"))
        return Isa::avx512_vnni;
    if (limit >= Isa::avx_vnni && __builtin_cpu_supports("avxvnni")) return Isa::avx_vnni;
    return Isa::avx2;
#else
    return Isa::none;
#endif
}

Isa chosen() {
    static const Isa isa = detect();
    return isa;
}

std::string isa_name() {
    switch (chosen()) {
        case Isa::avx512_vnni: return "avx512-vnni";
        case Isa::avx_vnni: return "avx-vnni";
        case Isa::avx2: return "avx2";
        default: return "";
    }
}

void check_rows(const at::Tensor& x) {
    TORCH_CHECK(chosen() != Isa::none, "tessellm_cpu: this CPU has no AVX2 and FMA");
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
                "tessellm_cpu: x must be a 2-D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
    TORCH_CHECK(x.size(1) % 32 == 0, "tessellm_cpu: in_features ", x.size(1), " is not a multiple of 32");
}

#ifdef TESSELLM_X86
#define TESSELLM_DISPATCH(call)                               \
    switch (chosen()) {                                       \
        case Isa::avx512_vnni: avx512_vnni::call; break;      \
        case Isa::avx_vnni: avx_vnni::call; break;            \
        default: avx2::call; break;                           \
    }
#else
#define TESSELLM_DISPATCH(call) TORCH_CHECK(false, "tessellm_cpu: not an x86-64 build")
#endif

// Every row of x (float32 [M, K], contiguous) quantized: its int8 digits q1 (and q2 with
// `digits` 2; else q2 is q1) [M, K], and per block d, sums, rest [M, K/32].
struct Quantized {
    at::Tensor q1, q2, d, sums, rest;
};

Quantized quantize_all(const at::Tensor& x, bool deinterleave, int64_t digits) {
    TORCH_CHECK(digits == 1 || digits == 2, "tessellm_cpu: digits must be 1 or 2, got ", digits);
    const int64_t m = x.size(0), k = x.size(1), blocks = k / 32;
    at::Tensor q1 = at::empty({m, k}, x.options().dtype(at::kChar));
    Quantized out{q1, digits == 2 ? at::empty({m, k}, x.options().dtype(at::kChar)) : q1,
                  at::empty({m, blocks}, x.options()), at::empty({m, blocks}, x.options()),
                  at::empty({m, blocks}, x.options())};
    const float* xp = x.data_ptr<float>();
    int8_t* q1p = out.q1.data_ptr<int8_t>();
    int8_t* q2p = out.q2.data_ptr<int8_t>();
    float* dp = out.d.data_ptr<float>();
    float* sp = out.sums.data_ptr<float>();
    float* rp = out.rest.data_ptr<float>();
    const int d = static_cast<int>(digits);
    for (int64_t i = 0; i < m; ++i) {
        const int64_t base = i * blocks;
        TESSELLM_DISPATCH(quantize_row(xp + i * k, k, deinterleave, d, q1p + i * k, q2p + i * k, dp + base, sp + base,
                                       rp + base))
    }
    return out;
}

// Output rows in chunks of at least `grain` channels, spread over torch's threads.
int64_t grain_for(int64_t n) {
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    return std::max<int64_t>(16, n / (4 * threads));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x_in, bool deinterleave,
                                                                       int64_t digits) {
    check_rows(x_in);
    Quantized out = quantize_all(x_in.contiguous(), deinterleave, digits);
    return {out.q1, out.q2, out.d, out.sums};
}

at::Tensor int4_matmul(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& offset, int64_t group, int64_t digits) {
    check_rows(x_in);
    const at::Tensor x = x_in.contiguous();
    const int64_t m = x.size(0), k = x.size(1), n = packed.size(0), groups = scale.size(1);
    TORCH_CHECK(group % 32 == 0 && packed.size(1) * 2 == k && packed.scalar_type() == at::kByte &&
                    packed.is_contiguous() && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                    offset.scalar_type() == at::kFloat && offset.is_contiguous() && scale.size(0) == n &&
                    offset.sizes() == scale.sizes() && groups == (k + group - 1) / group,
                "tessellm_cpu.int4_matmul: packed [N, K/2] uint8, scale and offset [N, ceil(K/group)] float32 "
                "with group a multiple of 32; got K ", k, ", packed ", packed.sizes(), ", scale ", scale.sizes(),
                ", group ", group);
    const Quantized a = quantize_all(x, /*deinterleave=*/true, digits);
    // per weight group: the activations' sum (times the offsets) and 8 x what the int8
    // blocks lose of it (times the scales: the nibbles centred on 8)
    at::Tensor group_sums = at::zeros({m, groups}, x.options());
    at::Tensor group_rests = at::zeros({m, groups}, x.options());
    const float* sp = a.sums.data_ptr<float>();
    const float* rp = a.rest.data_ptr<float>();
    float* gp = group_sums.data_ptr<float>();
    float* grp = group_rests.data_ptr<float>();
    const int64_t blocks = k / 32, per_group = group / 32;
    std::vector<int32_t> group_of(blocks);  // each block's weight group
    for (int64_t b = 0; b < blocks; ++b) group_of[b] = static_cast<int32_t>(b / per_group);
    for (int64_t i = 0; i < m; ++i) {
        for (int64_t b = 0; b < blocks; ++b) {
            gp[i * groups + group_of[b]] += sp[i * blocks + b];
            grp[i * groups + group_of[b]] += 8.0f * rp[i * blocks + b];
        }
    }
    at::Tensor y = at::empty({m, n}, x.options());
    const int8_t* q1p = a.q1.data_ptr<int8_t>();
    const int8_t* q2p = a.q2.data_ptr<int8_t>();
    const float* dp = a.d.data_ptr<float>();
    const uint8_t* wp = packed.data_ptr<uint8_t>();
    const float* scp = scale.data_ptr<float>();
    const float* op = offset.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int32_t* gop = group_of.data();
    at::parallel_for(0, n, grain_for(n), [&](int64_t begin, int64_t end) {
        if (digits == 1) {
            TESSELLM_DISPATCH(int4_rows<1>(q1p, q2p, dp, gp, grp, m, k, wp, scp, op, groups, gop, begin, end, n, yp))
        } else {
            TESSELLM_DISPATCH(int4_rows<2>(q1p, q2p, dp, gp, grp, m, k, wp, scp, op, groups, gop, begin, end, n, yp))
        }
    });
    return y;
}

at::Tensor int8_matmul(const at::Tensor& x_in, const at::Tensor& qw, const at::Tensor& scale_in, int64_t digits) {
    check_rows(x_in);
    const at::Tensor x = x_in.contiguous();
    const at::Tensor scale = scale_in.dim() == 1 ? scale_in.unsqueeze(1).contiguous() : scale_in.contiguous();
    const int64_t m = x.size(0), k = x.size(1), n = qw.size(0), groups = scale.size(1);
    TORCH_CHECK(qw.scalar_type() == at::kChar && qw.is_contiguous() && qw.size(1) == k &&
                    scale.scalar_type() == at::kFloat && scale.size(0) == n && (k / 32) % groups == 0,
                "tessellm_cpu.int8_matmul: qw [N, K] int8, scale [N] or [N, G] float32 with K / G a multiple "
                "of 32; got K ", k, ", qw ", qw.sizes(), ", scale ", scale_in.sizes());
    const Quantized a = quantize_all(x, /*deinterleave=*/false, digits);
    at::Tensor y = at::empty({m, n}, x.options());
    const int8_t* q1p = a.q1.data_ptr<int8_t>();
    const int8_t* q2p = a.q2.data_ptr<int8_t>();
    const float* dp = a.d.data_ptr<float>();
    const int8_t* wp = qw.data_ptr<int8_t>();
    const float* scp = scale.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, n, grain_for(n), [&](int64_t begin, int64_t end) {
        if (digits == 1) {
            TESSELLM_DISPATCH(int8_rows<1>(q1p, q2p, dp, m, k, wp, scp, groups, begin, end, n, yp))
        } else {
            TESSELLM_DISPATCH(int8_rows<2>(q1p, q2p, dp, m, k, wp, scp, groups, begin, end, n, yp))
        }
    });
    return y;
}

}  // namespace

TORCH_LIBRARY(tessellm_cpu, m) {
    m.def("int4_matmul(Tensor x, Tensor packed, Tensor scale, Tensor offset, int group, int digits) -> Tensor");
    m.def("int8_matmul(Tensor x, Tensor qw, Tensor scale, int digits) -> Tensor");
    m.def("quantize_rows(Tensor x, bool deinterleave, int digits) -> (Tensor, Tensor, Tensor, Tensor)");
    m.def("isa() -> str", &isa_name);
}

TORCH_LIBRARY_IMPL(tessellm_cpu, CPU, m) {
    m.impl("int4_matmul", &int4_matmul);
    m.impl("int8_matmul", &int8_matmul);
    m.impl("quantize_rows", &quantize_rows);
}
