// Argument checks for the torch-facing side of every op. Messages name the argument and the numbers.
//   ValueError : shapes, devices, layouts, sizes      (TORCH_CHECK_VALUE)
//   TypeError  : dtypes                               (TORCH_CHECK_TYPE)
//   IndexError : slot / block id / length values      (TORCH_CHECK_INDEX)
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cfloat>
#include <cmath>
#include <string>

#define KVC_CHECK_DIM(t, n) \
  TORCH_CHECK_VALUE((t).dim() == (n), #t " must be a " #n "-D tensor but has shape ", (t).sizes())

#define KVC_CHECK_DTYPE(t, dt) \
  TORCH_CHECK_TYPE((t).scalar_type() == (dt), #t " must have dtype ", (dt), " but has ", (t).scalar_type())

#define KVC_CHECK_SAME_DEVICE(t, ref)                                                           \
  TORCH_CHECK_VALUE((t).device() == (ref).device(), #t " is on ", (t).device(), " but " #ref " is on ", \
                    (ref).device(), "; they must be on the same device")

#define KVC_CHECK_CONTIGUOUS(t) \
  TORCH_CHECK_VALUE((t).is_contiguous(), #t " must be contiguous (shape ", (t).sizes(), ", strides ", (t).strides(), ")")

#define KVC_CHECK_SIZE(t, d, expected, what)                                                       \
  TORCH_CHECK_VALUE((t).size(d) == (expected), #t ".shape[" #d "] = ", (t).size(d), " must equal ", what, \
                    " = ", (expected), " (shape ", (t).sizes(), ")")

/// A float argument (Python float: a double) that the kernels compute with as float32 must be finite there:
/// 1e39 passes std::isfinite but becomes inf in float32.
inline bool finite_as_float32(double x) { return std::isfinite(x) && std::fabs(x) <= double(FLT_MAX); }

#define KVC_CHECK_FINITE_FLOAT32(x)                                                                        \
  TORCH_CHECK_VALUE(finite_as_float32(x), #x " = ", (x), " must be finite, and finite as float32 (|" #x "| <= ", \
                    double(FLT_MAX), "), the precision the kernels compute in")

/// Raises IndexError with `msg` unless it is empty (see core/index_checks.h).
inline void kvc_raise_index_error(const std::string& msg) { TORCH_CHECK_INDEX(msg.empty(), msg); }
