// The pattern table: what tf_relupool fuses, in one place. Each role names the op types that can
// play one part of a pattern; each pattern is a chain of roles from the pool's output back to z,
// with the fusers that match it: the Grappler pass (the matcher of its family, matchers.h, also
// behind tf_relupool.rewrite_graph) and the trace-time fusion under XLA
// (tf_relupool/keras_fusion.py). The trace-time part is also held in Python
// (tf_relupool/patterns.py), so that the XLA route needs no library; a test checks that it equals
// this table as tf_relupool_grappler_patterns (plugin.cc) exports it. A role or pattern added here
// must be added there too; tests/test_patterns.py builds every pattern of the table with every op
// of its roles and checks that each fuser it names fuses it.
#ifndef TF_RELUPOOL_CC_GRAPPLER_PATTERNS_H_
#define TF_RELUPOOL_CC_GRAPPLER_PATTERNS_H_

#include <string>
#include <string_view>
#include <unordered_set>

namespace tf_relupool {
namespace grappler {

struct Role {
  const char* name;
  const char* ops[5];  // nullptr-terminated
  const char* condition;  // what the op must satisfy besides its type ("" when nothing)
};

inline constexpr Role kRoles[] = {
    {"pool", {"MaxPool", "MaxPoolV2", nullptr}, "2-D, window as attrs or constant inputs"},
    {"pool_grad", {"MaxPoolGrad", "MaxPoolGradV2", nullptr}, "the gradient of the pool"},
    {"relu", {"Relu", nullptr}, ""},
    {"relu_grad", {"ReluGrad", nullptr}, "the gradient of the relu"},
    {"fused_conv_relu", {"_FusedConv2D", nullptr}, "fused_ops ending in Relu (TF's remapper)"},
    {"pad", {"Pad", "PadV2", nullptr}, "constant paddings, a pad value c with relu(c) == c"},
    {"monotone", {"Relu6", "LeakyRelu", nullptr},
     "non-decreasing, its gradient a select on its output (LeakyRelu: alpha >= 0)"},
    {"shape_only", {"Shape", "ShapeN", "Rank", "Size", nullptr},
     "reads only the relu's shape (rewired to z)"},
};

enum Fuser : int { kGrappler = 1, kTraceTime = 2 };

struct Pattern {
  const char* name;
  const char* chain;  // roles from the pool's output back to z
  int fusers;         // Fuser bits
  bool gradient;      // its gradient (relu_grad(pool_grad(...))) is fused too
  const char* note;
};

inline constexpr Pattern kPatterns[] = {
    {"relu_max_pool", "pool(relu(z))", kGrappler | kTraceTime, true, ""},
    {"relu_pad_max_pool", "pool(pad(relu(z)))", kGrappler | kTraceTime, true,
     "ZeroPadding2D between: relu(pad(z)) == pad(relu(z)); the gradient through the Pad's Slice"},
    {"fused_conv_relu_max_pool", "pool(fused_conv_relu(z))", kGrappler, true,
     "Keras Conv2D(activation=\"relu\") after TF's remapper; the convolution stays"},
    {"monotone_max_pool", "pool(monotone(z))", kTraceTime, true,
     "max_pool(f(z)) for a non-decreasing f: the first maximum of f(z), f's stock gradient read "
     "from the pooled output"},
    {"max_pool_relu", "relu(pool(z))", kGrappler, false,
     "the order TF's arithmetic optimizer makes of a forward-only pair"},
};

// The op types of `role` (a name of kRoles; empty for another name).
inline std::unordered_set<std::string> RoleOps(std::string_view role) {
  std::unordered_set<std::string> ops;
  for (const Role& r : kRoles)
    if (role == r.name)
      for (const char* const* o = r.ops; *o != nullptr; ++o) ops.insert(*o);
  return ops;
}

// The table as text, one line per role ("role NAME OP,OP CONDITION") and pattern ("pattern NAME
// CHAIN FUSERS GRADIENT NOTE": FUSERS "grappler,trace" or one of them, GRADIENT "gradient" or
// "forward"), tab-separated.
inline std::string PatternTable() {
  std::string s;
  for (const Role& r : kRoles) {
    s += std::string("role\t") + r.name + "\t";
    for (const char* const* o = r.ops; *o != nullptr; ++o)
      s += std::string(o == r.ops ? "" : ",") + *o;
    s += std::string("\t") + r.condition + "\n";
  }
  for (const Pattern& p : kPatterns) {
    std::string fusers = (p.fusers & kGrappler) ? "grappler" : "";
    if (p.fusers & kTraceTime) fusers += fusers.empty() ? "trace" : ",trace";
    s += std::string("pattern\t") + p.name + "\t" + p.chain + "\t" + fusers + "\t" +
         (p.gradient ? "gradient" : "forward") + "\t" + p.note + "\n";
  }
  return s;
}

}  // namespace grappler
}  // namespace tf_relupool

#endif  // TF_RELUPOOL_CC_GRAPPLER_PATTERNS_H_
