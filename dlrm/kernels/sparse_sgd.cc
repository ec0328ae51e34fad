// SGD on the looked-up rows of many embedding tables in one op.
//
// TensorFlow's ResourceScatterSub updates a table's rows one Eigen expression at
// a time on one thread, about half a microsecond per 128-wide row on the 2-core
// reference machine, and SGD first multiplies the gradient by the learning rate
// into a temporary as large as it. On the default model the 26 updates took a
// sixth of a bfloat16 step (docs/performance.md). Here the tables are shared
// among the intra-op threads (a table's rows stay on one thread, so duplicate
// ids are applied one after the other, as the summed gradient's update), and
// each row is updated in place with the learning rate folded in.
//
// DlrmSparseSgd: variables (N float32 [rows, D] resource variables), indices (N
// int32 or int64 vectors), values (N float32 or bfloat16 [n_t, D] gradient
// rows), learning_rate (float32 scalar): variables[t][indices[t][r]] -=
// learning_rate * values[t][r] for every r.
//
// Each table is locked while it is updated, and put in copy-on-read mode first,
// as TensorFlow's own sparse updates do (a value read earlier is copied, never
// changed under its reader).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

namespace dlrm {

using tensorflow::DEVICE_CPU;
using tensorflow::OpInputList;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::Var;
using tensorflow::errors::InvalidArgument;

typedef float Lanes __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

// row -= rate * update over `width` values; update float32.
__attribute__((target_clones("avx512f", "avx2", "default"))) void Subtract(
    float* row, const float* update, float rate, int64_t width) {
  int64_t k = 0;
  for (; k + kLanes <= width; k += kLanes) {
    Lanes r, u;
    std::memcpy(&r, row + k, sizeof(r));
    std::memcpy(&u, update + k, sizeof(u));
    r -= rate * u;
    std::memcpy(row + k, &r, sizeof(r));
  }
  for (; k < width; ++k) row[k] -= rate * update[k];
}

// The same with a bfloat16 update, widened to float32 16 values at a time.
__attribute__((target_clones("avx512f", "avx2", "default"))) void SubtractBfloat16(
    float* row, const uint16_t* update, float rate, int64_t width) {
  int64_t k = 0;
  for (; k + kLanes <= width; k += kLanes) {
    uint32_t bits[kLanes];
    for (int64_t l = 0; l < kLanes; ++l) bits[l] = static_cast<uint32_t>(update[k + l]) << 16;
    Lanes r, u;
    std::memcpy(&r, row + k, sizeof(r));
    std::memcpy(&u, bits, sizeof(u));
    r -= rate * u;
    std::memcpy(row + k, &r, sizeof(r));
  }
  for (; k < width; ++k) {
    const uint32_t bits = static_cast<uint32_t>(update[k]) << 16;
    float u;
    std::memcpy(&u, &bits, sizeof(u));
    row[k] -= rate * u;
  }
}

template <typename Index>
Status UpdateTable(Var* var, int table, const Tensor& indices, const Tensor& values,
                   float rate) {
  tensorflow::mutex_lock lock(*var->mu());
  Tensor* params = var->tensor();
  if (params->dtype() != tensorflow::DT_FLOAT || params->dims() != 2) {
    return InvalidArgument("DlrmSparseSgd: variables[", table, "] is ",
                           tensorflow::DataTypeString(params->dtype()), " ",
                           params->shape().DebugString(), "; expected a float32 matrix");
  }
  const int64_t rows = params->dim_size(0);
  const int64_t width = params->dim_size(1);
  const int64_t count = indices.NumElements();
  if (indices.dims() != 1 || values.dims() != 2 || values.dim_size(0) != count ||
      values.dim_size(1) != width) {
    return InvalidArgument("DlrmSparseSgd: table ", table, " ", params->shape().DebugString(),
                           ": expected indices [n] and values [n, ", width, "], got ",
                           indices.shape().DebugString(), " and ", values.shape().DebugString());
  }
  if (!var->copy_on_read_mode.load()) {
    if (!params->RefCountIsOne()) {  // a reader holds the buffer: update a copy
      Tensor copy(tensorflow::cpu_allocator(), params->dtype(), params->shape());
      std::memcpy(copy.data(), params->data(), params->TotalBytes());
      *params = copy;
    }
    var->copy_on_read_mode.store(true);
  }
  float* data = params->flat<float>().data();
  const Index* ids = indices.flat<Index>().data();
  for (int64_t r = 0; r < count; ++r) {
    if (ids[r] < 0 || ids[r] >= rows) {
      return InvalidArgument("DlrmSparseSgd: table ", table, ": indices[", r, "] = ", ids[r],
                             " is not in [0, ", rows, ")");
    }
  }
  if (values.dtype() == tensorflow::DT_FLOAT) {
    const float* update = values.flat<float>().data();
    for (int64_t r = 0; r < count; ++r) {
      Subtract(data + ids[r] * width, update + r * width, rate, width);
    }
  } else {
    const uint16_t* update = reinterpret_cast<const uint16_t*>(values.data());
    for (int64_t r = 0; r < count; ++r) {
      SubtractBfloat16(data + ids[r] * width, update + r * width, rate, width);
    }
  }
  return Status();
}

class SparseSgdOp : public OpKernel {
 public:
  explicit SparseSgdOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    OpInputList indices, values;
    OP_REQUIRES_OK(context, context->input_list("indices", &indices));
    OP_REQUIRES_OK(context, context->input_list("values", &values));
    const int tables = indices.size();
    OP_REQUIRES(context, values.size() == tables && context->num_inputs() == 3 * tables + 1,
                InvalidArgument("DlrmSparseSgd: expected as many indices and values as "
                                "variables, got ", context->num_inputs() - 1 - 2 * tables,
                                " variables, ", tables, " indices and ", values.size(),
                                " values"));
    const Tensor& rate = context->input(context->num_inputs() - 1);
    OP_REQUIRES(context, rate.dims() == 0,
                InvalidArgument("DlrmSparseSgd: expected a scalar learning_rate, got ",
                                rate.shape().DebugString()));
    std::vector<tensorflow::core::RefCountPtr<Var>> vars(tables);
    for (int t = 0; t < tables; ++t) {
      OP_REQUIRES_OK(context,
                     tensorflow::LookupResource(context, tensorflow::HandleFromInput(context, t),
                                                &vars[t]));
    }
    const float learning_rate = rate.scalar<float>()();
    std::vector<Status> status(tables);
    auto work = [&](int64_t start, int64_t limit) {
      for (int64_t t = start; t < limit; ++t) {
        status[t] = indices[t].dtype() == tensorflow::DT_INT32
                        ? UpdateTable<int32_t>(vars[t].get(), t, indices[t], values[t],
                                               learning_rate)
                        : UpdateTable<int64_t>(vars[t].get(), t, indices[t], values[t],
                                               learning_rate);
      }
    };
    int64_t rows = 0;
    for (int t = 0; t < tables; ++t) rows += indices[t].NumElements();
    auto* workers = context->device()->tensorflow_cpu_worker_threads();
    // Cost per table: its rows' values, on average.
    const int64_t width = tables && values[0].dims() == 2 ? values[0].dim_size(1) : 1;
    tensorflow::Shard(workers->num_threads, workers->workers, tables,
                      std::max<int64_t>(1, rows / std::max(tables, 1) * width), work);
    for (const Status& s : status) OP_REQUIRES_OK(context, s);
  }
};

REGISTER_OP("DlrmSparseSgd")
    .Attr("N: int >= 1")
    .Attr("Tindices: list({int32, int64})")
    .Attr("T: list({float, bfloat16})")
    .Input("variables: N * resource")
    .Input("indices: Tindices")
    .Input("values: T")
    .Input("learning_rate: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext*) { return Status(); });

REGISTER_KERNEL_BUILDER(Name("DlrmSparseSgd").Device(DEVICE_CPU), SparseSgdOp);

}  // namespace dlrm
