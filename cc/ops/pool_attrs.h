// Glue between TensorFlow attributes/shapes and the framework-free geometry in
// cc/kernels/relu_max_pool.h, shared by the shape functions and the OpKernels.
#ifndef TF_RELUPOOL_CC_OPS_POOL_ATTRS_H_
#define TF_RELUPOOL_CC_OPS_POOL_ATTRS_H_

#include <string>
#include <vector>

#include "cc/kernels/relu_max_pool.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/platform/status.h"

namespace tf_relupool {

struct PoolAttrs {
  std::vector<int64_t> ksize, strides;
  std::vector<int64_t> explicit_paddings;  // 8 entries with padding EXPLICIT, else empty
  Padding padding = Padding::kValid;
  DataFormat format = DataFormat::kNHWC;
};

// Reads ksize, strides, padding and data_format from any attribute source (OpKernelConstruction
// or InferenceContext) and checks them once.
template <typename AttrSource>
absl::Status ReadPoolAttrs(AttrSource* src, PoolAttrs* attrs) {
  std::string padding, format;
  TF_RETURN_IF_ERROR(src->GetAttr("ksize", &attrs->ksize));
  TF_RETURN_IF_ERROR(src->GetAttr("strides", &attrs->strides));
  TF_RETURN_IF_ERROR(src->GetAttr("padding", &padding));
  TF_RETURN_IF_ERROR(src->GetAttr("data_format", &format));
  attrs->padding = padding == "SAME"       ? Padding::kSame
                    : padding == "EXPLICIT" ? Padding::kExplicit
                                            : Padding::kValid;
  attrs->format = format == "NCHW" ? DataFormat::kNCHW : DataFormat::kNHWC;
  std::vector<int64_t> paddings;
  if (!src->GetAttr("explicit_paddings", &paddings).ok()) paddings.clear();
  std::string err =
      CheckPoolAttrs(attrs->ksize.data(), static_cast<int>(attrs->ksize.size()),
                     attrs->strides.data(), static_cast<int>(attrs->strides.size()), attrs->format);
  if (err.empty()) {
    err = CheckExplicitPaddings(attrs->padding, paddings.data(), static_cast<int>(paddings.size()),
                                attrs->ksize.data(), attrs->format);
  }
  if (!err.empty()) return absl::InvalidArgumentError(err);
  attrs->explicit_paddings = paddings;  // empty unless padding is EXPLICIT (checked above)
  return absl::OkStatus();
}

inline absl::Status MakePoolParams(const PoolAttrs& attrs, const tensorflow::TensorShape& input,
                                   PoolParams* params) {
  std::vector<int64_t> dims(input.dims());
  for (int i = 0; i < input.dims(); ++i) dims[i] = input.dim_size(i);
  const std::string err = ComputePoolParams(
      dims.data(), input.dims(), attrs.ksize.data(), static_cast<int>(attrs.ksize.size()),
      attrs.strides.data(), static_cast<int>(attrs.strides.size()), attrs.padding, attrs.format,
      params, attrs.explicit_paddings.data(), static_cast<int>(attrs.explicit_paddings.size()));
  if (!err.empty()) return absl::InvalidArgumentError(err);
  return absl::OkStatus();
}

// The pooled output's shape, in the input's data format.
inline tensorflow::TensorShape PooledShape(const PoolParams& p) {
  if (p.format == DataFormat::kNHWC) {
    return tensorflow::TensorShape({p.batch, p.out_rows, p.out_cols, p.channels});
  }
  return tensorflow::TensorShape({p.batch, p.channels, p.out_rows, p.out_cols});
}

}  // namespace tf_relupool

#endif  // TF_RELUPOOL_CC_OPS_POOL_ATTRS_H_
