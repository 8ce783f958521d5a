// The C++ CPU kernel of tp_runtime::dense_linear (executor/native_kernels.py says why).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

// executor/kernels.py padded_rows, which tests/model/test_runners.py holds this one to.
int64_t padded_rows(int64_t rows) {
  if (rows <= 16) return rows;
  const int shift = 64 - __builtin_clzll(static_cast<unsigned long long>(rows)) - 4;
  return ((rows + (int64_t{1} << shift) - 1) >> shift) << shift;
}

// executor/kernels.py dense_matmul: x W^T for W oneDNN-packed or plain, at a rounded row count.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight) {
  if (!weight.device().is_cpu()) return at::linear(x, weight);
  const int64_t rows = x.size(0);
  const int64_t padded = padded_rows(rows);
  const at::Tensor input = padded == rows ? x : at::constant_pad_nd(x, {0, 0, 0, padded - rows});
  at::Tensor y;
  if (weight.is_mkldnn()) {
    static const auto linear = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{input, weight, c10::IValue(), std::string("none"),
                            c10::List<std::optional<at::Scalar>>(), std::string("")};
    linear.callBoxed(&stack);
    y = stack[0].toTensor();
  } else {
    y = at::linear(input, weight);
  }
  return y.narrow(0, 0, rows);
}

}  // namespace

// The operator's schema and fake kernel are Python's (executor/kernels.py); its CPU kernel is this.
TORCH_LIBRARY_IMPL(tp_runtime, CPU, m) { m.impl("dense_linear", &dense_linear); }
// The Python registration also puts a Python kernel under Autograd, which every call on CPU tensors
// outside inference mode would pass through (taking the GIL back) before it reached the one above.
// Inference needs no gradient of it: on the CPU the call falls through to the C++ kernel.
TORCH_LIBRARY_IMPL(tp_runtime, AutogradCPU, m) { m.impl("dense_linear", torch::CppFunction::makeFallthrough()); }

extern "C" int64_t tp_padded_rows(int64_t rows) { return padded_rows(rows); }
