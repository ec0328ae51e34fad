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
typedef uint32_t Words __attribute__((vector_size(64)));
typedef uint16_t Halves __attribute__((vector_size(32)));
constexpr int64_t kLanes = 16;  // also the floats of a cache line
// Rows asked for from memory ahead of their update (DlrmEmbeddingSgd).
constexpr int64_t kAhead = 8;

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
    Halves half;
    std::memcpy(&half, update + k, sizeof(half));
    const Words bits = __builtin_convertvector(half, Words) << 16;
    Lanes r, u;
    std::memcpy(&r, row + k, sizeof(r));
    std::memcpy(&u, &bits, sizeof(u));
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

// Checks that `var` (the op's `table`-th) is a float32 matrix and puts it in
// copy-on-read mode, as TensorFlow's sparse updates do: a buffer a reader still
// holds is copied first, so that value is never changed under its reader. The
// caller holds the variable's lock.
Status PrepareTable(Var* var, const char* op, int table) {
  Tensor* params = var->tensor();
  if (params->dtype() != tensorflow::DT_FLOAT || params->dims() != 2) {
    return InvalidArgument(op, ": variables[", table, "] is ",
                           tensorflow::DataTypeString(params->dtype()), " ",
                           params->shape().DebugString(), "; expected a float32 matrix");
  }
  if (!var->copy_on_read_mode.load()) {
    if (!params->RefCountIsOne()) {  // a reader holds the buffer: update a copy
      Tensor copy(tensorflow::cpu_allocator(), params->dtype(), params->shape());
      std::memcpy(copy.data(), params->data(), params->TotalBytes());
      *params = copy;
    }
    var->copy_on_read_mode.store(true);
  }
  return Status();
}

// row -= rate * update for a float32 or bfloat16 update.
inline void SubtractRow(float* row, const float* update, float rate, int64_t width) {
  Subtract(row, update, rate, width);
}
inline void SubtractRow(float* row, const Eigen::bfloat16* update, float rate, int64_t width) {
  SubtractBfloat16(row, reinterpret_cast<const uint16_t*>(update), rate, width);
}

template <typename Index>
Status UpdateTable(Var* var, int table, const Tensor& indices, const Tensor& values,
                   float rate) {
  tensorflow::mutex_lock lock(*var->mu());
  TF_RETURN_IF_ERROR(PrepareTable(var, "DlrmSparseSgd", table));
  Tensor* params = var->tensor();
  const int64_t rows = params->dim_size(0);
  const int64_t width = params->dim_size(1);
  const int64_t count = indices.NumElements();
  if (indices.dims() != 1 || values.dims() != 2 || values.dim_size(0) != count ||
      values.dim_size(1) != width) {
    return InvalidArgument("DlrmSparseSgd: table ", table, " ", params->shape().DebugString(),
                           ": expected indices [n] and values [n, ", width, "], got ",
                           indices.shape().DebugString(), " and ", values.shape().DebugString());
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
      SubtractRow(data + ids[r] * width, update + r * width, rate, width);
    }
  } else {
    const Eigen::bfloat16* update = values.flat<Eigen::bfloat16>().data();
    for (int64_t r = 0; r < count; ++r) {
      SubtractRow(data + ids[r] * width, update + r * width, rate, width);
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

// DlrmEmbeddingSgd: SGD on the rows that DlrmEmbeddingLookup (embedding_lookup.cc)
// read, from the gradient of its undivided output: tables (N float32 [rows_t,
// widths[t]] resource variables), ids ([B, N] int32 or int64), gradient ([B,
// widths[0] + ... + widths[N - 1]] float32 or bfloat16), learning_rate (float32
// scalar): tables[t][ids[b, t]] -= learning_rate * (table t's columns of
// gradient[b]) for every b. Tables are shared among the threads as above, so a
// table's duplicate ids apply in turn; an id out of range is an error before its
// table changes.
template <typename T, typename Index>
class EmbeddingSgdOp : public OpKernel {
 public:
  explicit EmbeddingSgdOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("widths", &widths_));
  }

  void Compute(OpKernelContext* context) override {
    const int tables = static_cast<int>(widths_.size());
    OP_REQUIRES(context, context->num_inputs() == tables + 3,
                InvalidArgument("DlrmEmbeddingSgd: expected one width per table, got ",
                                widths_.size(), " widths for ", context->num_inputs() - 3,
                                " tables"));
    const Tensor& ids = context->input(tables);
    const Tensor& gradient = context->input(tables + 1);
    const Tensor& rate = context->input(tables + 2);
    int64_t total = 0;
    std::vector<int64_t> offsets(tables);
    for (int t = 0; t < tables; ++t) offsets[t] = total, total += widths_[t];
    OP_REQUIRES(context,
                ids.dims() == 2 && ids.dim_size(1) == tables && gradient.dims() == 2 &&
                    gradient.dim_size(0) == ids.dim_size(0) && gradient.dim_size(1) == total,
                InvalidArgument("DlrmEmbeddingSgd: expected ids [B, ", tables,
                                "] and gradient [B, ", total, "], got ",
                                ids.shape().DebugString(), " and ",
                                gradient.shape().DebugString()));
    OP_REQUIRES(context, rate.dims() == 0,
                InvalidArgument("DlrmEmbeddingSgd: expected a scalar learning_rate, got ",
                                rate.shape().DebugString()));
    std::vector<tensorflow::core::RefCountPtr<Var>> vars(tables);
    for (int t = 0; t < tables; ++t) {
      OP_REQUIRES_OK(context, tensorflow::LookupResource(
                                  context, tensorflow::HandleFromInput(context, t), &vars[t]));
    }
    const int64_t batch = ids.dim_size(0);
    const Index* id = ids.flat<Index>().data();
    const T* update = gradient.flat<T>().data();
    const float learning_rate = rate.scalar<float>()();
    std::vector<Status> status(tables);
    auto work = [&](int64_t start, int64_t limit) {
      for (int64_t t = start; t < limit; ++t) {
        status[t] = UpdateColumns(vars[t].get(), static_cast<int>(t), id, update, batch,
                                  offsets[t], total, learning_rate);
      }
    };
    auto* workers = context->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(workers->num_threads, workers->workers, tables,
                      std::max<int64_t>(1, batch * total / std::max(tables, 1)), work);
    for (const Status& s : status) OP_REQUIRES_OK(context, s);
  }

 private:
  Status UpdateColumns(Var* var, int table, const Index* id, const T* update, int64_t batch,
                       int64_t offset, int64_t total, float rate) const {
    const int tables = static_cast<int>(widths_.size());
    const int64_t width = widths_[table];
    tensorflow::mutex_lock lock(*var->mu());
    TF_RETURN_IF_ERROR(PrepareTable(var, "DlrmEmbeddingSgd", table));
    Tensor* params = var->tensor();
    const int64_t rows = params->dim_size(0);
    if (params->dim_size(1) != width) {
      return InvalidArgument("DlrmEmbeddingSgd: variables[", table, "] is ",
                             params->shape().DebugString(), "; expected [rows, ", width, "]");
    }
    for (int64_t b = 0; b < batch; ++b) {
      const Index row = id[b * tables + table];
      if (row < 0 || row >= rows) {
        return InvalidArgument("DlrmEmbeddingSgd: ids[", b, ", ", table, "] = ", row,
                               " is not a row of table ", table, " (expected [0, ", rows, "))");
      }
    }
    float* data = params->flat<float>().data();
    for (int64_t b = 0; b < batch; ++b) {
      if (b + kAhead < batch) {  // the table is far larger than the caches
        const float* ahead = data + id[(b + kAhead) * tables + table] * width;
        for (int64_t k = 0; k < width; k += kLanes) __builtin_prefetch(ahead + k, 1);
      }
      SubtractRow(data + id[b * tables + table] * width, update + b * total + offset, rate, width);
    }
    return Status();
  }

  std::vector<int64_t> widths_;
};

REGISTER_OP("DlrmEmbeddingSgd")
    .Attr("N: int >= 1")
    .Attr("widths: list(int) >= 1")
    .Attr("Tindices: {int32, int64}")
    .Attr("T: {float, bfloat16}")
    .Input("tables: N * resource")
    .Input("ids: Tindices")
    .Input("gradient: T")
    .Input("learning_rate: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext*) { return Status(); });

#define REGISTER(T, Index)                                               \
  REGISTER_KERNEL_BUILDER(Name("DlrmEmbeddingSgd")                       \
                              .Device(DEVICE_CPU)                        \
                              .TypeConstraint<T>("T")                    \
                              .TypeConstraint<Index>("Tindices"),        \
                          EmbeddingSgdOp<T, Index>);
REGISTER(float, int32_t)
REGISTER(float, int64_t)
REGISTER(Eigen::bfloat16, int32_t)
REGISTER(Eigen::bfloat16, int64_t)
#undef REGISTER

}  // namespace dlrm
