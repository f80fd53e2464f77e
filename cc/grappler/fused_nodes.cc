// fused_nodes.h: from a Plan to the fused ops' NodeDefs.

#include "cc/grappler/fused_nodes.h"

#include <cstdint>
#include <vector>

namespace tf_relupool {
namespace grappler {
namespace {

// The narrowest code type for windows of ksize (the window may be smaller at run time).
tensorflow::DataType ArgmaxType(const std::vector<int64_t>& ksize, bool nhwc) {
  const int64_t positions = ksize[nhwc ? 1 : 2] * ksize[nhwc ? 2 : 3];
  if (positions < 255) return tensorflow::DT_UINT8;
  if (positions < 65535) return tensorflow::DT_UINT16;
  return tensorflow::DT_INT32;
}

void SetPoolAttrs(const FusionPass& pass, const Plan& p, NodeDef* n) {
  const NodeDef& pool = pass.node(p.pool);
  auto* attr = n->mutable_attr();
  (*attr)["T"] = *Attr(pool, "T");
  (*attr)["padding"] = *Attr(pool, "padding");
  auto* ksize = (*attr)["ksize"].mutable_list();
  for (int64_t v : p.window.ksize) ksize->add_i(v);
  auto* strides = (*attr)["strides"].mutable_list();
  for (int64_t v : p.window.strides) strides->add_i(v);
  if (!p.window.explicit_paddings.empty()) {
    auto* pads = (*attr)["explicit_paddings"].mutable_list();
    for (int64_t v : p.window.explicit_paddings) pads->add_i(v);
  }
  (*attr)["data_format"].set_s(StringAttr(pool, "data_format", "NHWC"));
  (*attr)["implementation"].set_s("fused");
}

}  // namespace

bool WithArgmax(const FusionPass& pass, const Plan& p) {
  return p.pool_grad >= 0 && pass.mode() == kArgmax;
}

std::string PoolInput(const FusionPass& pass, const Plan& p) {
  return p.pad >= 0 ? pass.node(p.pad).name() : p.z;
}

void BuildForward(const FusionPass& pass, const Plan& p, NodeDef* fwd) {
  const NodeDef& pool = pass.node(p.pool);
  const NodeDef& relu = pass.node(p.relu);
  const NodeDef& named = p.relu_of_pool ? relu : pool;  // the node whose consumers it serves
  fwd->set_name(named.name());
  fwd->set_device(named.device());
  fwd->set_op(WithArgmax(pass, p) ? "ReluMaxPoolWithWindowArgmax" : "ReluMaxPool");
  fwd->add_input(PoolInput(pass, p));
  if (!p.fused_conv && p.pad < 0)
    for (const auto& c : ControlInputs(relu)) fwd->add_input(c);
  for (const auto& c : ControlInputs(pool)) fwd->add_input(c);
  SetPoolAttrs(pass, p, fwd);
  if (WithArgmax(pass, p)) {
    const bool nhwc = StringAttr(pool, "data_format", "NHWC") == "NHWC";
    (*fwd->mutable_attr())["Targmax"].set_type(ArgmaxType(p.window.ksize, nhwc));
  }
}

void BuildBackward(const FusionPass& pass, const Plan& p, const NodeDef& fwd,
                   const std::string& shape_name, NodeDef* bwd) {
  const NodeDef& pool = pass.node(p.pool);
  const NodeDef& pg = pass.node(p.pool_grad);
  const NodeDef& rg = pass.node(p.relu_grad);
  const NodeDef& named = p.pad >= 0 ? pg : rg;
  const std::string dy = DataInputs(pg)[2];
  bwd->set_name(named.name());
  bwd->set_device(named.device());
  if (WithArgmax(pass, p)) {
    bwd->set_op("ReluMaxPoolGradFromWindowArgmax");
    bwd->add_input(shape_name);
    bwd->add_input(dy);
    bwd->add_input(pool.name() + ":1");
  } else {
    bwd->set_op("ReluMaxPoolGrad");
    bwd->add_input(PoolInput(pass, p));
    bwd->add_input(dy);
  }
  for (const auto& c : ControlInputs(pg)) bwd->add_input(c);
  if (p.pad < 0)
    for (const auto& c : ControlInputs(rg)) bwd->add_input(c);
  SetPoolAttrs(pass, p, bwd);
  if (WithArgmax(pass, p)) {
    (*bwd->mutable_attr())["Targmax"] = fwd.attr().at("Targmax");
    (*bwd->mutable_attr())["Tshape"].set_type(tensorflow::DT_INT32);
    // The codes come straight from the fused forward: valid by construction (as ops.py's
    // gradient does; on a GPU this saves the host round trip that reports invalid codes).
    (*bwd->mutable_attr())["validate_window_argmax"].set_b(false);
  }
}

std::string KernelProblem(const FusionPass& pass, const Plan& p) {
  NodeDef fwd, bwd;
  BuildForward(pass, p, &fwd);
  if (!pass.KernelExists(fwd))
    return "no " + fwd.op() + " kernel for device '" + fwd.device() + "'";
  if (p.pool_grad >= 0) {
    BuildBackward(pass, p, fwd, "unused_shape_name", &bwd);
    if (!pass.KernelExists(bwd))
      return "no " + bwd.op() + " kernel for device '" + bwd.device() + "'";
  }
  return "";
}

}  // namespace grappler
}  // namespace tf_relupool
