// pad_link.h: the Pad of the pattern pool(pad(relu(z))).

#include "cc/grappler/pad_link.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace tf_relupool {
namespace grappler {
namespace {

const OpSet IsShapeOnly({"shape_only"});

}  // namespace

std::string PadProblem(const FusionPass& pass, const NodeDef& pad) {
  if (pad.op() == "Pad") return "";
  const std::vector<std::string> in = DataInputs(pad);
  tensorflow::Tensor c;
  if (in.size() != 3 || !pass.ConstInput(in[2], &c) || c.NumElements() != 1)
    return "has no constant constant_values";
  double v;
  switch (c.dtype()) {
    case tensorflow::DT_HALF: v = static_cast<float>(c.flat<Eigen::half>()(0)); break;
    case tensorflow::DT_BFLOAT16: v = static_cast<float>(c.flat<Eigen::bfloat16>()(0)); break;
    case tensorflow::DT_FLOAT: v = c.flat<float>()(0); break;
    case tensorflow::DT_DOUBLE: v = c.flat<double>()(0); break;
    default: return "constant_values of an unsupported dtype";
  }
  if (std::isnan(v) || std::signbit(v)) return "pads with a negative or NaN value";
  return "";
}

bool IsPadBefore(const FusionPass& pass, const std::string& begin, const std::string& paddings) {
  std::vector<int64_t> values;
  tensorflow::Tensor pads;
  if (pass.ConstInts(begin, &values)) {
    if (!pass.ConstInput(paddings, &pads) || pads.dims() != 2 || pads.dim_size(1) != 2 ||
        pads.dim_size(0) != static_cast<int64_t>(values.size()))
      return false;
    for (size_t d = 0; d < values.size(); ++d) {
      const int64_t before = pads.dtype() == tensorflow::DT_INT32
                                 ? pads.matrix<int32_t>()(d, 0)
                                 : pads.dtype() == tensorflow::DT_INT64
                                       ? pads.matrix<int64_t>()(d, 0)
                                       : -1;
      if (before != values[d]) return false;
    }
    return true;
  }
  const int reshape_i = IsControl(begin) ? -1 : pass.Find(ParseInput(begin).node);
  if (reshape_i < 0 || ParseInput(begin).index != 0 || pass.node(reshape_i).op() != "Reshape")
    return false;
  const std::vector<std::string> r_in = DataInputs(pass.node(reshape_i));
  if (r_in.size() != 2 || !pass.ConstInts(r_in[1], &values) || values != std::vector<int64_t>{-1})
    return false;
  const Input cut = ParseInput(r_in[0]);
  const int cut_i = pass.Find(cut.node);
  if (cut_i < 0 || cut.index != 0 || pass.node(cut_i).op() != "Slice") return false;
  const std::vector<std::string> c_in = DataInputs(pass.node(cut_i));
  if (c_in.size() != 3 || ParseInput(c_in[0]).node != ParseInput(paddings).node ||
      ParseInput(c_in[0]).index != ParseInput(paddings).index)
    return false;
  if (!pass.ConstInts(c_in[1], &values) || values != std::vector<int64_t>{0, 0}) return false;
  // size [rank, 1]: a constant, or Pack(rank, 1).
  if (pass.ConstInts(c_in[2], &values)) return values.size() == 2 && values[1] == 1;
  const Input size = ParseInput(c_in[2]);
  const int size_i = pass.Find(size.node);
  if (size_i < 0 || size.index != 0 || pass.node(size_i).op() != "Pack") return false;
  const std::vector<std::string> p_in = DataInputs(pass.node(size_i));
  tensorflow::Tensor one;
  if (p_in.size() != 2 || !pass.ConstInput(p_in[1], &one) || one.NumElements() != 1) return false;
  if (one.dtype() == tensorflow::DT_INT32) return one.flat<int32_t>()(0) == 1;
  if (one.dtype() == tensorflow::DT_INT64) return one.flat<int64_t>()(0) == 1;
  return false;
}

std::string PadConsumersProblem(const FusionPass& pass, Plan* p, tensorflow::DataType t) {
  const NodeDef& pool = pass.node(p->pool);
  std::vector<std::string> others;
  for (const auto& c : pass.Consumers(pass.node(p->pad).name(), 0)) {
    const NodeDef& n = pass.node(c.first);
    if (c.first == p->pool && c.second == 0) continue;
    if (c.second == 0 && p->pool_grad < 0 && pass.IsGradOf(n, pool, p->window, t)) {
      p->pool_grad = c.first;
      continue;
    }
    if (IsShapeOnly(n)) continue;  // same shape after the rewrite
    others.push_back(n.name());
  }
  return others.empty() ? "" : "the Pad has other consumers: " + FusionPass::NameList(others);
}

// The Pad's gradient: ReluGrad(Slice(MaxPoolGrad, begin, size), Relu) with begin the Pad's
// leading paddings (array_grad.py, _PadGrad; constant-folded). ReluGrad needs its two inputs of
// one shape, so the Slice's output has z's shape: it cuts exactly the unpadded z out of the
// padded gradient, also out of the fused op's.
std::string PadGradientProblem(const FusionPass& pass, Plan* p, tensorflow::DataType t) {
  const NodeDef& pg = pass.node(p->pool_grad);
  const auto& users = pass.Consumers(pg.name(), 0);
  p->slice = users.size() == 1 && users[0].second == 0 ? users[0].first : -1;
  if (p->slice < 0 || pass.node(p->slice).op() != "Slice")
    return "its MaxPoolGrad '" + pg.name() + "' does not feed exactly a Slice";
  const NodeDef& slice = pass.node(p->slice);
  const auto& slice_users = pass.Consumers(slice.name(), 0);
  if (slice_users.size() != 1 || slice_users[0].first != p->relu_grad ||
      slice_users[0].second != 0 || pass.HasOtherPorts(slice.name()) || pass.Preserved(p->slice) ||
      TypeAttr(slice, "T") != t)
    return "the Slice '" + slice.name() + "' does not feed exactly its ReluGrad";
  const std::vector<std::string> slice_in = DataInputs(slice);
  const std::vector<std::string> pad_in = DataInputs(pass.node(p->pad));
  if (slice_in.size() != 3 || pad_in.size() < 2 || !IsPadBefore(pass, slice_in[1], pad_in[1]))
    return "the Slice '" + slice.name() + "' is not the Pad's gradient (its begin is not the "
           "Pad's leading paddings)";
  return "";
}

}  // namespace grappler
}  // namespace tf_relupool
