// Fused one-pass CPU loop of momentum SGD with the delay mitigations (engine.optim.cpu_loop).
#pragma once

#include <torch/extension.h>

#include <optional>

#include "errors.h"

namespace pe {

// One step of engine.optim.functional.sgd_update over contiguous fp32 CPU tensors, in place.
// The coefficients arrive as the Python floats the reference passes to torch (sc_a = m^D,
// sc_bd = b * (1 - d)); they are rounded to fp32 here exactly as torch rounds a Scalar.
// Returns the ISA variant that ran ("fma" or "baseline").
std::string sgd_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                         const std::optional<at::Tensor>& momentum_buffer,
                         const std::optional<at::Tensor>& predicted,
                         const std::optional<at::Tensor>& delta, double lr, double momentum,
                         double dampening, double weight_decay, bool nesterov, bool maximize,
                         bool init_momentum, bool spike, double sc_a, double sc_bd,
                         double predict_coeff, double delta_gamma,
                         std::optional<double> grad_scale);

// Which variant sgd_step_cpu runs in this process: "fma" when torch's CPU kernels fuse their
// multiply-adds (AVX2/AVX512 capability, x86 with GCC; every aarch64 build), else "baseline".
std::string sgd_cpu_variant();

}  // namespace pe
