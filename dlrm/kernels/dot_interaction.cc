// DLRM's dot interaction as one CPU kernel, forward and backward.
//
// TensorFlow runs the interaction as a stack of tiny per-sample matrix products
// ([T, D] by [D, T]) far below the machine's matmul speed, plus the copies that
// gather the pairs out of each Gram matrix and scatter their gradient back
// (docs/performance.md). Here each sample's T + 1 vectors (a few kB) stay in
// the core's cache while all of its pairs are computed, and the samples are
// shared among TensorFlow's intra-op threads.
//
// DlrmDotInteraction: dense [B, D], embeddings [B, T, D] -> [B, D + (T + 1) T / 2]:
// `dense`, then <v_i, v_j> for i > j, row by row (i = 1 .. T, j = 0 .. i - 1), of
// v = (dense, e_1 .. e_T). The Python reference is dlrm.model.interaction.dot_interaction.
//
// DlrmDotInteractionGrad: the output's gradient, dense, embeddings -> the
// gradients of dense and embeddings. With G the symmetric [T + 1, T + 1] matrix
// of the pairs' gradients (zero diagonal), v_i's gradient is sum_j G_ij v_j, and
// dense's also has the output's first D columns added.
//
// bfloat16 inputs are widened to float32, the sums run in float32, and the
// results are rounded once to bfloat16.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

#include "bfloat16.h"

namespace dlrm {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;
namespace shape_inference = tensorflow::shape_inference;

// Lanes of L floats: the vector registers of one instruction set.
typedef float Lanes16 __attribute__((vector_size(64)));
typedef float Lanes8 __attribute__((vector_size(32)));
typedef float Lanes4 __attribute__((vector_size(16)));

#define DLRM_INLINE inline __attribute__((always_inline))

template <typename L>
constexpr int64_t kWidth = sizeof(L) / sizeof(float);

template <typename L>
DLRM_INLINE L Load(const float* p) {
  L x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

template <typename L>
DLRM_INLINE void Store(float* p, L x) { std::memcpy(p, &x, sizeof(x)); }

template <typename L>
DLRM_INLINE float Sum(L x) {
  float sum = 0;
  for (int64_t l = 0; l < kWidth<L>; ++l) sum += x[l];
  return sum;
}

// out[0 .. pairs) = <v_i, v_j> for i > j, row by row; v: n vectors of `width`.
// Four pairs at a time share the loads of v_i.
template <typename L>
DLRM_INLINE void Pairs(const float* const* v, int64_t n, int64_t width, float* out) {
  constexpr int64_t lanes = kWidth<L>;
  const int64_t full = width - width % lanes;
  int64_t p = 0;
  for (int64_t i = 1; i < n; ++i) {
    const float* a = v[i];
    int64_t j = 0;
    for (; j + 4 <= i; j += 4) {
      L s0 = {}, s1 = {}, s2 = {}, s3 = {};
      for (int64_t k = 0; k < full; k += lanes) {
        const L x = Load<L>(a + k);
        s0 += x * Load<L>(v[j] + k);
        s1 += x * Load<L>(v[j + 1] + k);
        s2 += x * Load<L>(v[j + 2] + k);
        s3 += x * Load<L>(v[j + 3] + k);
      }
      float r[4] = {Sum(s0), Sum(s1), Sum(s2), Sum(s3)};
      for (int64_t k = full; k < width; ++k) {
        for (int64_t q = 0; q < 4; ++q) r[q] += a[k] * v[j + q][k];
      }
      for (int64_t q = 0; q < 4; ++q) out[p++] = r[q];
    }
    for (; j < i; ++j) {
      L s = {};
      for (int64_t k = 0; k < full; k += lanes) s += Load<L>(a + k) * Load<L>(v[j] + k);
      float sum = Sum(s);
      for (int64_t k = full; k < width; ++k) sum += a[k] * v[j][k];
      out[p++] = sum;
    }
  }
}

// grad[i] = sum_j g[i * n + j] v_j for the n vectors v of `width`; g symmetric
// with a zero diagonal. Two rows i at a time share the loads of v_j, and their
// sums run over blocks of 4 lanes-wide columns held in registers: 8 sums, 4
// loads and 2 broadcasts, which fit the 16 registers of AVX2 and the 32 of
// AVX-512.
template <typename L>
DLRM_INLINE void Gradient(const float* const* v, const float* g, int64_t n, int64_t width,
                          float* const* grad) {
  constexpr int64_t lanes = kWidth<L>;
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    const float* w0 = g + i * n;
    const float* w1 = w0 + n;
    int64_t k = 0;
    for (; k + 4 * lanes <= width; k += 4 * lanes) {
      L a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
      for (int64_t j = 0; j < n; ++j) {
        const float* x = v[j] + k;
        const L x0 = Load<L>(x), x1 = Load<L>(x + lanes), x2 = Load<L>(x + 2 * lanes),
                x3 = Load<L>(x + 3 * lanes);
        const float c0 = w0[j], c1 = w1[j];
        a0 += c0 * x0;
        a1 += c0 * x1;
        a2 += c0 * x2;
        a3 += c0 * x3;
        b0 += c1 * x0;
        b1 += c1 * x1;
        b2 += c1 * x2;
        b3 += c1 * x3;
      }
      float* out = grad[i] + k;
      Store(out, a0);
      Store(out + lanes, a1);
      Store(out + 2 * lanes, a2);
      Store(out + 3 * lanes, a3);
      out = grad[i + 1] + k;
      Store(out, b0);
      Store(out + lanes, b1);
      Store(out + 2 * lanes, b2);
      Store(out + 3 * lanes, b3);
    }
    for (; k < width; ++k) {
      float s0 = 0, s1 = 0;
      for (int64_t j = 0; j < n; ++j) {
        s0 += w0[j] * v[j][k];
        s1 += w1[j] * v[j][k];
      }
      grad[i][k] = s0;
      grad[i + 1][k] = s1;
    }
  }
  for (; i < n; ++i) {
    const float* w = g + i * n;
    int64_t k = 0;
    for (; k + lanes <= width; k += lanes) {
      L s = {};
      for (int64_t j = 0; j < n; ++j) s += w[j] * Load<L>(v[j] + k);
      Store(grad[i] + k, s);
    }
    for (; k < width; ++k) {
      float sum = 0;
      for (int64_t j = 0; j < n; ++j) sum += w[j] * v[j][k];
      grad[i][k] = sum;
    }
  }
}

// One build per instruction set, each with the lanes of its registers, chosen
// once at run time. (GCC's target_clones over one 64-byte vector type lowered
// it through the stack on AVX2: the backward ran at 3-4 GFLOP/s there.) No FMA:
// a fused multiply-add rounds once where these round twice, and the kernel keeps
// the rounding its earlier builds had (docs/performance.md).
using PairsFn = void (*)(const float* const*, int64_t, int64_t, float*);
using GradientFn = void (*)(const float* const*, const float*, int64_t, int64_t, float* const*);

#define DLRM_AVX512 __attribute__((target("avx512f")))
#define DLRM_AVX2 __attribute__((target("avx2")))

DLRM_AVX512 void PairsAvx512(const float* const* v, int64_t n, int64_t width, float* out) {
  Pairs<Lanes16>(v, n, width, out);
}
DLRM_AVX2 void PairsAvx2(const float* const* v, int64_t n, int64_t width, float* out) {
  Pairs<Lanes8>(v, n, width, out);
}
void PairsSse(const float* const* v, int64_t n, int64_t width, float* out) {
  Pairs<Lanes4>(v, n, width, out);
}
DLRM_AVX512 void GradientAvx512(const float* const* v, const float* g, int64_t n, int64_t width,
                                float* const* grad) {
  Gradient<Lanes16>(v, g, n, width, grad);
}
DLRM_AVX2 void GradientAvx2(const float* const* v, const float* g, int64_t n, int64_t width,
                            float* const* grad) {
  Gradient<Lanes8>(v, g, n, width, grad);
}
void GradientSse(const float* const* v, const float* g, int64_t n, int64_t width,
                 float* const* grad) {
  Gradient<Lanes4>(v, g, n, width, grad);
}

// Picked when the library loads: __builtin_cpu_init first, since this runs
// among the shared library's constructors.
PairsFn ChoosePairs() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return PairsAvx512;
  if (__builtin_cpu_supports("avx2")) return PairsAvx2;
  return PairsSse;
}
GradientFn ChooseGradient() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return GradientAvx512;
  if (__builtin_cpu_supports("avx2")) return GradientAvx2;
  return GradientSse;
}
const PairsFn SamplePairs = ChoosePairs();
const GradientFn SampleGradient = ChooseGradient();

// float32 <-> T over arrays: bfloat16's in bfloat16.h.
inline void Widen(const float* in, int64_t count, float* out) { std::copy(in, in + count, out); }
inline void Narrow(const float* in, int64_t count, float* out) { std::copy(in, in + count, out); }

// Shape checks shared by both kernels; sets *batch, *tables, *width.
Status CheckInputs(const Tensor& dense, const Tensor& embeddings, int64_t* batch,
                   int64_t* tables, int64_t* width) {
  if (dense.dims() != 2 || embeddings.dims() != 3) {
    return InvalidArgument("DlrmDotInteraction: expected dense [B, D] and embeddings [B, T, D], got ",
                           dense.shape().DebugString(), " and ",
                           embeddings.shape().DebugString());
  }
  *batch = dense.dim_size(0);
  *width = dense.dim_size(1);
  *tables = embeddings.dim_size(1);
  if (embeddings.dim_size(0) != *batch || embeddings.dim_size(2) != *width) {
    return InvalidArgument("DlrmDotInteraction: embeddings ", embeddings.shape().DebugString(),
                           " do not match dense ", dense.shape().DebugString(),
                           " (expected [B, T, D] with dense [B, D])");
  }
  return Status();
}

// Cost per sample for the work sharder, in its rough cycles.
int64_t SampleCost(int64_t tables, int64_t width) { return 4 * (tables + 1) * (tables + 1) * width; }

template <typename T>
class DotInteractionOp : public OpKernel {
 public:
  explicit DotInteractionOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& dense = context->input(0);
    const Tensor& embeddings = context->input(1);
    int64_t batch, tables, width;
    OP_REQUIRES_OK(context, CheckInputs(dense, embeddings, &batch, &tables, &width));
    const int64_t n = tables + 1;
    const int64_t pairs = n * tables / 2;
    Tensor* output = nullptr;
    OP_REQUIRES_OK(context,
                   context->allocate_output(0, TensorShape({batch, width + pairs}), &output));
    const T* dense_data = dense.flat<T>().data();
    const T* embeddings_data = embeddings.flat<T>().data();
    T* out_data = output->flat<T>().data();

    auto work = [&](int64_t start, int64_t limit) {
      std::vector<float> widened(std::is_same<T, float>::value ? 0 : n * width);
      std::vector<float> products(pairs);
      std::vector<const float*> v(n);
      for (int64_t b = start; b < limit; ++b) {
        const T* d = dense_data + b * width;
        const T* e = embeddings_data + b * tables * width;
        if constexpr (std::is_same<T, float>::value) {
          v[0] = d;
          for (int64_t t = 0; t < tables; ++t) v[t + 1] = e + t * width;
        } else {
          Widen(d, width, widened.data());
          Widen(e, tables * width, widened.data() + width);
          for (int64_t i = 0; i < n; ++i) v[i] = widened.data() + i * width;
        }
        T* out = out_data + b * (width + pairs);
        std::copy(d, d + width, out);
        SamplePairs(v.data(), n, width, products.data());
        Narrow(products.data(), pairs, out + width);
      }
    };
    auto* workers = context->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(workers->num_threads, workers->workers, batch, SampleCost(tables, width),
                      work);
  }
};

template <typename T>
class DotInteractionGradOp : public OpKernel {
 public:
  explicit DotInteractionGradOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& gradient = context->input(0);
    const Tensor& dense = context->input(1);
    const Tensor& embeddings = context->input(2);
    int64_t batch, tables, width;
    OP_REQUIRES_OK(context, CheckInputs(dense, embeddings, &batch, &tables, &width));
    const int64_t n = tables + 1;
    const int64_t pairs = n * tables / 2;
    OP_REQUIRES(context,
                gradient.dims() == 2 && gradient.dim_size(0) == batch &&
                    gradient.dim_size(1) == width + pairs,
                InvalidArgument("DlrmDotInteractionGrad: expected the gradient [", batch, ", ",
                                width + pairs, "], got ", gradient.shape().DebugString()));
    Tensor* dense_gradient = nullptr;
    Tensor* embeddings_gradient = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, dense.shape(), &dense_gradient));
    OP_REQUIRES_OK(context, context->allocate_output(1, embeddings.shape(), &embeddings_gradient));
    const T* gradient_data = gradient.flat<T>().data();
    const T* dense_data = dense.flat<T>().data();
    const T* embeddings_data = embeddings.flat<T>().data();
    T* dense_out = dense_gradient->flat<T>().data();
    T* embeddings_out = embeddings_gradient->flat<T>().data();

    auto work = [&](int64_t start, int64_t limit) {
      constexpr bool kFloat = std::is_same<T, float>::value;
      std::vector<float> widened(kFloat ? 0 : n * width);
      std::vector<float> result(kFloat ? width : n * width);
      std::vector<float> symmetric(n * n);
      std::vector<float> upstream(width + pairs);  // the sample's output gradient
      std::vector<const float*> v(n);
      std::vector<float*> grad(n);
      for (int64_t b = start; b < limit; ++b) {
        const T* d = dense_data + b * width;
        const T* e = embeddings_data + b * tables * width;
        Widen(gradient_data + b * (width + pairs), width + pairs, upstream.data());
        const float* g = upstream.data();
        int64_t p = 0;
        for (int64_t i = 0; i < n; ++i) {
          symmetric[i * n + i] = 0.0f;
          for (int64_t j = 0; j < i; ++j, ++p) {
            const float x = g[width + p];
            symmetric[i * n + j] = x;
            symmetric[j * n + i] = x;
          }
        }
        if constexpr (kFloat) {
          v[0] = d;
          for (int64_t t = 0; t < tables; ++t) v[t + 1] = e + t * width;
          // float32: the embeddings' gradients go straight to the output.
          grad[0] = result.data();
          for (int64_t t = 0; t < tables; ++t) {
            grad[t + 1] = embeddings_out + b * tables * width + t * width;
          }
        } else {
          Widen(d, width, widened.data());
          Widen(e, tables * width, widened.data() + width);
          for (int64_t i = 0; i < n; ++i) {
            v[i] = widened.data() + i * width;
            grad[i] = result.data() + i * width;
          }
        }
        SampleGradient(v.data(), symmetric.data(), n, width, grad.data());
        for (int64_t k = 0; k < width; ++k) grad[0][k] += g[k];
        Narrow(grad[0], width, dense_out + b * width);
        if constexpr (!kFloat) {
          Narrow(result.data() + width, tables * width, embeddings_out + b * tables * width);
        }
      }
    };
    auto* workers = context->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(workers->num_threads, workers->workers, batch,
                      2 * SampleCost(tables, width), work);
  }
};

Status InteractionShape(shape_inference::InferenceContext* c) {
  shape_inference::ShapeHandle dense, embeddings;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &dense));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 3, &embeddings));
  shape_inference::DimensionHandle batch, width;
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(dense, 0), c->Dim(embeddings, 0), &batch));
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(dense, 1), c->Dim(embeddings, 2), &width));
  shape_inference::DimensionHandle columns = c->UnknownDim();
  const shape_inference::DimensionHandle tables = c->Dim(embeddings, 1);
  if (c->ValueKnown(width) && c->ValueKnown(tables)) {
    const int64_t t = c->Value(tables);
    columns = c->MakeDim(c->Value(width) + (t + 1) * t / 2);
  }
  c->set_output(0, c->Matrix(batch, columns));
  return Status();
}

REGISTER_OP("DlrmDotInteraction")
    .Attr("T: {float, bfloat16}")
    .Input("dense: T")
    .Input("embeddings: T")
    .Output("output: T")
    .SetShapeFn(InteractionShape);

REGISTER_OP("DlrmDotInteractionGrad")
    .Attr("T: {float, bfloat16}")
    .Input("gradient: T")
    .Input("dense: T")
    .Input("embeddings: T")
    .Output("dense_gradient: T")
    .Output("embeddings_gradient: T")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(1));
      c->set_output(1, c->input(2));
      return Status();
    });

#define REGISTER(T)                                                                   \
  REGISTER_KERNEL_BUILDER(                                                            \
      Name("DlrmDotInteraction").Device(DEVICE_CPU).TypeConstraint<T>("T"),           \
      DotInteractionOp<T>);                                                           \
  REGISTER_KERNEL_BUILDER(                                                            \
      Name("DlrmDotInteractionGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"),       \
      DotInteractionGradOp<T>);
REGISTER(float)
REGISTER(Eigen::bfloat16)
#undef REGISTER

}  // namespace dlrm
