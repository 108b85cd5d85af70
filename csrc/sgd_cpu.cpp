// Fused one-pass CPU loop of engine.optim.functional.sgd_update (fp32, contiguous, in place).
//
// Why: on CPU the reference path runs SGD with spike compensation and weight prediction as six
// torch ops, six passes over memory; this loop reads g, w, v once and writes w, v, predicted
// (and delta) once. It must stay bit-identical to the reference, so every multiply-add is
// rounded as torch's CPU kernel for that op rounds it: a fused multiply-add where torch's
// vectorised add-with-alpha uses one (AVX2/AVX512 capability), a product then a sum where it
// does not (DEFAULT capability). This file is compiled with -ffp-contract=off so the compiler
// never fuses what torch keeps apart.
#include "sgd_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>

#include <algorithm>
#include <cmath>
#include <string>

namespace pe {
namespace {

enum class Mode { kNone, kPlain, kNesterov, kSpike };

// fp32 coefficients, rounded once from the Python floats as torch rounds a Scalar
struct Coeffs {
  Mode mode;
  bool init, divide, maximize, decay;
  float scale, wd, m, damp1, a, bd, neg_lr, neg_coeff, gamma, gamma1;
};

struct Buffers {
  const float* g;
  float* w;
  float* v;  // nullptr without momentum
  float* p;  // nullptr without prediction
  float* d;  // nullptr without PipeMare's delta
};

constexpr int64_t kGrain = 32768;  // at::internal::GRAIN_SIZE, as torch's elementwise ops
constexpr int64_t kBlock = 2048;   // g' of one block lives in an 8 KiB stack buffer (L1)

}  // namespace

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PE_SGD_X86_VARIANTS 1
namespace fma_isa {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define PE_MADD(a, b, c) __builtin_fmaf((a), (b), (c))
#include "sgd_cpu_kernel.inc"
#undef PE_MADD
#pragma GCC pop_options
}  // namespace fma_isa
namespace baseline_isa {
#define PE_MADD(a, b, c) ((a) * (b) + (c))
#include "sgd_cpu_kernel.inc"
#undef PE_MADD
}  // namespace baseline_isa
#else
// Other targets (aarch64: NEON fuses torch's multiply-adds, and fmaf is one instruction
// there) and other compilers: one variant with fused multiply-adds.
namespace fma_isa {
#define PE_MADD(a, b, c) std::fma((a), (b), (c))
#include "sgd_cpu_kernel.inc"
#undef PE_MADD
}  // namespace fma_isa
#endif

std::string sgd_cpu_variant() {
#ifdef PE_SGD_X86_VARIANTS
  static const bool fused = [] {
    const std::string cap = at::get_cpu_capability();
    return cap == "AVX2" || cap == "AVX512";
  }();
  return fused ? "fma" : "baseline";
#else
  return "fma";
#endif
}

namespace {

float* data_or_null(const std::optional<at::Tensor>& t, const at::Tensor& param,
                    const char* name) {
  if (!t.has_value()) return nullptr;
  PE_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                  t->numel() == param.numel(),
              "sgd_step_cpu: ", name, " must be a contiguous float32 CPU tensor of ",
              param.numel(), " elements");
  return t->data_ptr<float>();
}

}  // namespace

std::string sgd_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                         const std::optional<at::Tensor>& momentum_buffer,
                         const std::optional<at::Tensor>& predicted,
                         const std::optional<at::Tensor>& delta, double lr, double momentum,
                         double dampening, double weight_decay, bool nesterov, bool maximize,
                         bool init_momentum, bool spike, double sc_a, double sc_bd,
                         double predict_coeff, double delta_gamma,
                         std::optional<double> grad_scale) {
  PE_CHECK(param.device().is_cpu() && param.scalar_type() == at::kFloat &&
                  param.is_contiguous(),
              "sgd_step_cpu: param must be a contiguous float32 CPU tensor");
  PE_CHECK(grad.device().is_cpu() && grad.scalar_type() == at::kFloat && grad.is_contiguous() &&
                  grad.numel() == param.numel(),
              "sgd_step_cpu: grad must be a contiguous float32 CPU tensor shaped like param");
  PE_CHECK(momentum == 0.0 || momentum_buffer.has_value(),
              "sgd_step_cpu: momentum != 0 needs a momentum_buffer");
  Buffers t{grad.data_ptr<float>(), param.data_ptr<float>(),
            momentum != 0.0 ? data_or_null(momentum_buffer, param, "momentum_buffer") : nullptr,
            data_or_null(predicted, param, "predicted"), data_or_null(delta, param, "delta")};
  Coeffs c{};
  c.mode = momentum == 0.0 ? Mode::kNone
           : spike         ? Mode::kSpike
           : nesterov      ? Mode::kNesterov
                           : Mode::kPlain;
  c.init = init_momentum;
  c.divide = grad_scale.has_value();
  c.maximize = maximize;
  c.decay = weight_decay != 0.0;
  c.scale = grad_scale.has_value() ? static_cast<float>(*grad_scale) : 1.0f;
  c.wd = static_cast<float>(weight_decay);
  c.m = static_cast<float>(momentum);
  c.damp1 = static_cast<float>(1.0 - dampening);
  c.a = static_cast<float>(sc_a);
  c.bd = static_cast<float>(sc_bd);
  c.neg_lr = static_cast<float>(-lr);
  c.neg_coeff = static_cast<float>(-predict_coeff);
  c.gamma = static_cast<float>(delta_gamma);
  c.gamma1 = static_cast<float>(1.0 - delta_gamma);
  const int64_t n = param.numel();
  const std::string variant = sgd_cpu_variant();
  if (n == 0) return variant;
#ifdef PE_SGD_X86_VARIANTS
  if (variant == "fma") fma_isa::step(t, n, c);
  else baseline_isa::step(t, n, c);
#else
  fma_isa::step(t, n, c);
#endif
  return variant;
}

}  // namespace pe
