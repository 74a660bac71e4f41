// Direct Python entry points of the per-layer ops (kvcache._C.append, ...): the same ops, called through
// torch's C++ dispatcher, but reached from Python through pybind11 instead of torch.ops' generic path.
//
// Why: a decode step calls append + paged_attention once per layer, and for a short context the call
// itself is most of the time. torch.ops parses every argument against the schema into IValues, looks for
// __torch_function__ overrides and boxes the call (~2.5 us for these 10-15 arguments, Zen 4); a typed
// dispatcher call from pybind11 skips all three (~0.5 us) and still runs every dispatch key (CPU, CUDA,
// autograd's not-implemented check, Python __torch_dispatch__ modes and subclasses). What it does not see
// is __torch_function__: ops.py takes this path only for plain tensors outside torch.compile tracing.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <optional>

#include "direct_calls.h"

namespace kvcache {
namespace {

namespace py = pybind11;
using Opt = std::optional<at::Tensor>;

/// The typed handle of kvcache::<name>, found once.
template <class Sig>
c10::TypedOperatorHandle<Sig> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").template typed<Sig>();
}

using AppendSig = void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const Opt&,
                       const Opt&, int64_t, int64_t);
using AppendPlannedSig = void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const Opt&, const Opt&, int64_t, int64_t);
using AttentionSig = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, double, int64_t, int64_t, double, at::Tensor&,
                          const Opt&, const Opt&, const Opt&, int64_t, int64_t);
using AttentionPlannedSig = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, double, int64_t, int64_t, double, at::Tensor&, const Opt&,
                                 const Opt&, const Opt&, int64_t, int64_t);

}  // namespace

void register_direct_calls(py::module_& m) {
  // Each releases the GIL while the op runs, as torch.ops does.
  m.def("append", [](const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
                     const at::Tensor& slot_mapping, const Opt& k_scale, const Opt& v_scale, int64_t k_format,
                     int64_t v_format) {
    static const auto op = op_handle<AppendSig>("kvcache::append");
    py::gil_scoped_release no_gil;
    op.call(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_format, v_format);
  });
  m.def("append_planned", [](const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
                             const at::Tensor& plan_host, const at::Tensor& plan_device, const Opt& k_scale,
                             const Opt& v_scale, int64_t k_format, int64_t v_format) {
    static const auto op = op_handle<AppendPlannedSig>("kvcache::append_planned");
    py::gil_scoped_release no_gil;
    op.call(key, value, k_cache, v_cache, plan_host, plan_device, k_scale, v_scale, k_format, v_format);
  });
  m.def("paged_attention",
        [](const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
           const at::Tensor& seq_lens, const at::Tensor& cu_q_lens, double scale, int64_t window_left,
           int64_t sink_tokens, double softcap, at::Tensor out, const Opt& lse, const Opt& k_scale,
           const Opt& v_scale, int64_t k_format, int64_t v_format) {
          static const auto op = op_handle<AttentionSig>("kvcache::paged_attention");
          py::gil_scoped_release no_gil;
          op.call(query, k_cache, v_cache, tables, seq_lens, cu_q_lens, scale, window_left, sink_tokens, softcap, out,
                  lse, k_scale, v_scale, k_format, v_format);
        });
  // The planned attention runs once per layer and step, so its defaults are filled here rather than in Python:
  // scale None -> head_dim ** -0.5 (as Python computes it: pow), out None -> a new contiguous tensor, returned.
  m.def("paged_attention_planned",
        [](const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& plan_host,
           const at::Tensor& plan_device, std::optional<double> scale, int64_t window_left, int64_t sink_tokens,
           double softcap, Opt out, const Opt& lse, const Opt& k_scale, const Opt& v_scale, int64_t k_format,
           int64_t v_format) {
          static const auto op = op_handle<AttentionPlannedSig>("kvcache::paged_attention_planned");
          py::gil_scoped_release no_gil;
          at::Tensor result = out ? *out : at::empty_like(query, at::MemoryFormat::Contiguous);
          const double s = scale ? *scale : std::pow(static_cast<double>(query.size(-1)), -0.5);
          op.call(query, k_cache, v_cache, plan_host, plan_device, s, window_left, sink_tokens, softcap, result, lse,
                  k_scale, v_scale, k_format, v_format);
          return result;
        },
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("plan_host"), py::arg("plan_device"),
        py::arg("scale").none(true), py::arg("window_left"), py::arg("sink_tokens"), py::arg("softcap"),
        py::arg("out").none(true), py::arg("lse").none(true), py::arg("k_scale").none(true),
        py::arg("v_scale").none(true), py::arg("k_format"), py::arg("v_format"));
}

}  // namespace kvcache
