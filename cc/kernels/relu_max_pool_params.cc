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

std::string CheckExplicitPaddings(Padding padding, const int64_t* paddings, int paddings_len,
                                  const int64_t* ksize, DataFormat format) {
  if (padding != Padding::kExplicit) {
    if (paddings_len == 0) return "";
    return "explicit_paddings must be empty unless padding is EXPLICIT, got " +
           Str(paddings_len) + " elements with padding " +
           (padding == Padding::kSame ? "SAME" : "VALID");
  }
  if (paddings_len != 8) {
    return "explicit_paddings must have 8 elements (before and after each dimension of the "
           "input) with padding EXPLICIT, got " + Str(paddings_len);
  }
  const int channel_dim = format == DataFormat::kNHWC ? 3 : 1;
  for (int d = 0; d < 4; ++d) {
    for (int side = 0; side < 2; ++side) {
      const int64_t v = paddings[2 * d + side];
      const std::string at = "explicit_paddings[" + Str(2 * d + side) + "] = " + Str(v);
      if (d == 0 || d == channel_dim) {
        if (v != 0) return at + ": the batch and channel dimensions cannot be padded";
      } else if (v < 0) {
        return at + " must be >= 0";
      } else if (v >= ksize[d]) {
        return at + " must be smaller than the window size " + Str(ksize[d]) +
               " along that dimension";
      }
    }
  }
  return "";
}

int64_t PooledSize(int64_t in, int64_t window, int64_t stride, Padding padding,
                   int64_t pad_before, int64_t pad_after) {
  if (in < 0) return -1;
  // The same values as ceil(in / stride) and max(0, (in - window + stride) / stride), written so
  // that no intermediate overflows for any in up to INT64_MAX (input_shape of the compact
  // gradient is user data).
  if (padding == Padding::kSame) return in == 0 ? 0 : (in - 1) / stride + 1;
  if (padding == Padding::kExplicit) {
    // Pads are below the window size (CheckExplicitPaddings), so window - pads > -window: the
    // comparison and the subtraction stay in range.
    const int64_t reach = window - pad_before - pad_after;  // rows the input must supply
    if (reach > 0) return in < reach ? 0 : (in - reach) / stride + 1;
    return in / stride + (in % stride - reach) / stride + 1;  // (in - reach) might overflow
  }
  return in < window ? 0 : (in - window) / stride + 1;
}

std::string ComputePoolParams(const int64_t* input_dims, int input_rank, const int64_t* ksize,
                              int ksize_len, const int64_t* strides, int strides_len,
                              Padding padding, DataFormat format, PoolParams* p,
                              const int64_t* explicit_paddings, int explicit_paddings_len) {
  if (input_rank != 4) {
    return "input must be 4-D (" + std::string(format == DataFormat::kNHWC ? "NHWC" : "NCHW") +
           "), got rank " + Str(input_rank);
  }
  for (int i = 0; i < 4; ++i) {
    if (input_dims[i] < 0) return "input dimension " + Str(i) + " is negative: " + Str(input_dims[i]);
  }
  std::string err = CheckPoolAttrs(ksize, ksize_len, strides, strides_len, format);
  if (err.empty() && padding == Padding::kExplicit) {
    err = CheckExplicitPaddings(padding, explicit_paddings,
                                explicit_paddings == nullptr ? 0 : explicit_paddings_len, ksize,
                                format);
  }
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
  const bool explicit_pads = padding == Padding::kExplicit;
  const int64_t top = explicit_pads ? explicit_paddings[2 * h] : 0;
  const int64_t bottom = explicit_pads ? explicit_paddings[2 * h + 1] : 0;
  const int64_t left = explicit_pads ? explicit_paddings[2 * w] : 0;
  const int64_t right = explicit_pads ? explicit_paddings[2 * w + 1] : 0;
  p->out_rows = PooledSize(p->in_rows, p->window_rows, p->stride_rows, padding, top, bottom);
  p->out_cols = PooledSize(p->in_cols, p->window_cols, p->stride_cols, padding, left, right);
  p->pad_top = p->out_rows > 0 ? top : 0;
  p->pad_left = p->out_cols > 0 ? left : 0;
  if (explicit_pads && p->batch > 0 && p->channels > 0 &&
      ((p->in_rows == 0 && p->out_rows > 0 && p->out_cols > 0) ||
       (p->in_cols == 0 && p->out_cols > 0 && p->out_rows > 0))) {
    // Every window would be padding only (stock MaxPool fills them with the lowest value).
    return "input has no " + std::string(p->in_rows == 0 ? "rows" : "columns") +
           " but explicit_paddings make windows of padding only: not supported";
  }
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
