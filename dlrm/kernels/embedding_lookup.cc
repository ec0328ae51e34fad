// The one-hot lookups of many embedding tables as one op, writing the tables'
// vectors side by side.
//
// TensorFlow gathers each table on its own (ResourceGather) and concatenates the
// 26 results into the [B, 3328] vectors of the default model, a copy of the
// step's largest activation; autodiff then splits its gradient back into 26
// tables (SplitV), another copy. Together they took 42 ms of a 650 ms float32 step
// at batch 8192 (docs/performance.md). Here each sample's row of the output is
// written once, straight from the tables, and with DlrmEmbeddingApply
// (embedding_apply.cc), which reads the undivided gradient, neither copy is made.
//
// DlrmEmbeddingLookup: tables (N [rows_t, widths[t]] resource variables, each
// float32, bfloat16 or float16: 16-bit rows are widened to float32), ids ([B,
// N] int32 or int64, column t holding table t's ids) ->
// [B, widths[0] + ... + widths[N - 1]] (float32 or bfloat16, rounded to nearest
// even): row b is row ids[b, 0] of table 0, then row ids[b, 1] of table 1, ...
//
// Each table is read under its shared lock, as TensorFlow's own gathers do.
// An id outside its table is an error naming the table and the position.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

#include "bfloat16.h"
#include "rounding.h"

namespace dlrm {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::Var;
using tensorflow::errors::InvalidArgument;
namespace shape_inference = tensorflow::shape_inference;

// The rows are read from random places in tables far larger than the caches, so
// the copy waits on memory: the row kLookAhead rows on (in sample-major order) is
// asked for while this one is copied, one cache line at a time.
constexpr int64_t kLookAhead = 8;
constexpr int64_t kLineBytes = 64;

// A 16-bit table's row widened into float32.
inline void WidenRow(tensorflow::DataType dtype, const char* row, int64_t width, float* out) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
  if (dtype == tensorflow::DT_BFLOAT16) {
    for (int64_t k = 0; k < width; ++k) out[k] = WidenBfloat16Bits(bits[k]);
  } else {
    for (int64_t k = 0; k < width; ++k) out[k] = WidenHalfBits(bits[k]);
  }
}

template <typename T, typename Index>
class EmbeddingLookupOp : public OpKernel {
 public:
  explicit EmbeddingLookupOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("widths", &widths_));
  }

  void Compute(OpKernelContext* context) override {
    const int tables = static_cast<int>(widths_.size());
    OP_REQUIRES(context, context->num_inputs() == tables + 1,
                InvalidArgument("DlrmEmbeddingLookup: expected one width per table, got ",
                                widths_.size(), " widths for ", context->num_inputs() - 1,
                                " tables"));
    const Tensor& ids = context->input(tables);
    OP_REQUIRES(context, ids.dims() == 2 && ids.dim_size(1) == tables,
                InvalidArgument("DlrmEmbeddingLookup: expected ids [B, ", tables,
                                "] (one column per table), got ", ids.shape().DebugString()));
    const int64_t batch = ids.dim_size(0);
    std::vector<tensorflow::core::RefCountPtr<Var>> vars(tables);
    std::vector<tensorflow::tf_shared_lock> locks;
    locks.reserve(tables);
    std::vector<const char*> data(tables);
    std::vector<tensorflow::DataType> dtypes(tables);
    std::vector<int64_t> row_bytes(tables);
    std::vector<int64_t> rows(tables), offsets(tables);
    int64_t total = 0;
    for (int t = 0; t < tables; ++t) {
      OP_REQUIRES_OK(context, tensorflow::LookupResource(
                                  context, tensorflow::HandleFromInput(context, t), &vars[t]));
      locks.emplace_back(*vars[t]->mu());
      const Tensor* params = vars[t]->tensor();
      dtypes[t] = params->dtype();
      OP_REQUIRES(context,
                  (dtypes[t] == tensorflow::DT_FLOAT || dtypes[t] == tensorflow::DT_BFLOAT16 ||
                   dtypes[t] == tensorflow::DT_HALF) &&
                      params->dims() == 2 && params->dim_size(1) == widths_[t],
                  InvalidArgument("DlrmEmbeddingLookup: tables[", t, "] is ",
                                  tensorflow::DataTypeString(params->dtype()), " ",
                                  params->shape().DebugString(),
                                  "; expected float32, bfloat16 or float16 [rows, ", widths_[t],
                                  "]"));
      data[t] = static_cast<const char*>(params->tensor_data().data());
      row_bytes[t] = widths_[t] * tensorflow::DataTypeSize(dtypes[t]);
      rows[t] = params->dim_size(0);
      offsets[t] = total;
      total += widths_[t];
    }
    Tensor* output = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({batch, total}), &output));
    const Index* id = ids.flat<Index>().data();
    T* out = output->flat<T>().data();
    // The first id out of range, as (sample, table); batch when none.
    std::mutex mu;
    int64_t bad_sample = batch;
    int bad_table = 0;
    auto work = [&](int64_t start, int64_t limit) {
      // bfloat16: a sample's rows are copied into float32 here, then rounded in
      // one pass, so that the rounding does not sit between the reads.
      std::vector<float> staging(std::is_same_v<T, float> ? 0 : total);
      // Row i of this range is table i % tables of sample i / tables.
      for (int64_t i = start * tables; i < limit * tables; ++i) {
        const int64_t b = i / tables;
        const int t = static_cast<int>(i % tables);
        const int64_t ahead = i + kLookAhead;
        if (ahead < limit * tables) {
          const int a = static_cast<int>(ahead % tables);
          const Index row = id[ahead];
          if (row >= 0 && row < rows[a]) {  // out of range: reported when it is copied
            const char* line = data[a] + row * row_bytes[a];
            for (int64_t k = 0; k < row_bytes[a]; k += kLineBytes) __builtin_prefetch(line + k);
          }
        }
        const Index row = id[i];
        if (row < 0 || row >= rows[t]) {
          std::lock_guard<std::mutex> guard(mu);
          if (b < bad_sample) bad_sample = b, bad_table = t;
          return;
        }
        const char* found = data[t] + row * row_bytes[t];
        if constexpr (std::is_same_v<T, float>) {
          float* target = out + b * total + offsets[t];
          if (dtypes[t] == tensorflow::DT_FLOAT) {
            std::memcpy(target, found, row_bytes[t]);
          } else {
            WidenRow(dtypes[t], found, widths_[t], target);
          }
        } else {  // bfloat16's rounding (bfloat16.h)
          float* target = staging.data() + offsets[t];
          if (dtypes[t] == tensorflow::DT_FLOAT) {
            std::memcpy(target, found, row_bytes[t]);
          } else {
            WidenRow(dtypes[t], found, widths_[t], target);
          }
          if (t == tables - 1) Narrow(staging.data(), total, out + b * total);
        }
      }
    };
    auto* workers = context->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(workers->num_threads, workers->workers, batch, 2 * total, work);
    OP_REQUIRES(context, bad_sample == batch,
                InvalidArgument("DlrmEmbeddingLookup: ids[", bad_sample, ", ", bad_table,
                                "] = ", id[bad_sample * tables + bad_table],
                                " is not a row of table ", bad_table, " (expected [0, ",
                                rows[bad_table], "))"));
  }

 private:
  std::vector<int64_t> widths_;
};

REGISTER_OP("DlrmEmbeddingLookup")
    .Attr("N: int >= 1")
    .Attr("widths: list(int) >= 1")
    .Attr("Tindices: {int32, int64}")
    .Attr("T: {float, bfloat16}")
    .Input("tables: N * resource")
    .Input("ids: Tindices")
    .Output("vectors: T")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      std::vector<int64_t> widths;
      TF_RETURN_IF_ERROR(c->GetAttr("widths", &widths));
      int64_t total = 0;
      for (int64_t w : widths) total += w;
      shape_inference::ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(c->num_inputs() - 1), 2, &ids));
      c->set_output(0, c->Matrix(c->Dim(ids, 0), total));
      return Status();
    });

#define REGISTER(T, Index)                                               \
  REGISTER_KERNEL_BUILDER(Name("DlrmEmbeddingLookup")                    \
                              .Device(DEVICE_CPU)                        \
                              .TypeConstraint<T>("T")                    \
                              .TypeConstraint<Index>("Tindices"),        \
                          EmbeddingLookupOp<T, Index>);
REGISTER(float, int32_t)
REGISTER(float, int64_t)
REGISTER(Eigen::bfloat16, int32_t)
REGISTER(Eigen::bfloat16, int64_t)
#undef REGISTER

}  // namespace dlrm
