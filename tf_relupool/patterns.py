"""The pattern table: what tf_relupool fuses, read from the op library (cc/grappler/patterns.h).

The Grappler pass (and rewrite_graph, which runs it) and the trace-time fusion under XLA
(keras_fusion) name the same patterns: both read this one table, compiled into the library. A
role is the set of op types that can play one part of a pattern ("pool": MaxPool, MaxPoolV2;
"pad": Pad, PadV2; ...); a pattern is a chain of roles from the pool's output back to z
("pool(pad(relu(z)))") with the fusers that match it ("grappler", "trace") and whether its
gradient is fused too.

    from tf_relupool import patterns
    patterns.role_ops("pad")                    # frozenset({"Pad", "PadV2"})
    [p.name for p in patterns.for_fuser("trace")]

The trace-time fuser's patterns are also held here in Python (TRACE_PATTERNS, TRACE_ROLES), so
that the switch under XLA works where the op library cannot load: tests/test_patterns.py checks
that they equal the library's.
"""
import collections
import functools

Role = collections.namedtuple("Role", "name ops condition")
Pattern = collections.namedtuple("Pattern", "name chain fusers gradient note")
FUSERS = ("grappler", "trace")


def parse_chain(text):
    """"pool(pad(relu(z)))" -> ("pool", "pad", "relu"): the roles from the pool's output back."""
    roles = []
    rest = text.strip()
    while rest != "z":
        role, paren, inner = rest.partition("(")
        if not paren or not inner.endswith(")") or not role.isidentifier():
            raise ValueError(f"pattern chain {text!r}: expected role(...(z))")
        roles.append(role)
        rest = inner[:-1]
    if not roles:
        raise ValueError(f"pattern chain {text!r} names no role")
    return tuple(roles)


def parse_table(text):
    """({role name: Role}, (Pattern, ...)) from tf_relupool_grappler_patterns' text."""
    roles, found = {}, []
    for line in text.splitlines():
        if not line.strip():
            continue
        kind, *fields = line.split("\t")
        if kind == "role" and len(fields) == 3:
            name, ops, condition = fields
            roles[name] = Role(name, frozenset(ops.split(",")), condition)
        elif kind == "pattern" and len(fields) == 5 and fields[3] in ("gradient", "forward"):
            name, chain, fusers, gradient, note = fields
            found.append(Pattern(name, parse_chain(chain), frozenset(fusers.split(",")),
                                 gradient == "gradient", note))
        else:
            raise ValueError(f"pattern table line {line!r}: not a role or pattern")
    for p in found:
        unknown = [r for r in p.chain if r not in roles]
        if unknown or not p.fusers <= set(FUSERS):
            raise ValueError(f"pattern {p.name}: unknown roles {unknown} or fusers {p.fusers}")
    return roles, tuple(found)


#: The trace-time fuser's part of the table, in Python: the XLA route (keras_fusion) matches these
#: without the op library, which it never needs (its fused op is stock TensorFlow).
#: tests/test_patterns.py checks that they are the library's trace patterns and role ops.
TRACE_ROLES = {
    "pool": Role("pool", frozenset({"MaxPool", "MaxPoolV2"}),
                 "2-D, window as attrs or constant inputs"),
    "pad": Role("pad", frozenset({"Pad", "PadV2"}),
                "constant paddings, a pad value c with relu(c) == c"),
    "relu": Role("relu", frozenset({"Relu"}), ""),
    "monotone": Role("monotone", frozenset({"Relu6", "LeakyRelu"}),
                     "non-decreasing, its gradient a select on its output (LeakyRelu: alpha >= 0)"),
}
TRACE_PATTERNS = (
    Pattern("relu_max_pool", ("pool", "relu"), frozenset(FUSERS), True, ""),
    Pattern("relu_pad_max_pool", ("pool", "pad", "relu"), frozenset(FUSERS), True,
            "ZeroPadding2D between: relu(pad(z)) == pad(relu(z)); the gradient through the Pad's "
            "Slice"),
    Pattern("monotone_max_pool", ("pool", "monotone"), frozenset({"trace"}), True,
            "max_pool(f(z)) for a non-decreasing f: the first maximum of f(z), f's stock gradient "
            "read from the pooled output"),
)


def trace_patterns():
    """The trace-time fuser's patterns (TRACE_PATTERNS), without the op library."""
    return TRACE_PATTERNS


def trace_role_ops(role):
    """The op types that play `role` for the trace-time fuser (KeyError for another role)."""
    return TRACE_ROLES[role].ops


@functools.lru_cache(maxsize=None)
def table():
    """({role name: Role}, (Pattern, ...)): the table of the loaded library."""
    from tf_relupool import _clib
    return parse_table(_clib.pattern_table_text())


def role_ops(role):
    """The op types that play `role` (KeyError for a role the table does not have)."""
    return table()[0][role].ops


def for_fuser(fuser):
    """The patterns the fuser ("grappler" or "trace") matches, in the table's order."""
    if fuser not in FUSERS:
        raise ValueError(f"fuser must be one of {FUSERS}, got {fuser!r}")
    return tuple(p for p in table()[1] if fuser in p.fusers)
