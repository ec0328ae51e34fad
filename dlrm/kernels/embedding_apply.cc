// One optimizer step (SGD, Adagrad, lazy Adam or row-wise Adagrad) on the looked-up rows of many
// embedding tables, straight from the gradient of the lookups' outputs.
//
// TensorFlow's path (dlrm/optim/optimizers.py's _apply_sparse) first cuts each
// table's gradient out of the lookups' [B, sum of D] gradient, then, for
// Adagrad and Adam, deduplicates it (tf.unique, unsorted_segment_sum) and
// applies it with ResourceSparseApplyAdagradV2, or Adam's gathers, arithmetic
// and three scatters: one table at a time, each op a pass over the rows. Here
// the rows are read where the gradient holds them, duplicates are summed once
// into a row's worth of float32, and the row's weights and slots are updated in
// the same pass, on all the intra-op threads.
//
// DlrmEmbeddingApply inputs: tables ([rows_t, D_t] resource variables, float32,
// bfloat16 or float16), slots (float32 whatever the table's dtype; table-major:
// none for sgd, [accumulator] for adagrad, [m, v] for adam, each of its table's
// shape; [accumulator] of shape [rows_t, 1] for rowwise_adagrad), and per piece
// (one table's part of one gradient tensor; pieces may share a tensor): ids ([n_p], global ids of
// table piece_tables[p]), rows ([n_p] int32: the row of gradients[p] that holds
// each id's gradient), gradients ([B_p, C_p] float32 or bfloat16; the table's
// D_t columns start at piece_columns[p]), row_scales ([B_p], or [0] for all 1);
// then learning_rate, gradient_scale, beta_1_power and beta_2_power (float32
// scalars; the powers are Adam's bias correction at this step), and step
// (int64: the optimizer's, for the random bits of 16-bit tables). A table's
// variable holds the rows [row_offsets[t], row_offsets[t] + rows_t) of its ids
// (a row-range shard): on a partial table ids outside are skipped, on another
// they are an error.
//
// Per table, with u = id - row_offsets[t]: G[u] = sum over the occurrences of
// u of gradient_scale * row_scale * (the piece's gradient row), in float32;
// then each row that occurs is updated once: sgd w -= lr G; adagrad acc += G^2,
// w -= lr G / (sqrt(acc) + epsilon); adam (lazy) m = beta_1 m + (1 - beta_1) G,
// v = beta_2 v + (1 - beta_2) G^2, w -= lr sqrt(1 - beta_2^t) / (1 - beta_1^t)
// m / (sqrt(v) + epsilon); rowwise_adagrad acc[u] += mean over the row's D_t
// values of G^2 (one value a row), w -= G * (lr / (sqrt(acc[u]) + epsilon)).
// SGD, which is linear, applies a table's occurrences
// one after the other when the table stays on one thread (the same update up
// to rounding, without the grouping).
//
// A 16-bit table's row is widened to float32, updated as above, and stored
// back with stochastic rounding (rounding.h): the random bits hash (seed, step,
// table_ids[t], the row's global id, column_offsets[t] + its column), so that
// a run repeats bit for bit on any threads and any ranks. Its rows are always
// grouped (rounded once per step).
//
// All ids and rows are checked before any variable changes: an error leaves
// every table and slot as it was.
//
// Locking and copy-on-read use TensorFlow's own helpers from the installed
// headers (tensorflow/core/kernels/training_op_helpers.h): they are templates
// compiled here, and what they call (LookupResource, HandleFromInput, the
// allocator and Eigen's thread pool device) is exported by
// libtensorflow_framework.so.2. MaybeLockVariableInputMutexesInOrder, as
// TensorFlow's sparse updates call it, puts every table and slot in
// copy-on-read mode (EnsureSparseVariableAccess: a buffer a reader still holds
// is copied first, and later reads copy) and locks them all, exclusively, in
// address order.

#define EIGEN_USE_THREADS

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "tensorflow/core/util/work_sharder.h"

#include "rounding.h"

namespace dlrm {
namespace {

using tensorflow::DEVICE_CPU;
using tensorflow::OpInputList;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::Var;
using tensorflow::errors::InvalidArgument;

constexpr char kOp[] = "DlrmEmbeddingApply: ";

// ------------------------------------------------------------- row arithmetic
//
// Compiled for AVX-512, AVX2 and baseline x86-64, the best picked when the
// library loads; elsewhere once, for the compiler's target.
#if defined(__x86_64__)
#define DLRM_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DLRM_CLONES
#endif

typedef float Lanes __attribute__((vector_size(64)));
typedef uint32_t Words __attribute__((vector_size(64)));
typedef uint16_t Halves __attribute__((vector_size(32)));
typedef float Quad __attribute__((vector_size(16)));
constexpr int64_t kLanes = 16;  // also the floats of a cache line
constexpr int64_t kQuad = 4;

// GCC vectorises no square root while sqrt may set errno (the kernels are built
// without -fno-math-errno), so the rows with one go 4 values at a time with
// SSE's sqrtps, which every x86-64 clone has. Dividers are as narrow on wider
// vectors, so this loses little.
inline Quad SquareRoot(Quad x) {
#if defined(__x86_64__)
  return __builtin_ia32_sqrtps(x);
#else
  for (int l = 0; l < kQuad; ++l) x[l] = __builtin_sqrtf(x[l]);
  return x;
#endif
}

// out += scale * in over `width` values.
DLRM_CLONES void AddScaled(float* out, const float* in, float scale, int64_t width) {
  int64_t k = 0;
  for (; k + kLanes <= width; k += kLanes) {
    Lanes o, i;
    std::memcpy(&o, out + k, sizeof(o));
    std::memcpy(&i, in + k, sizeof(i));
    o += scale * i;
    std::memcpy(out + k, &o, sizeof(o));
  }
  for (; k < width; ++k) out[k] += scale * in[k];
}

// The same from bfloat16, widened to float32 (a shift) 16 values at a time.
DLRM_CLONES void AddScaledBfloat16(float* out, const uint16_t* in, float scale, int64_t width) {
  int64_t k = 0;
  for (; k + kLanes <= width; k += kLanes) {
    Halves half;
    std::memcpy(&half, in + k, sizeof(half));
    const Words bits = __builtin_convertvector(half, Words) << 16;
    Lanes o, i;
    std::memcpy(&o, out + k, sizeof(o));
    std::memcpy(&i, &bits, sizeof(i));
    o += scale * i;
    std::memcpy(out + k, &o, sizeof(o));
  }
  for (; k < width; ++k) {
    const uint32_t bits = static_cast<uint32_t>(in[k]) << 16;
    float i;
    std::memcpy(&i, &bits, sizeof(i));
    out[k] += scale * i;
  }
}

inline void AddScaledRow(float* out, const float* in, float scale, int64_t width) {
  AddScaled(out, in, scale, width);
}
inline void AddScaledRow(float* out, const Eigen::bfloat16* in, float scale, int64_t width) {
  AddScaledBfloat16(out, reinterpret_cast<const uint16_t*>(in), scale, width);
}

// acc += g^2; w -= rate * g / (sqrt(acc) + epsilon): ResourceSparseApplyAdagradV2's row.
DLRM_CLONES void AdagradRow(float* w, float* acc, const float* g, float rate, float epsilon,
                            int64_t width) {
  int64_t k = 0;
  for (; k + kQuad <= width; k += kQuad) {
    Quad wq, aq, gq;
    std::memcpy(&wq, w + k, sizeof(wq));
    std::memcpy(&aq, acc + k, sizeof(aq));
    std::memcpy(&gq, g + k, sizeof(gq));
    aq += gq * gq;
    wq -= rate * gq / (SquareRoot(aq) + epsilon);
    std::memcpy(acc + k, &aq, sizeof(aq));
    std::memcpy(w + k, &wq, sizeof(wq));
  }
  for (; k < width; ++k) {
    acc[k] += g[k] * g[k];
    w[k] -= rate * g[k] / (__builtin_sqrtf(acc[k]) + epsilon);
  }
}

// m = beta_1 m + (1 - beta_1) g; v = beta_2 v + (1 - beta_2) g^2;
// w -= step * m / (sqrt(v) + epsilon), step carrying the bias correction.
struct AdamConstants {
  float beta_1, one_minus_beta_1, beta_2, one_minus_beta_2, step, epsilon;
};

DLRM_CLONES void AdamRow(float* w, float* m, float* v, const float* g, AdamConstants c,
                         int64_t width) {
  int64_t k = 0;
  for (; k + kQuad <= width; k += kQuad) {
    Quad wq, mq, vq, gq;
    std::memcpy(&wq, w + k, sizeof(wq));
    std::memcpy(&mq, m + k, sizeof(mq));
    std::memcpy(&vq, v + k, sizeof(vq));
    std::memcpy(&gq, g + k, sizeof(gq));
    mq = c.beta_1 * mq + c.one_minus_beta_1 * gq;
    vq = c.beta_2 * vq + c.one_minus_beta_2 * gq * gq;
    wq -= c.step * mq / (SquareRoot(vq) + c.epsilon);
    std::memcpy(m + k, &mq, sizeof(mq));
    std::memcpy(v + k, &vq, sizeof(vq));
    std::memcpy(w + k, &wq, sizeof(wq));
  }
  for (; k < width; ++k) {
    m[k] = c.beta_1 * m[k] + c.one_minus_beta_1 * g[k];
    v[k] = c.beta_2 * v[k] + c.one_minus_beta_2 * g[k] * g[k];
    w[k] -= c.step * m[k] / (__builtin_sqrtf(v[k]) + c.epsilon);
  }
}

// acc += mean of g^2 over the row; w -= g * (rate / (sqrt(acc) + epsilon)): one
// accumulator a row (FBGEMM's row-wise Adagrad). The squares are summed 16 at a
// time in float32, as TensorFlow's reduce_mean sums in blocks: the same to rounding.
DLRM_CLONES void RowwiseAdagradRow(float* w, float* acc, const float* g, float rate,
                                   float epsilon, int64_t width) {
  Lanes squares = {};
  int64_t k = 0;
  for (; k + kLanes <= width; k += kLanes) {
    Lanes gl;
    std::memcpy(&gl, g + k, sizeof(gl));
    squares += gl * gl;
  }
  if (width == 0) return;
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += squares[l];
  for (; k < width; ++k) sum += g[k] * g[k];
  *acc += sum / static_cast<float>(width);
  const float step = rate / (__builtin_sqrtf(*acc) + epsilon);
  AddScaled(w, g, -step, width);
}

// Asks for `bytes` at `address` from memory, one cache line at a time, for writing.
inline void Prefetch(const void* address, int64_t bytes) {
  const char* line = static_cast<const char*>(address);
  for (int64_t k = 0; k < bytes; k += 64) __builtin_prefetch(line + k, 1);
}

// ------------------------------------------------------------------- attrs

enum class Optimizer { kSgd, kAdagrad, kAdam, kRowwiseAdagrad };

struct Attributes {
  Optimizer optimizer = Optimizer::kSgd;
  std::vector<std::string> slot_names;  // of each table, in the order of `slots`
  bool row_wise_slots = false;          // slots [rows, 1], not the table's shape
  int num_tables = 0, num_slots = 0, num_pieces = 0;
  std::vector<int64_t> piece_tables, piece_columns, row_offsets;
  std::vector<bool> partial;
  float epsilon = 0, beta_1 = 0, beta_2 = 0;
  // Stochastic rounding of 16-bit tables: the run's seed, each table's index in
  // the model and its first column in the whole table (empty: t and 0).
  int64_t seed = 0;
  std::vector<int64_t> table_ids, column_offsets;
};

// Reads and checks the attrs; from the shape function (graph construction) and
// the kernel's constructor alike.
template <typename Context>
Status ReadAttributes(Context* c, Attributes* a) {
  std::string optimizer;
  TF_RETURN_IF_ERROR(c->GetAttr("optimizer", &optimizer));
  TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &a->num_tables));
  TF_RETURN_IF_ERROR(c->GetAttr("num_slots", &a->num_slots));
  TF_RETURN_IF_ERROR(c->GetAttr("num_pieces", &a->num_pieces));
  TF_RETURN_IF_ERROR(c->GetAttr("piece_tables", &a->piece_tables));
  TF_RETURN_IF_ERROR(c->GetAttr("piece_columns", &a->piece_columns));
  TF_RETURN_IF_ERROR(c->GetAttr("row_offsets", &a->row_offsets));
  TF_RETURN_IF_ERROR(c->GetAttr("partial", &a->partial));
  TF_RETURN_IF_ERROR(c->GetAttr("epsilon", &a->epsilon));
  TF_RETURN_IF_ERROR(c->GetAttr("beta_1", &a->beta_1));
  TF_RETURN_IF_ERROR(c->GetAttr("beta_2", &a->beta_2));
  TF_RETURN_IF_ERROR(c->GetAttr("seed", &a->seed));
  TF_RETURN_IF_ERROR(c->GetAttr("table_ids", &a->table_ids));
  TF_RETURN_IF_ERROR(c->GetAttr("column_offsets", &a->column_offsets));
  if (a->table_ids.empty()) {
    for (int t = 0; t < a->num_tables; ++t) a->table_ids.push_back(t);
  }
  if (a->column_offsets.empty()) a->column_offsets.assign(a->num_tables, 0);
  if (optimizer == "sgd") {
    a->optimizer = Optimizer::kSgd, a->slot_names = {};
  } else if (optimizer == "adagrad") {
    a->optimizer = Optimizer::kAdagrad, a->slot_names = {"accumulator"};
  } else if (optimizer == "rowwise_adagrad") {
    a->optimizer = Optimizer::kRowwiseAdagrad, a->slot_names = {"accumulator"};
    a->row_wise_slots = true;
  } else {
    a->optimizer = Optimizer::kAdam, a->slot_names = {"m", "v"};
  }
  const int per_table = static_cast<int>(a->slot_names.size());
  if (a->num_slots != per_table * a->num_tables) {
    std::string names;
    for (const std::string& name : a->slot_names) names += (names.empty() ? "" : ", ") + name;
    return InvalidArgument(kOp, "optimizer '", optimizer, "' keeps ", per_table,
                           " slot variable(s) per table (", names.empty() ? "none" : names,
                           "): expected ", per_table * a->num_tables, " slots for ",
                           a->num_tables, " table(s), got ", a->num_slots);
  }
  auto check_length = [&](const char* name, size_t length, int expected, const char* each) {
    return length == static_cast<size_t>(expected)
               ? Status()
               : InvalidArgument(kOp, name, " has ", length, " entries: expected one per ",
                                 each, " (", expected, ")");
  };
  TF_RETURN_IF_ERROR(check_length("piece_tables", a->piece_tables.size(), a->num_pieces, "piece"));
  TF_RETURN_IF_ERROR(
      check_length("piece_columns", a->piece_columns.size(), a->num_pieces, "piece"));
  TF_RETURN_IF_ERROR(check_length("row_offsets", a->row_offsets.size(), a->num_tables, "table"));
  TF_RETURN_IF_ERROR(check_length("partial", a->partial.size(), a->num_tables, "table"));
  TF_RETURN_IF_ERROR(check_length("table_ids", a->table_ids.size(), a->num_tables, "table"));
  TF_RETURN_IF_ERROR(
      check_length("column_offsets", a->column_offsets.size(), a->num_tables, "table"));
  for (int p = 0; p < a->num_pieces; ++p) {
    if (a->piece_tables[p] < 0 || a->piece_tables[p] >= a->num_tables) {
      return InvalidArgument(kOp, "piece_tables[", p, "] = ", a->piece_tables[p],
                             " is not a table (expected [0, ", a->num_tables, "))");
    }
    if (a->piece_columns[p] < 0) {
      return InvalidArgument(kOp, "piece_columns[", p, "] = ", a->piece_columns[p],
                             ": expected a column >= 0");
    }
  }
  return Status();
}

// 1 - beta for a beta written as a decimal (0.999) and rounded to float32 in
// its attr. 1 - 0.999f is 0.00099998713: the rounding of beta, relative 6e-8,
// becomes 1.3e-5 of the difference, which shows in Adam's v within a few
// steps. The shortest decimal that rounds to the attr is the value written, so
// the difference is taken from it in double: 0.001, as dlrm/optim/optimizers.py's
// Python arithmetic (1.0 - self.beta_2) gives it.
float Complement(float beta) {
  char text[32];
  for (int digits = 1; digits <= 9; ++digits) {  // 9 digits always give it back
    std::snprintf(text, sizeof(text), "%.*g", digits, static_cast<double>(beta));
    if (std::strtof(text, nullptr) == beta) break;
  }
  return static_cast<float>(1.0 - std::strtod(text, nullptr));
}

// ------------------------------------------------------------------- plan

// One piece's inputs.
template <typename T, typename Index>
struct Piece {
  const Index* ids;
  const int32_t* rows;
  const T* gradient;
  const float* scales;  // null: all 1
  int64_t count;        // ids
  int64_t batch;        // the gradient's rows
  int64_t stride;       // the gradient's columns
  int64_t column;       // where the table's columns start in a gradient row
};

// An occurrence of a row: the piece, and the row of its gradient.
struct Occurrence {
  int32_t piece;
  int32_t row;
};

struct Table {
  float* weights = nullptr;  // a float32 table's
  uint16_t* narrow = nullptr;  // a 16-bit table's (bfloat16 or float16 bits)
  tensorflow::DataType dtype = tensorflow::DT_FLOAT;
  uint64_t key = 0;  // of its rounding at this step
  int64_t column_offset = 0;
  float* slots[2] = {nullptr, nullptr};
  int64_t rows = 0, width = 0, offset = 0;
  int64_t slot_width = 0;  // the table's width, or 1 for row-wise slots
  bool partial = false;
  std::vector<int> pieces;
  int64_t ids = 0;  // over its pieces, in range or not
  // Whether its rows are grouped (summed before the update): always for
  // Adagrad and Adam; for SGD, when the table is split among threads.
  bool grouped = false;
  // The grouped rows (Plan says in which order): unique[k], the variable's
  // row, occurs as occurrences[starts[k]] .. occurrences[starts[k + 1] - 1].
  std::vector<int64_t> unique;
  std::vector<int64_t> starts;
  std::vector<Occurrence> occurrences;
};

// A share of the updates: a table's rows [begin, end) of `unique`, or all of
// an ungrouped table's occurrences.
struct Task {
  int table;
  int64_t begin, end;
  int64_t cost;
};

// Runs run(i) for i in [0, count) on the intra-op threads; each thread takes
// the next task when it is done, so tasks of unequal cost balance.
template <typename Run>
void RunTasks(OpKernelContext* context, int64_t count, const Run& run) {
  auto* workers = context->device()->tensorflow_cpu_worker_threads();
  const int64_t threads = std::min<int64_t>(workers->num_threads, count);
  if (threads <= 1) {
    for (int64_t i = 0; i < count; ++i) run(i);
    return;
  }
  std::atomic<int64_t> next{0};
  // One unit per thread, each far above the sharder's cost of a shard.
  tensorflow::Shard(static_cast<int>(threads), workers->workers, threads, int64_t{1} << 30,
                    [&](int64_t start, int64_t limit) {
                      for (int64_t unit = start; unit < limit; ++unit) {
                        for (int64_t i; (i = next.fetch_add(1)) < count;) run(i);
                      }
                    });
}

// Rows asked for from memory ahead of their update: the tables are far larger
// than the caches, and the gradient's rows are a page or more apart.
constexpr int64_t kAhead = 8;
// A table is split among threads in shares of at least this many rows.
constexpr int64_t kMinShare = 256;
// A grouped table's rows are counted over all its rows when it has no more than
// this many rows per id (an int32 each, a pass over them), else hashed.
constexpr int64_t kCountingSortRowsPerId = 16;

// The updates in shares of about equal cost, the largest first: an ungrouped
// table whole, a grouped one in ranges of its rows.
std::vector<Task> ShareOut(const std::vector<Table>& tables, int slots_per_table,
                           int64_t threads, int64_t total_cost) {
  const int64_t share = std::max<int64_t>(1, total_cost / (4 * threads));
  std::vector<Task> tasks;
  for (int t = 0; t < static_cast<int>(tables.size()); ++t) {
    const Table& table = tables[t];
    const int64_t width = std::max<int64_t>(table.width, 1);
    if (!table.grouped) {
      if (table.ids > 0) tasks.push_back({t, 0, 0, table.ids * width});
      continue;
    }
    const int64_t uniques = static_cast<int64_t>(table.unique.size());
    if (uniques == 0) continue;
    // A row: its occurrences' gradient rows, then the weights and slots.
    const int64_t occurrences = static_cast<int64_t>(table.occurrences.size());
    const int64_t row_cost =
        (occurrences / uniques + 1) * width + slots_per_table * table.slot_width;
    const int64_t step = std::max(kMinShare, share / row_cost);
    for (int64_t begin = 0; begin < uniques; begin += step) {
      const int64_t end = std::min(uniques, begin + step);
      tasks.push_back({t, begin, end, (end - begin) * row_cost});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return tasks;
}

template <typename T, typename Index>
class EmbeddingApplyOp : public OpKernel {
 public:
  explicit EmbeddingApplyOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, ReadAttributes(context, &attrs_));
  }

  void Compute(OpKernelContext* context) override {
    const int num_tables = attrs_.num_tables;
    const int num_slots = attrs_.num_slots;
    const int per_table = static_cast<int>(attrs_.slot_names.size());
    OpInputList ids, rows, gradients, row_scales;
    OP_REQUIRES_OK(context, context->input_list("ids", &ids));
    OP_REQUIRES_OK(context, context->input_list("rows", &rows));
    OP_REQUIRES_OK(context, context->input_list("gradients", &gradients));
    OP_REQUIRES_OK(context, context->input_list("row_scales", &row_scales));
    float scalars[4];
    const char* scalar_names[4] = {"learning_rate", "gradient_scale", "beta_1_power",
                                   "beta_2_power"};
    for (int i = 0; i < 4; ++i) {
      const Tensor* scalar;
      OP_REQUIRES_OK(context, context->input(scalar_names[i], &scalar));
      OP_REQUIRES(context, scalar->dims() == 0,
                  InvalidArgument(kOp, "expected a scalar ", scalar_names[i], ", got shape ",
                                  scalar->shape().DebugString()));
      scalars[i] = scalar->scalar<float>()();
    }
    const Tensor* step_input;
    OP_REQUIRES_OK(context, context->input("step", &step_input));
    OP_REQUIRES(context, step_input->dims() == 0,
                InvalidArgument(kOp, "expected a scalar step, got shape ",
                                step_input->shape().DebugString()));
    const int64_t step = step_input->scalar<int64_t>()();
    std::vector<Piece<T, Index>> pieces(attrs_.num_pieces);
    for (int p = 0; p < attrs_.num_pieces; ++p) {
      OP_REQUIRES_OK(context, ReadPiece(p, ids[p], rows[p], gradients[p], row_scales[p],
                                        &pieces[p]));
    }

    // The variables: checked, then locked, all of them, for the whole update.
    const int num_variables = num_tables + num_slots;
    std::vector<tensorflow::core::RefCountPtr<Var>> vars(num_variables);
    for (int i = 0; i < num_variables; ++i) {
      OP_REQUIRES_OK(context, tensorflow::LookupResource(
                                  context, tensorflow::HandleFromInput(context, i), &vars[i]));
      OP_REQUIRES_OK(context, CheckInitialized(vars[i].get(), i));
    }
    OP_REQUIRES_OK(context, CheckDistinct(vars));
    // Copy-on-read mode for the 16-bit tables, with their own dtype's copy (the
    // helper below would copy them as float32); it then leaves them be.
    for (int t = 0; t < num_tables; ++t) {
      const tensorflow::DataType dtype = vars[t]->tensor()->dtype();
      if (dtype == tensorflow::DT_BFLOAT16) {
        OP_REQUIRES_OK(context, tensorflow::EnsureSparseVariableAccess<tensorflow::CPUDevice,
                                                                        Eigen::bfloat16>(
                                    context, vars[t].get()));
      } else if (dtype == tensorflow::DT_HALF) {
        OP_REQUIRES_OK(context,
                       tensorflow::EnsureSparseVariableAccess<tensorflow::CPUDevice, Eigen::half>(
                           context, vars[t].get()));
      }
    }
    std::vector<int> inputs(num_variables);
    std::iota(inputs.begin(), inputs.end(), 0);
    const auto locks = tensorflow::MaybeLockVariableInputMutexesInOrder<tensorflow::CPUDevice,
                                                                         float>(
        context, /*do_lock=*/true, /*sparse=*/true, inputs);
    std::vector<Table> tables(num_tables);
    OP_REQUIRES_OK(context, ReadTables(context, vars, step, &tables));
    int64_t total_cost = 0;
    OP_REQUIRES_OK(context, AddPieces(pieces, &tables, &total_cost));

    // Group the rows where the optimizer needs their sums, or where a table is
    // more than one thread's share of SGD.
    auto* workers = context->device()->tensorflow_cpu_worker_threads();
    const int64_t threads = std::max(workers->num_threads, 1);
    for (Table& table : tables) {
      const int64_t cost = table.ids * std::max<int64_t>(table.width, 1);
      table.grouped = attrs_.optimizer != Optimizer::kSgd || table.narrow != nullptr ||
                      (table.ids >= 2 * kMinShare && cost * threads > total_cost);
    }

    // Check every occurrence (and group the grouped tables' rows), the largest
    // tables first; the first error, in table order, before any change.
    std::vector<int> order(num_tables);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return tables[a].ids > tables[b].ids; });
    std::vector<Status> status(num_tables);
    RunTasks(context, num_tables, [&](int64_t i) {
      const int t = order[i];
      status[t] = Plan(t, pieces, &tables[t]);
    });
    for (const Status& s : status) OP_REQUIRES_OK(context, s);

    const std::vector<Task> tasks = ShareOut(tables, per_table, threads, total_cost);
    int64_t max_width = 0;
    for (const Table& table : tables) max_width = std::max(max_width, table.width);
    const Constants constants = MakeConstants(scalars);
    RunTasks(context, static_cast<int64_t>(tasks.size()), [&](int64_t i) {
      const Task& task = tasks[i];
      const Table& table = tables[task.table];
      if (table.grouped) {
        std::vector<float> sum(max_width), row(table.narrow ? max_width : 0);
        ApplyGroups(table, pieces, task.begin, task.end, constants, sum.data(), row.data());
      } else {
        ApplyInTurn(table, pieces, constants);
      }
    });
  }

 private:
  struct Constants {
    float learning_rate, gradient_scale;
    AdamConstants adam;
  };

  Constants MakeConstants(const float* scalars) const {
    const float learning_rate = scalars[0];
    // As dlrm/optim/optimizers.py's Adam: the step size with the bias correction (the
    // powers of other optimizers may be 1).
    const float step = attrs_.optimizer != Optimizer::kAdam
                           ? 0.0f
                           : learning_rate * std::sqrt(1.0f - scalars[3]) / (1.0f - scalars[2]);
    const AdamConstants adam = {attrs_.beta_1, Complement(attrs_.beta_1), attrs_.beta_2,
                                Complement(attrs_.beta_2), step, attrs_.epsilon};
    return {learning_rate, scalars[1], adam};
  }

  Status ReadPiece(int p, const Tensor& ids, const Tensor& rows, const Tensor& gradient,
                   const Tensor& scales, Piece<T, Index>* piece) const {
    if (ids.dims() != 1) {
      return InvalidArgument(kOp, "ids[", p, "] is ", ids.shape().DebugString(),
                             ": expected a vector [n]");
    }
    if (rows.shape() != ids.shape()) {
      return InvalidArgument(kOp, "rows[", p, "] is ", rows.shape().DebugString(),
                             ": expected ids[", p, "]'s shape ", ids.shape().DebugString());
    }
    if (gradient.dims() != 2) {
      return InvalidArgument(kOp, "gradients[", p, "] is ", gradient.shape().DebugString(),
                             ": expected a matrix [B, C]");
    }
    const int64_t batch = gradient.dim_size(0);
    if (scales.dims() != 1 || (scales.dim_size(0) != batch && scales.dim_size(0) != 0)) {
      return InvalidArgument(kOp, "row_scales[", p, "] is ", scales.shape().DebugString(),
                             ": expected [", batch, "] (one per row of gradients[", p,
                             "]) or [0] (all 1)");
    }
    *piece = {ids.flat<Index>().data(),
              rows.flat<int32_t>().data(),
              gradient.flat<T>().data(),
              scales.NumElements() ? scales.flat<float>().data() : nullptr,
              ids.NumElements(),
              batch,
              gradient.dim_size(1),
              attrs_.piece_columns[p]};
    return Status();
  }

  // "tables[t]" or "slots[s] (m of table t)": the op's i-th variable input.
  std::string VariableName(int i) const {
    if (i < attrs_.num_tables) return tensorflow::strings::StrCat("tables[", i, "]");
    const int s = i - attrs_.num_tables;
    const int per_table = static_cast<int>(attrs_.slot_names.size());
    return tensorflow::strings::StrCat("slots[", s, "] (", attrs_.slot_names[s % per_table],
                                       " of table ", s / per_table, ")");
  }

  // Before the variables are locked together: a dtype the copy-on-read helpers
  // would misread, or no value, is an error. (A resource variable's dtype is
  // fixed, and it stays initialized once it is.)
  Status CheckInitialized(Var* var, int i) const {
    tensorflow::tf_shared_lock lock(*var->mu());
    if (!var->is_initialized) {
      return tensorflow::errors::FailedPrecondition(kOp, VariableName(i),
                                                    " is not initialized");
    }
    const tensorflow::DataType dtype = var->tensor()->dtype();
    const bool table = i < attrs_.num_tables;
    if (dtype != tensorflow::DT_FLOAT &&
        !(table && (dtype == tensorflow::DT_BFLOAT16 || dtype == tensorflow::DT_HALF))) {
      return InvalidArgument(kOp, VariableName(i), " is ", tensorflow::DataTypeString(dtype),
                             table ? ": expected float32, bfloat16 or float16"
                                   : ": expected float32");
    }
    return Status();
  }

  // Two inputs on one variable would be updated by two threads at once.
  Status CheckDistinct(const std::vector<tensorflow::core::RefCountPtr<Var>>& vars) const {
    std::vector<std::pair<const Var*, int>> sorted;
    for (int i = 0; i < static_cast<int>(vars.size()); ++i) sorted.emplace_back(vars[i].get(), i);
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 1; i < sorted.size(); ++i) {
      if (sorted[i].first == sorted[i - 1].first) {
        return InvalidArgument(kOp, VariableName(sorted[i - 1].second), " and ",
                               VariableName(sorted[i].second),
                               " are the same variable: expected distinct variables");
      }
    }
    return Status();
  }

  // The variable's data, to update in place; the caller holds its lock. In
  // copy-on-read mode no reader shares the buffer; should one still do (the
  // mode is set before the locks are taken), it is copied first, as
  // TensorFlow's dense updates do.
  template <typename Stored>
  static Status Writable(OpKernelContext* context, Var* var, Stored** data) {
    TF_RETURN_IF_ERROR(tensorflow::PrepareToUpdateVariable<tensorflow::CPUDevice, Stored>(
        context, var->tensor(), /*copy_on_read_mode=*/false));
    *data = var->tensor()->flat<Stored>().data();
    return Status();
  }

  // A table's data: float32 weights, or a 16-bit table's bits.
  static Status WritableTable(OpKernelContext* context, Var* var, Table* table) {
    table->dtype = var->tensor()->dtype();
    if (table->dtype == tensorflow::DT_FLOAT) return Writable(context, var, &table->weights);
    if (table->dtype == tensorflow::DT_BFLOAT16) {
      Eigen::bfloat16* data = nullptr;
      TF_RETURN_IF_ERROR(Writable(context, var, &data));
      table->narrow = reinterpret_cast<uint16_t*>(data);
    } else {
      Eigen::half* data = nullptr;
      TF_RETURN_IF_ERROR(Writable(context, var, &data));
      table->narrow = reinterpret_cast<uint16_t*>(data);
    }
    return Status();
  }

  // Under the variables' locks: each table's data, shape and slots.
  Status ReadTables(OpKernelContext* context,
                    const std::vector<tensorflow::core::RefCountPtr<Var>>& vars, int64_t step,
                    std::vector<Table>* tables) const {
    const int per_table = static_cast<int>(attrs_.slot_names.size());
    for (int t = 0; t < attrs_.num_tables; ++t) {
      Table& table = (*tables)[t];
      TF_RETURN_IF_ERROR(WritableTable(context, vars[t].get(), &table));
      table.key = TableRoundingKey(attrs_.seed, step, attrs_.table_ids[t]);
      table.column_offset = attrs_.column_offsets[t];
      const Tensor* params = vars[t]->tensor();
      if (params->dims() != 2) {
        return InvalidArgument(kOp, "tables[", t, "] is ", params->shape().DebugString(),
                               ": expected a matrix [rows, D]");
      }
      table.rows = params->dim_size(0);
      table.width = params->dim_size(1);
      table.offset = attrs_.row_offsets[t];
      table.partial = attrs_.partial[t];
      table.slot_width = attrs_.row_wise_slots ? 1 : table.width;
      const tensorflow::TensorShape slot_shape({table.rows, table.slot_width});
      for (int s = 0; s < per_table; ++s) {
        Var* slot = vars[attrs_.num_tables + t * per_table + s].get();
        if (slot->tensor()->shape() != slot_shape) {
          return InvalidArgument(kOp, "slots[", t * per_table + s, "] (", attrs_.slot_names[s],
                                 " of table ", t, ") is ", slot->tensor()->shape().DebugString(),
                                 ": expected ",
                                 attrs_.row_wise_slots ? "one value per row of its table "
                                                       : "its table's shape ",
                                 slot_shape.DebugString());
        }
        TF_RETURN_IF_ERROR(Writable(context, slot, &table.slots[s]));
      }
    }
    return Status();
  }

  // Gives each table its pieces, whose columns must lie in their gradients;
  // `total_cost`: the values of all ids' gradient rows.
  Status AddPieces(const std::vector<Piece<T, Index>>& pieces, std::vector<Table>* tables,
                   int64_t* total_cost) const {
    for (int p = 0; p < attrs_.num_pieces; ++p) {
      const int t = static_cast<int>(attrs_.piece_tables[p]);
      Table& table = (*tables)[t];
      const Piece<T, Index>& piece = pieces[p];
      if (piece.column + table.width > piece.stride) {
        return InvalidArgument(kOp, "piece ", p, " of table ", t, ": its columns [",
                               piece.column, ", ", piece.column + table.width,
                               ") are not inside gradients[", p, "]'s ", piece.stride,
                               " columns");
      }
      table.pieces.push_back(p);
      table.ids += piece.count;
      if (table.ids > std::numeric_limits<int32_t>::max()) {
        return InvalidArgument(kOp, "table ", t, " has ", table.ids,
                               " ids in its pieces: expected at most 2^31 - 1");
      }
      *total_cost += piece.count * std::max<int64_t>(table.width, 1);
    }
    return Status();
  }

  // Calls visit(p, row, u) for each occurrence of one of the table's rows u, in
  // piece order. With `check`: an error for a row outside its gradient, or an
  // id outside a whole table; without, such ids are skipped as a partial
  // table's.
  template <typename Visit>
  Status VisitOccurrences(int t, const std::vector<Piece<T, Index>>& pieces, const Table& table,
                          bool check, const Visit& visit) const {
    for (int p : table.pieces) {
      const Piece<T, Index>& piece = pieces[p];
      for (int64_t i = 0; i < piece.count; ++i) {
        const int32_t row = piece.rows[i];
        if (check && (row < 0 || row >= piece.batch)) {
          return InvalidArgument(kOp, "rows[", p, "][", i, "] = ", row,
                                 " is not a row of gradients[", p, "] (expected [0, ",
                                 piece.batch, "))");
        }
        const int64_t id = static_cast<int64_t>(piece.ids[i]);
        const int64_t u = id - table.offset;
        if (u < 0 || u >= table.rows) {
          if (table.partial || !check) continue;  // another shard's row
          return InvalidArgument(kOp, "ids[", p, "][", i, "] = ", id, " (piece ", p,
                                 " of table ", t, ") is not in the table's rows [",
                                 table.offset, ", ", table.offset + table.rows,
                                 ") and the table is not partial");
        }
        visit(p, row, u);
      }
    }
    return Status();
  }

  // Checks the table's occurrences and, for a grouped table, groups them by
  // row: a counting sort over the table's rows where the table is not much
  // larger than its ids (the rows then come in order, near each other in
  // memory), else an open-addressing hash (rows in order of first occurrence).
  Status Plan(int t, const std::vector<Piece<T, Index>>& pieces, Table* table) const {
    if (!table->grouped) {
      return VisitOccurrences(t, pieces, *table, true, [](int, int32_t, int64_t) {});
    }
    std::vector<int64_t>& unique = table->unique;
    std::vector<int64_t>& starts = table->starts;
    if (table->rows <= kCountingSortRowsPerId * table->ids) {
      // count[u], then where u's next occurrence goes.
      std::vector<int32_t> next(table->rows, 0);
      TF_RETURN_IF_ERROR(VisitOccurrences(t, pieces, *table, true,
                                          [&](int, int32_t, int64_t u) { ++next[u]; }));
      int32_t kept = 0;
      for (int64_t u = 0; u < table->rows; ++u) {
        if (next[u] == 0) continue;
        unique.push_back(u);
        starts.push_back(kept);
        const int32_t count = next[u];
        next[u] = kept;
        kept += count;
      }
      starts.push_back(kept);
      table->occurrences.resize(kept);
      return VisitOccurrences(t, pieces, *table, false, [&](int p, int32_t row, int64_t u) {
        table->occurrences[next[u]++] = {p, row};
      });
    }
    int64_t capacity = 16;
    while (capacity < 2 * table->ids) capacity <<= 1;
    const int shift = 64 - __builtin_ctzll(static_cast<uint64_t>(capacity));
    struct Entry {
      int64_t row;  // -1: empty
      int32_t unique;
    };
    std::vector<Entry> hash(capacity, Entry{-1, 0});
    std::vector<int32_t> which;  // each kept occurrence's unique row
    std::vector<Occurrence> kept;
    std::vector<int32_t> next;  // count of each unique row, then where its next occurrence goes
    which.reserve(table->ids), kept.reserve(table->ids);
    TF_RETURN_IF_ERROR(
        VisitOccurrences(t, pieces, *table, true, [&](int p, int32_t row, int64_t u) {
          uint64_t h = (static_cast<uint64_t>(u) * 0x9E3779B97F4A7C15ull) >> shift;
          while (hash[h].row != -1 && hash[h].row != u) h = (h + 1) & (capacity - 1);
          if (hash[h].row == -1) {
            hash[h] = {u, static_cast<int32_t>(unique.size())};
            unique.push_back(u);
            next.push_back(0);
          }
          which.push_back(hash[h].unique);
          kept.push_back({p, row});
          ++next[hash[h].unique];
        }));
    starts.resize(unique.size() + 1);
    starts[0] = 0;
    for (size_t k = 0; k < unique.size(); ++k) starts[k + 1] = starts[k] + next[k];
    std::copy(starts.begin(), starts.end() - 1, next.begin());
    table->occurrences.resize(kept.size());
    for (size_t j = 0; j < kept.size(); ++j) table->occurrences[next[which[j]]++] = kept[j];
    return Status();
  }

  // SGD on an ungrouped table: each occurrence in turn, its row on this thread.
  static void ApplyInTurn(const Table& table, const std::vector<Piece<T, Index>>& pieces,
                          const Constants& constants) {
    const int64_t width = table.width;
    const float rate = -constants.learning_rate * constants.gradient_scale;
    for (int p : table.pieces) {
      const Piece<T, Index>& piece = pieces[p];
      for (int64_t i = 0; i < piece.count; ++i) {
        if (i + kAhead < piece.count) {
          const int64_t ahead = static_cast<int64_t>(piece.ids[i + kAhead]) - table.offset;
          if (ahead >= 0 && ahead < table.rows) {
            Prefetch(table.weights + ahead * width, width * sizeof(float));
          }
          Prefetch(piece.gradient + piece.rows[i + kAhead] * piece.stride + piece.column,
                   width * sizeof(T));
        }
        const int64_t u = static_cast<int64_t>(piece.ids[i]) - table.offset;
        if (u < 0 || u >= table.rows) continue;  // a partial table's other rows
        const int32_t row = piece.rows[i];
        const float scale = piece.scales ? rate * piece.scales[row] : rate;
        AddScaledRow(table.weights + u * width, piece.gradient + row * piece.stride + piece.column,
                     scale, width);
      }
    }
  }

  // The grouped rows [begin, end) of a table: each one's gradient summed in
  // `sum`, then its weights and slots updated.
  void ApplyGroups(const Table& table, const std::vector<Piece<T, Index>>& pieces,
                   int64_t begin, int64_t end, const Constants& constants, float* sum,
                   float* row) const {
    const int64_t stored_bytes = table.narrow ? sizeof(uint16_t) : sizeof(float);
    const int64_t width = table.width;
    const int per_table = static_cast<int>(attrs_.slot_names.size());
    for (int64_t k = begin; k < end; ++k) {
      if (k + kAhead < end) {
        const int64_t ahead = table.unique[k + kAhead];
        Prefetch(table.narrow ? static_cast<const void*>(table.narrow + ahead * width)
                              : static_cast<const void*>(table.weights + ahead * width),
                 width * stored_bytes);
        for (int s = 0; s < per_table; ++s) {
          Prefetch(table.slots[s] + ahead * table.slot_width, table.slot_width * sizeof(float));
        }
        const Occurrence& first = table.occurrences[table.starts[k + kAhead]];
        const Piece<T, Index>& piece = pieces[first.piece];
        Prefetch(piece.gradient + first.row * piece.stride + piece.column, width * sizeof(T));
      }
      std::fill(sum, sum + width, 0.0f);
      for (int64_t o = table.starts[k]; o < table.starts[k + 1]; ++o) {
        const Occurrence& occurrence = table.occurrences[o];
        const Piece<T, Index>& piece = pieces[occurrence.piece];
        const float scale = piece.scales
                                ? constants.gradient_scale * piece.scales[occurrence.row]
                                : constants.gradient_scale;
        AddScaledRow(sum, piece.gradient + occurrence.row * piece.stride + piece.column, scale,
                     width);
      }
      const int64_t at = table.unique[k] * width;
      const int64_t slot_at = table.unique[k] * table.slot_width;
      float* weights = table.weights + at;
      if (table.narrow) {  // the row in float32 here, rounded back below
        weights = row;
        WidenStored(table.dtype, table.narrow + at, width, row);
      }
      switch (attrs_.optimizer) {
        case Optimizer::kSgd:
          AddScaled(weights, sum, -constants.learning_rate, width);
          break;
        case Optimizer::kAdagrad:
          AdagradRow(weights, table.slots[0] + at, sum, constants.learning_rate, attrs_.epsilon,
                     width);
          break;
        case Optimizer::kAdam:
          AdamRow(weights, table.slots[0] + at, table.slots[1] + at, sum, constants.adam, width);
          break;
        case Optimizer::kRowwiseAdagrad:
          RowwiseAdagradRow(weights, table.slots[0] + slot_at, sum, constants.learning_rate,
                            attrs_.epsilon, width);
          break;
      }
      if (table.narrow) {
        const uint64_t row_key = Mix(table.key ^ static_cast<uint64_t>(table.unique[k] +
                                                                       table.offset));
        RoundStored(table.dtype, row, width, row_key, table.column_offset, table.narrow + at);
      }
    }
  }

  static void WidenStored(tensorflow::DataType dtype, const uint16_t* in, int64_t width,
                          float* out) {
    if (dtype == tensorflow::DT_BFLOAT16) {
      for (int64_t k = 0; k < width; ++k) out[k] = WidenBfloat16Bits(in[k]);
    } else {
      for (int64_t k = 0; k < width; ++k) out[k] = WidenHalfBits(in[k]);
    }
  }

  static void RoundStored(tensorflow::DataType dtype, const float* in, int64_t width,
                          uint64_t row_key, int64_t column_offset, uint16_t* out) {
    for (int64_t k = 0; k < width; ++k) {
      const uint64_t hash = Mix(row_key ^ static_cast<uint64_t>(column_offset + k));
      out[k] = dtype == tensorflow::DT_BFLOAT16 ? RoundBfloat16(in[k], hash)
                                                : RoundHalf(in[k], hash);
    }
  }

  Attributes attrs_;
};

}  // namespace

REGISTER_OP("DlrmEmbeddingApply")
    .Input("tables: num_tables * resource")
    .Input("slots: num_slots * resource")
    .Input("ids: num_pieces * Tid")
    .Input("rows: num_pieces * int32")
    .Input("gradients: num_pieces * T")
    .Input("row_scales: num_pieces * float")
    .Input("learning_rate: float")
    .Input("gradient_scale: float")
    .Input("beta_1_power: float")
    .Input("beta_2_power: float")
    .Input("step: int64")
    .Attr("optimizer: {'sgd', 'adagrad', 'adam', 'rowwise_adagrad'}")
    .Attr("piece_tables: list(int)")
    .Attr("piece_columns: list(int)")
    .Attr("row_offsets: list(int)")
    .Attr("partial: list(bool)")
    .Attr("epsilon: float = 1e-7")
    .Attr("beta_1: float = 0.9")
    .Attr("beta_2: float = 0.999")
    .Attr("seed: int = 0")
    .Attr("table_ids: list(int) = []")
    .Attr("column_offsets: list(int) = []")
    .Attr("num_tables: int >= 1")
    .Attr("num_slots: int >= 0")
    .Attr("num_pieces: int >= 0")
    .Attr("Tid: {int32, int64} = DT_INT32")
    .Attr("T: {float, bfloat16} = DT_FLOAT")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      Attributes attrs;
      TF_RETURN_IF_ERROR(ReadAttributes(c, &attrs));
      tensorflow::shape_inference::ShapeHandle scalar;
      for (int i = c->num_inputs() - 5; i < c->num_inputs(); ++i) {
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &scalar));
      }
      return Status();
    });

#define REGISTER(T, Index)                                          \
  REGISTER_KERNEL_BUILDER(Name("DlrmEmbeddingApply")                \
                              .Device(DEVICE_CPU)                   \
                              .TypeConstraint<T>("T")               \
                              .TypeConstraint<Index>("Tid"),        \
                          EmbeddingApplyOp<T, Index>);
REGISTER(float, int32_t)
REGISTER(float, int64_t)
REGISTER(Eigen::bfloat16, int32_t)
REGISTER(Eigen::bfloat16, int64_t)
#undef REGISTER

}  // namespace dlrm
