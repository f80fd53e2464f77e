// Geometry and validation shared by every code path (shape functions, CPU and GPU kernels).
#include <string>

#include "relu_max_pool.h"

namespace tf_relupool {
namespace {

// Attribute values above this are refused so that no index product can overflow int64.
constexpr int64_t kMaxAttrValue = 2147483647;

std::string Str(int64_t v) { return std::to_string(v); }

std::string CheckOneAttr(const char* name, const int64_t* v, int len, DataFormat format) {
  if (len != 4) {
    return std::string(name) + " must have 4 elements (one per dimension of the input), got " +
           Str(len);
  }
  const int batch_dim = 0;
  const int channel_dim = format == DataFormat::kNHWC ? 3 : 1;
  for (int i = 0; i < 4; ++i) {
    if (v[i] <= 0) {
      return std::string(name) + "[" + Str(i) + "] must be >= 1, got " + Str(v[i]);
    }
    if (v[i] > kMaxAttrValue) {
      return std::string(name) + "[" + Str(i) + "] = " + Str(v[i]) + " is too large (at most " +
             Str(kMaxAttrValue) + ")";
    }
  }
  if (v[batch_dim] != 1 || v[channel_dim] != 1) {
    return std::string(name) + " must be 1 on the batch and channel dimensions (pooling is 2-D), got [" +
           Str(v[0]) + ", " + Str(v[1]) + ", " + Str(v[2]) + ", " + Str(v[3]) + "]";
  }
  return "";
}

}  // namespace

std::string CheckPoolAttrs(const int64_t* ksize, int ksize_len, const int64_t* strides,
                           int strides_len, DataFormat format) {
  std::string err = CheckOneAttr("ksize", ksize, ksize_len, format);
  if (err.empty()) err = CheckOneAttr("strides", strides, strides_len, format);
  return err;
}

int64_t PooledSize(int64_t in, int64_t window, int64_t stride, Padding padding) {
  if (in < 0) return -1;
  // The same values as ceil(in / stride) and max(0, (in - window + stride) / stride), written so
  // that no intermediate overflows for any in up to INT64_MAX (input_shape of the compact
  // gradient is user data).
  if (padding == Padding::kSame) return in == 0 ? 0 : (in - 1) / stride + 1;
  return in < window ? 0 : (in - window) / stride + 1;
}

std::string ComputePoolParams(const int64_t* input_dims, int input_rank, const int64_t* ksize,
                              int ksize_len, const int64_t* strides, int strides_len,
                              Padding padding, DataFormat format, PoolParams* p) {
  if (input_rank != 4) {
    return "input must be 4-D (" + std::string(format == DataFormat::kNHWC ? "NHWC" : "NCHW") +
           "), got rank " + Str(input_rank);
  }
  for (int i = 0; i < 4; ++i) {
    if (input_dims[i] < 0) return "input dimension " + Str(i) + " is negative: " + Str(input_dims[i]);
  }
  std::string err = CheckPoolAttrs(ksize, ksize_len, strides, strides_len, format);
  if (!err.empty()) return err;

  const bool nhwc = format == DataFormat::kNHWC;
  const int h = nhwc ? 1 : 2, w = nhwc ? 2 : 3, c = nhwc ? 3 : 1;
  p->format = format;
  p->batch = input_dims[0];
  p->in_rows = input_dims[h];
  p->in_cols = input_dims[w];
  p->channels = input_dims[c];
  p->window_rows = ksize[h];
  p->window_cols = ksize[w];
  p->stride_rows = strides[h];
  p->stride_cols = strides[w];
  p->out_rows = PooledSize(p->in_rows, p->window_rows, p->stride_rows, padding);
  p->out_cols = PooledSize(p->in_cols, p->window_cols, p->stride_cols, padding);
  p->pad_top = p->pad_left = 0;
  if (padding == Padding::kSame) {
    // TensorFlow puts the smaller half of the padding before the data.
    // (out - 1) * stride < in, so subtracting `in` before adding the window cannot overflow.
    const int64_t rows_total = ((p->out_rows - 1) * p->stride_rows - p->in_rows) + p->window_rows;
    const int64_t cols_total = ((p->out_cols - 1) * p->stride_cols - p->in_cols) + p->window_cols;
    p->pad_top = p->out_rows > 0 && rows_total > 0 ? rows_total / 2 : 0;
    p->pad_left = p->out_cols > 0 && cols_total > 0 ? cols_total / 2 : 0;
  }
  p->images = nhwc ? p->batch : p->batch * p->channels;
  p->lanes = nhwc ? p->channels : 1;
  p->code_pitch = p->window_cols < p->in_cols ? p->window_cols : p->in_cols;
  p->code_positions = (p->window_rows < p->in_rows ? p->window_rows : p->in_rows) * p->code_pitch;
  return "";
}

}  // namespace tf_relupool
